"""Real-size slices (flashserve.bench.slice): which layers a slice keeps, its sizes, and that a slice written with
narrowed widths is a released-layout checkpoint the engine loads and runs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from flashserve.bench import slice as slicing
from flashserve.config.model_config import config_from_dict
from flashserve.config.presets import preset_config, preset_json

# tiny widths for the written slices (the layer structure stays the real model's)
_NARROW = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
           "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
           "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "candidate_topk_blocks",
           "candidate_block_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size",
           "quantization_config")


def _narrow(tiny: str) -> dict:
    raw = preset_json(tiny)
    text = {**raw, **raw.get("text_config", {})}
    return {k: text[k] for k in _NARROW if k in text}


def test_a_v41_slice_keeps_every_role_from_four_layers():
    """V4.1-Flash: the decoder's KV source (20) first, then a layer re-indexing its entries (24), a reader of that
    top-k (25), and a ratio-2 KV source with an engram table (14); the slice's config says the same roles."""
    full = preset_config("deepseek-v41-flash")
    assert [slicing.slice_layers(full, "deepseek-v41-flash", n) for n in (1, 2, 3, 4)] == [
        [20], [20, 24], [20, 24, 25], [14, 20, 24, 25]]
    cfg = config_from_dict(slicing.slice_config("deepseek-v41-flash", [14, 20, 24, 25], 1 << 20))
    assert [cfg.layer_role(i) for i in range(4)] == ["full", "full", "reindex", "reuse"]
    assert cfg.compress_ratios == (2, 1, 1, 1) and cfg.decoder_start == 1 and cfg.candidate_source_layer_id == 1
    assert cfg.engram_layer_ids == (0,) and cfg.num_nextn_predict_layers == 0 and cfg.vision is None
    assert cfg.hidden_size == 5120 and cfg.n_routed_experts == 384 and cfg.moe_intermediate_size == 2304
    assert 0.9 * (1 << 20) <= cfg.engram_num_embeddings[0] <= 1.1 * (1 << 20)
    # more layers than roles: the next ones whose sources are kept
    assert slicing.slice_layers(full, "deepseek-v41-flash", 6) == [0, 1, 14, 20, 24, 25]


def test_a_v4_slice_keeps_a_hash_routed_csa_and_an_hca_layer():
    full = preset_config("deepseek-v4-flash")
    assert slicing.slice_layers(full, "deepseek-v4-flash", 2) == [2, 3]
    cfg = config_from_dict(slicing.slice_config("deepseek-v4-flash", [2, 3], 0))
    assert [cfg.layer_role(i) for i in range(2)] == ["csa", "hca"] and cfg.hash_layer_ids == (0,)
    with pytest.raises(ValueError, match="--layers must be 1..43"):
        slicing.slice_layers(full, "deepseek-v4-flash", 0)


def test_sizes_are_printed_and_the_disk_checked_before_anything_is_written(tmp_path, monkeypatch):
    lines: list[str] = []
    total = slicing.write_slice(tmp_path / "s", "deepseek-v41-flash", 1, dry_run=True, echo=lines.append)
    # one real layer's 384 experts: 3 x 2304 x 5120 MXFP4 values (half a byte) + a scale byte per 32, each
    experts = 384 * 3 * 2304 * 5120 * (1 / 2 + 1 / 32)
    assert experts < total < experts + 3 * 2**30 and lines[0].startswith("deepseek-v41-flash slice: layers 20 (full)")
    assert any(line.split()[0] == "routed_expert" for line in lines[1:]) and not (tmp_path / "s").exists()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 << 20))
    with pytest.raises(OSError, match=r"has 0.01 GiB free; the slice needs 9\.\d\d GiB"):
        slicing.write_slice(tmp_path / "s", "deepseek-v41-flash", 1, echo=lines.append)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("model, tiny, layers", [("deepseek-v41-flash", "tiny-v41", 4),
                                                 ("deepseek-v4-flash", "tiny-v4", 2)])
