"""Fidelity to the reference where a slip would go unnoticed on the real model: the engram token map and
gate, checkpoints without their optional parts, and presets that are one model however they are built."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from flashserve import LLM, SamplingParams
from flashserve.config import ConfigError, preset_config
from flashserve.config.model_config import config_from_dict, replace
from flashserve.config.presets import preset_json
from flashserve.config.serialize import config_to_json
from flashserve.model import load_model
from flashserve.model.checkpoint import INDEX_FILE, CheckpointError, save_checkpoint
from flashserve.model.engram import Engram, EngramMapError, compressed_token_map
from flashserve.model.init import random_init
from flashserve.model.transformer import Transformer

# ------------------------------------------------------------------------------ a byte-level vocabulary


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ``tokenizers``' ByteLevel spells bytes with)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Words chosen for the five ways a hand-written normaliser drifts from the reference's.
WORDS = [
    "ß", "ð", "æ", "ø", "©", "°",        # real words spelled like lone bytes 0xDF, 0xF0, ... in byte-level
    "का", "क", "ab\u20dd", "ab",         # StripAccents drops spacing (Mc) and enclosing (Me) marks too
    "ΟΔΟΣ", "οδοσ", "οδος",              # HF lowercases a final Σ to σ, Python to ς
    "\x1cab", "ab\x1f", " ab ",          # HF's Strip keeps the C0 separators 0x1c-0x1f
    " ", "  ", "\n", "\t\t", "Café", "cafe", "CAFÉ", "Hello", " hello", "hello\n",
]


def byte_level_tokenizer() -> Tokenizer:
    """Every single byte, the words above and two special tokens, as a byte-level BPE of ``tokenizers``."""
    spell = _byte_chars()
    vocab = {spell[b]: b for b in range(256)}
    for w in WORDS:
        vocab.setdefault("".join(spell[b] for b in w.encode()), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin|>", "<|end|>"])
    return tok


def reference_map(tok: Tokenizer) -> tuple[list[int], int]:
    """The reference's construction, written out here from the issue's description."""
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    seen: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(seen.setdefault(key, len(seen)))
    return out, len(seen)


def test_token_map_equals_the_reference_class_for_class():
    tok = byte_level_tokenizer()
    got, n = compressed_token_map(tok)
    assert (got, n) == reference_map(tok)
    assert len(got) == tok.get_vocab_size(with_added_tokens=True)


def test_token_map_cases_from_the_issue():
    tok = byte_level_tokenizer()
    cls, _ = compressed_token_map(tok)
    spell = _byte_chars()
    word = {w: tok.token_to_id("".join(spell[b] for b in w.encode())) for w in WORDS}
    for w in ("ß", "ð", "æ", "ø", "©", "°"):  # the lone byte's raw key equals the word's text: one class
        assert tok.decode([ord(w)]) == "\ufffd"
        assert cls[ord(w)] == cls[word[w]], w
    assert cls[word["का"]] == cls[word["क"]]
    assert cls[word["ab\u20dd"]] == cls[word["ab"]]
    assert cls[word["ΟΔΟΣ"]] == cls[word["οδοσ"]] != cls[word["οδος"]]
    assert cls[word["\x1cab"]] != cls[word["ab"]] and cls[word["ab\x1f"]] != cls[word["ab"]]
    assert cls[word[" ab "]] == cls[word["ab"]]
    assert cls[word[" "]] == cls[word["  "]] == cls[word["\n"]] == cls[word["\t\t"]]
    assert cls[word["Café"]] == cls[word["cafe"]] == cls[word["CAFÉ"]]
    assert cls[word["Hello"]] == cls[word[" hello"]] == cls[word["hello\n"]]


# ------------------------------------------------------------------------------ the map in a checkpoint


def _v41_folder(path: Path, tok: Tokenizer, compressed: int) -> Path:
    """A tiny V4.1 checkpoint whose engram classes come from ``tok`` (smaller than the 512-id head)."""
    cfg = replace(preset_config("tiny-v41"), engram_compressed_vocab_size=compressed)
    model = random_init(Transformer(cfg), seed=3)
    save_checkpoint(model.checkpoint_tensors(), path, cfg, quantize=False)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_checkpoint_with_its_tokenizer_loads_the_map(tmp_path):
    tok = byte_level_tokenizer()
    expected, n = reference_map(tok)
    path = _v41_folder(tmp_path, tok, n)
    model = load_model(path)
    table = model.engram_hasher.token_map.tolist()
    pad_class = expected[model.cfg.engram_pad_token_id]
    assert table == expected + [pad_class] * (model.cfg.vocab_size - len(expected))  # no class past the tokenizer
    llm = LLM(str(path), enforce_eager=True)
    assert llm.engine.model.engram_hasher.token_map.tolist() == table
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_class_count_mismatch_refuses_to_load(tmp_path):
    tok = byte_level_tokenizer()
    _, n = reference_map(tok)
    path = _v41_folder(tmp_path, tok, n + 1)
    for load in (lambda: load_model(path), lambda: LLM(str(path), enforce_eager=True)):
        with pytest.raises(EngramMapError, match=f"gives {n} engram token classes.*is {n + 1}"):
            load()


# ------------------------------------------------------------------------------ the gate at zero


def test_engram_gate_at_zero_matches_the_reference():
    cfg = preset_config("tiny-v41")
    eng = Engram(cfg, rows=16)
    n, D = cfg.hc_mult, cfg.hidden_size
    with torch.no_grad():
        eng.embed.weight.normal_()
        eng.wkv.weight.zero_()
        eng.wkv.weight[n * D:].normal_()  # keys zero (so every dot is exactly +0), a non-zero value
    x = torch.rand(1, 3, n, D) + 0.5
    rows = torch.randint(0, 16, (1, 3, eng.wkv.in_features // cfg.engram_head_dim))
    with torch.no_grad():
        out = eng(x, rows, None)
        value = eng.wkv(eng.embed(rows).flatten(-2))[..., n * D:]
    dot = torch.tensor(0.0)
    gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(dot.abs(), min=1e-6)), dot))
    assert gate.item() == pytest.approx(0.50025, abs=1e-6)  # sigmoid(+1e-3), not sigmoid(0)
    torch.testing.assert_close(out, x + gate * value[..., None, :], rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------ optional checkpoint parts


def _drop(path: Path, unwanted) -> list[str]:
    """Rewrite a single-file checkpoint without the tensors ``unwanted(name)`` picks; returns their names."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    gone = sorted(k for k in tensors if unwanted(k))
    save_file({k: v for k, v in tensors.items() if k not in gone}, str(file), metadata={"format": "pt"})
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in gone}
    (path / INDEX_FILE).write_text(json.dumps(index))
    return gone


