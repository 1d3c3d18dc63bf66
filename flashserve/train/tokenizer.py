"""Byte-level BPE tokenizer for the embedded default model, trained on the interpreter's standard library.

Ids 0-15 and 16 are the V4.1 special and chat tokens of docs/architecture.md#tokenizer-and-chat-format (the tiny
presets' numbering: BOS 0, EOS 1, PAD 2, ``<｜System｜>`` 3 which is also DSpark's noise token, ... and
``<｜deepseek_image｜>`` 16); then the 256 byte symbols and the learned merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..engine.tokenizer import TINY_SPECIALS

IMAGE_TOKEN = "<｜deepseek_image｜>"
# id -> (text, special): the tiny presets' specials 0-15, the image token moved to 16
SPECIALS: dict[int, tuple[str, bool]] = {i: v for i, v in TINY_SPECIALS.items() if v[0] != IMAGE_TOKEN}
SPECIALS[len(SPECIALS)] = (IMAGE_TOKEN, True)
IMAGE_TOKEN_ID = len(SPECIALS) - 1
NOISE_TOKEN_ID = 3  # <｜System｜>, as the released model's dspark_noise_token_id (128799 = <｜System｜>)

# the chat template the engine uses for V4.1 checkpoints (add_bos/add_eos off,
# docs/architecture.md#tokenizer-and-chat-format)
TOKENIZER_CONFIG = {
    "add_bos_token": False, "add_eos_token": False, "bos_token": SPECIALS[0][0], "eos_token": SPECIALS[1][0],
    "pad_token": SPECIALS[2][0], "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
    "clean_up_tokenization_spaces": False, "legacy": True,
}


def train_tokenizer(texts: list[str], vocab_size: int):
    """A ``tokenizers.Tokenizer`` with ``vocab_size`` ids trained on ``texts`` (deterministic for the input)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[SPECIALS[i][0] for i in range(len(SPECIALS))],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    data = json.loads(tok.to_str())
    # the released flags: <｜System｜>, <think> and </think> are added tokens that are not special
    for entry in data["added_tokens"]:
        special = {t: s for t, s in SPECIALS.values()}[entry["content"]]
        entry["special"] = special
        entry["normalized"] = False
    tok = Tokenizer.from_str(json.dumps(data))
    for i, (text, _) in SPECIALS.items():
        assert tok.token_to_id(text) == i, (text, tok.token_to_id(text), i)
    return tok


def write_tokenizer_files(tok, folder: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