def test_a_narrowed_slice_is_a_released_checkpoint_the_engine_runs(tmp_path, model, tiny, layers):
    """Written with the tiny preset's widths: FP8 dense weights with UE8M0 block scales, MXFP4 experts, bf16
    embeddings; the engine loads it keeping the stored formats and greedy-decodes finite logits."""
    from flashserve.model.loader import load_model

    out = tmp_path / "slice"
    slicing.write_slice(out, model, layers, engram_rows=4000, dims=_narrow(tiny), shard_bytes=64 << 10,
                        echo=lambda _: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    shard = out / index["weight_map"]["layers.0.ffn.experts.0.w1.weight"]
    with safe_open(shard, framework="pt") as f:
        assert f.get_slice("layers.0.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert f.get_slice("layers.0.ffn.experts.0.w1.scale").get_dtype() == "F8_E8M0"
    with safe_open(out / index["weight_map"]["layers.0.attn.wq_a.weight"], framework="pt") as f:
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
    model_ = load_model(out, fake_quant=False, with_mtp=False)
    with torch.no_grad():
        logits = model_(torch.arange(3, 40).view(1, -1)).logits
    assert logits.shape == (1, 37, model_.cfg.vocab_size) and torch.isfinite(logits).all()
    assert 0.2 < float(logits.std()) < 50  # weights scaled to keep magnitudes: neither vanishing nor exploding


def test_a_slice_with_an_engram_layer_serves_through_its_synthetic_tokenizer(tmp_path):
    """The slice's tokenizer.json spans its vocabulary with exactly the config's engram classes (here fewer than the
    ids, so the engram hashes by the tokenizer's classes): the engine starts from the folder alone and greedy-decodes;
    a case variant of a word shares its word's class, and the chat tokens sit at the config's ids."""
    from flashserve.engine import EngineConfig, LLMEngine, SamplingParams
    from flashserve.engine.tokenizer import BOS, EOS, load_tokenizer
    from flashserve.model.engram import compressed_token_map

    out = tmp_path / "slice"
    dims = {**_narrow("tiny-v41"), "engram_compressed_vocab_size": 300}
    lines: list[str] = []
    slicing.write_slice(out, "deepseek-v41-flash", 4, engram_rows=4000, dims=dims, shard_bytes=1 << 30,
                        echo=lines.append)
    cfg = config_from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.engram_layer_ids and cfg.engram_compressed_vocab_size == 300 < cfg.vocab_size == 512
    assert "  tokenizer.json   synthetic, 512 ids, 300 engram classes" in lines
    tok = load_tokenizer(out, cfg.vocab_size)
    assert tok.backend.get_vocab_size(with_added_tokens=True) == 512
    assert compressed_token_map(tok.backend)[1] == 300
    assert (tok.token_to_id(BOS), tok.token_to_id(EOS)) == (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.is_special(0) and not tok.is_special(tok.token_to_id("</think>"))  # </think> survives skipping
    with pytest.raises(ValueError, match="512 ids .* cannot have 600 engram classes"):  # more classes than ids
        slicing.slice_tokenizer(dataclasses.replace(cfg, engram_compressed_vocab_size=600))

    engine = LLMEngine(EngineConfig(model=str(out), max_num_seqs=1, kv_memory="8MiB", max_model_len=256,
                                    enforce_eager=True, threads=1, speculative_config="off"))
    try:
        token_map = engine.model.engram_hasher.token_map
        variant = next(t for t in map(tok.id_to_token, range(cfg.vocab_size)) if t.isalpha() and not t.islower())
        word = tok.token_to_id(variant.lower())
        assert word is not None and token_map[tok.token_to_id(variant)] == token_map[word]
        assert len(set(token_map.tolist())) == 300
        prompt = f"{BOS}<｜User｜>{variant} {variant.lower()} {tok.id_to_token(100)}<｜Assistant｜></think>"
        ids = tok.encode(prompt)
        assert ids == [0, *map(tok.token_to_id, ("<｜User｜>", variant)), word, 100,
                       *map(tok.token_to_id, ("<｜Assistant｜>", "</think>"))]
        engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    [result] = done
    assert result.prompt_token_ids == ids
    assert len(result.outputs[0].token_ids) == 4 and result.outputs[0].finish_reason == "length"
    assert all(0 <= t < cfg.vocab_size for t in result.outputs[0].token_ids)


def test_a_gguf_is_refused_before_anything_is_written(tmp_path, capsys):
    """--gguf is for V4-Flash (llama.cpp's converter has no V4.1 model) and never overwrites a file: both are said
    before the slice is written."""
    out = tmp_path / "slice"
    with pytest.raises(SystemExit) as e:
        slicing.main(["--model", "deepseek-v41-flash", "--layers", "1", "--out", str(out), "--gguf",
                      str(tmp_path / "s.gguf")])
    assert e.value.code == 2 and "--gguf: llama.cpp's converter reads V4-Flash checkpoints" in capsys.readouterr().err
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"keep")
    with pytest.raises(SystemExit) as e:
        slicing.main(["--model", "deepseek-v4-flash", "--layers", "2", "--out", str(out), "--gguf", str(taken)])
    assert e.value.code == 2 and f"--gguf: {taken} exists" in capsys.readouterr().err
    assert not out.exists() and taken.read_bytes() == b"keep"