def test_transformers_saved_v4_folder_loads_and_serves(tmp_path, caplog):
    cfg = preset_config("tiny-v4")
    model = random_init(Transformer(cfg, with_mtp=False), seed=5)
    save_checkpoint(model.checkpoint_tensors(), tmp_path, cfg, fmt="hf")  # as save_pretrained: no MTP
    with caplog.at_level(logging.INFO, logger="flashserve"):
        loaded = load_model(tmp_path)
    assert loaded.mtp is None
    assert sum("no MTP/DSpark weights" in r.getMessage() for r in caplog.records) == 1
    ids = torch.tensor([[5, 17, 42, 99]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    out = LLM(str(tmp_path), enforce_eager=True).generate(
        ["fox"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.fixture(scope="module")
def v41_full(tmp_path_factory):
    cfg = preset_config("tiny-v41")
    model = random_init(Transformer(cfg), seed=7)
    return cfg, model, tmp_path_factory


def _saved(v41_full, name: str) -> Path:
    cfg, model, factory = v41_full
    path = factory.mktemp(name)
    save_checkpoint(model.checkpoint_tensors(), path, cfg, quantize=False)
    return path


def test_v41_folder_without_bias_vl_and_drafters_loads_and_serves(v41_full, caplog):
    _, model, _ = v41_full
    path = _saved(v41_full, "no-optional")
    gone = _drop(path, lambda k: k.startswith("mtp.") or k.endswith(".bias_vl"))
    assert any(k.endswith(".bias_vl") for k in gone) and any(k.startswith("mtp.") for k in gone)
    with caplog.at_level(logging.INFO, logger="flashserve"):
        loaded = load_model(path, fake_quant=False)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no MTP/DSpark weights" in m for m in messages) == 1
    assert sum("no router bias_vl" in m for m in messages) == 1
    assert loaded.mtp is None
    biases = [p for n, p in loaded.named_parameters() if n.endswith("bias_vl")]
    assert biases and all(bool((b == 0).all()) for b in biases)
    ids = torch.tensor([[5, 17, 42, 99, 7, 8]])  # text positions never read bias_vl: same logits as the full model
    model.fake_quant = False
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    out = LLM(str(path), enforce_eager=True).generate(
        ["fox"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("dropped", ["layers.3.attn.wkv.weight", "mtp.0.attn.wkv.weight",
                                     "layers.2.ffn.gate.bias_vl"])
def test_any_other_gap_still_fails_with_the_list(v41_full, dropped):
    path = _saved(v41_full, "gap")
    assert _drop(path, lambda k: k == dropped) == [dropped]
    with pytest.raises(CheckpointError, match=r"1 missing[\s\S]*" + dropped.replace(".", r"\.")):
        load_model(path)


# ------------------------------------------------------------------------------ presets and config rules


@pytest.mark.parametrize("preset", ["tiny-v41", "tiny-v4"])
def test_preset_is_one_model_with_or_without_drafters(preset):
    reference = dict(load_model(preset).named_parameters())
    engine = dict(LLM(preset, enforce_eager=True).engine.model.named_parameters())
    assert set(engine) < set(reference)  # the engine builds no drafters
    for name, p in engine.items():
        assert torch.equal(p, reference[name]), name
    buffers = dict(load_model(preset, with_mtp=False).named_buffers())
    for name, b in load_model(preset).named_buffers():
        if name in buffers:
            assert torch.equal(b, buffers[name]), name


def test_index_source_of_another_kv_source_is_refused_with_the_reason():
    raw = preset_json("tiny-v41")
    raw["text_config"]["index_source_layer_ids"] = [2, 6, 8]  # layers 4, 5 read KV of 4, top-k of 2
    with pytest.raises(ConfigError, match=r"layer 4 reads the compressed KV of layer 4 but the top-k of index "
                                          r"source 2.*make layer 4 an index source"):
        config_from_dict(raw)
    assert config_to_json(preset_config("tiny-v41"))  # the preset itself stays valid
