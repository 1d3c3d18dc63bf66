"""Tokenizers: the checkpoint's ``tokenizer.json`` (the ``tokenizers`` library), or a built-in byte-level BPE
for the tiny presets (512 ids: the specials of docs/architecture.md#tokenizer-and-chat-format inside the vocabulary, 256
byte symbols, 239 merges)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("flashserve.engine")

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# id -> (text, special). <｜System｜> is special=false in V4.1 (survives skip_special_tokens); the think
# markers are kept in text too so reasoning parsers can find them.
TINY_SPECIALS: dict[int, tuple[str, bool]] = {
    0: (BOS, True), 1: (EOS, True), 2: (PAD, True), 3: ("<｜System｜>", False), 4: ("<｜User｜>", True),
    5: ("<｜Assistant｜>", True), 6: ("<think>", False), 7: ("</think>", False), 8: ("｜DSML｜", True),
    9: ("<｜latest_reminder｜>", True), 10: ("<｜action｜>", True), 11: ("<｜query｜>", True),
    12: ("<｜authority｜>", True), 13: ("<｜domain｜>", True), 14: ("<｜title｜>", True),
    15: ("<｜read_url｜>", True), 511: ("<｜deepseek_image｜>", True),
}
TINY_VOCAB = 512
_BYTE_BASE = 16

_CORPUS = """The quick brown fox jumps over the lazy dog. Hello, world! This is a tiny tokenizer for the
flashserve engine tests. It learns a few hundred merges from this text so that common English words,
spaces and punctuation become single tokens. The model is DeepSeek V4 and V4.1, an inference engine that
serves many agents at once: prefill, decode, sampling, streaming, stop strings and prefix caching.
def main(): return 0  # code, numbers 0123456789, and JSON {"name": "value", "count": 42} appear too.
Once upon a time there was a little model that wanted to think before it answered the user's question.
<tool_result>ok</tool_result> The assistant said: I will call the function with these parameters.
"""


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _train_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: lexicographically smallest)."""
    split = {w: list(w) for w in words}
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            s = split[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w in words:
            s, out, i = split[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    return merges


@lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The built-in tiny tokenizer as a ``tokenizer.json`` string (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab = {text: i for i, (text, _) in TINY_SPECIALS.items()}
    for b in range(256):
        vocab[b2u[b]] = _BYTE_BASE + b
    free = [i for i in range(_BYTE_BASE + 256, TINY_VOCAB) if i not in TINY_SPECIALS]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: Counter = Counter(w for w, _ in pre.pre_tokenize_str(_CORPUS))
    merges = _train_merges(words, len(free))
    for (a, b), i in zip(merges, free):
        vocab[a + b] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges[:len(free)]))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=s, normalized=False) for i, (t, s) in sorted(TINY_SPECIALS.items())
                    if not s])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, (t, s) in sorted(TINY_SPECIALS.items()) if s])
    return tok.to_str()


class Tokenizer:
    """The engine's tokenizer interface over a ``tokenizers.Tokenizer``."""

    def __init__(self, tok, *, eos_token_id: int | None = None, bos_token_id: int | None = None,
                 vocab_size: int | None = None):
        self._tok = tok
        added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self.special_tokens: dict[str, int] = {a.content: i for i, a in added.items()}
        self._special_ids = {i for i, a in added.items() if a.special}
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.special_tokens.get(EOS, 1)
        self.bos_token_id = bos_token_id if bos_token_id is not None else self.special_tokens.get(BOS, 0)
        self.vocab_size = vocab_size or tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids


def load_tokenizer(model_path_or_preset: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """``tokenizer.json`` from a checkpoint folder when present, the vocabulary of a GGUF file
    (:mod:`flashserve.gguf.vocab`), else the built-in tiny tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer

    from ..gguf import is_gguf_path

    path = Path(str(model_path_or_preset))
    if is_gguf_path(path):
        from ..gguf.file import open_gguf
        from ..gguf.vocab import special_ids, tokenizer_from_gguf

        model = open_gguf(path)
        ids = special_ids(model)
        keep = [text for text, special in TINY_SPECIALS.values() if not special]  # the family's tokens kept in text
        return Tokenizer(tokenizer_from_gguf(model, keep), eos_token_id=ids.get("eos"), bos_token_id=ids.get("bos"),
                         vocab_size=vocab_size)
    tj = path / "tokenizer.json"
    eos = bos = None
    if path.is_dir():
        cfgp = path / "config.json"
        if cfgp.exists():
            try:
                data = json.loads(cfgp.read_text())
                data = {**data, **data.get("text_config", {})}
                eos, bos = data.get("eos_token_id"), data.get("bos_token_id")
                if isinstance(eos, list):
                    eos = eos[0]
            except (OSError, ValueError):
                pass
    if tj.exists():
        return Tokenizer(HFTokenizer.from_file(str(tj)), eos_token_id=eos, bos_token_id=bos, vocab_size=vocab_size)
    if vocab_size is not None and vocab_size != TINY_VOCAB:
        log.warning("no tokenizer.json in %s; using the built-in %d-id tokenizer for a %d-id model",
                    model_path_or_preset, TINY_VOCAB, vocab_size)
    return Tokenizer(HFTokenizer.from_str(tiny_tokenizer_json()), eos_token_id=eos, bos_token_id=bos,
                     vocab_size=vocab_size)


def set_engram_token_map(model, tokenizer: Tokenizer) -> bool:
    """Give the model's engram hasher the tokenizer's compressed-class map (docs/architecture.md#engram-hash-ids).

    Returns False where the model has no engram or its config asks for identity hashing. Raises
    :class:`EngramMapError`, naming both counts, when the tokenizer's class count is not the config's.
    """
    hasher = getattr(model, "engram_hasher", None)
    if hasher is None or not hasher.needs_token_map:
        return False
    from ..model.engram import compressed_token_map

    hasher.set_token_map(*compressed_token_map(tokenizer.backend))
    return True
