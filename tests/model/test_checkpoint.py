"""Checkpoint I/O: released-format round trips, transformers' DeepSeek-V4 naming, and corrupt checkpoints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flashserve.config import preset_config, read_config_json
from flashserve.config.checkpoint_layout import FP4, FP8, FP8_TABLE, INT, checkpoint_layout
from flashserve.config.model_config import ModelConfig
from flashserve.model import checkpoint as ckpt
from flashserve.model import quant
from flashserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

TINY = ("tiny-v4", "tiny-v41")


# ------------------------------------------------------------------------------------------ helpers


def random_weights(cfg: ModelConfig, *, mtp: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """A plain dict of random tensors with every layout name (float32; int64 routing tables)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in checkpoint_layout(cfg, mtp=mtp):
        if t.kind == INT:
            out[t.name] = torch.randint(0, cfg.n_routed_experts, t.shape, generator=g)
        else:
            out[t.name] = torch.randn(t.shape, generator=g) * 0.05
    return out


def empty_like_poisoned(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destinations pre-filled with values no checkpoint holds, so unfilled entries are visible."""
    return {k: torch.full_like(v, -1 if not v.is_floating_point() else float("nan")) for k, v in src.items()}


def rewrite_single_file(folder: Path, edit) -> Path:
    """Apply ``edit(dict)`` to the tensors of a one-shard checkpoint and write them back."""
    f = folder / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    return f


@pytest.fixture(scope="module")
def tiny_v4_float(tmp_path_factory) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    cfg = preset_config("tiny-v4")
    src = random_weights(cfg)
    path = tmp_path_factory.mktemp("tiny_v4_float")
    save_checkpoint(src, path, cfg, quantize=False)
    return cfg, src, path


def fresh_copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in path.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ------------------------------------------------------------------------------------------ released format


@pytest.mark.parametrize("name", TINY)
def test_float_roundtrip_is_exact(name: str, tmp_path: Path) -> None:
    cfg = preset_config(name)
    src = random_weights(cfg)
    save_checkpoint(src, tmp_path, cfg, quantize=False, max_shard_bytes=1 << 20)
    assert read_config_json(tmp_path) == cfg
    dest = empty_like_poisoned(src)
    load_checkpoint(dest, tmp_path, cfg)
    for k in src:
        assert torch.equal(dest[k], src[k]), k


@pytest.mark.parametrize("name", TINY)
def test_quantized_roundtrip(name: str, tmp_path: Path) -> None:
    cfg = preset_config(name)
    src = random_weights(cfg)
    save_checkpoint(src, tmp_path, cfg)
    dest = empty_like_poisoned(src)
    load_checkpoint(dest, tmp_path, cfg)
    b = cfg.quantization.weight_block_size
    for t in checkpoint_layout(cfg):
        w, got = src[t.name], dest[t.name]
        if t.kind == FP8:
            want = quant.dequantize_fp8_blocks(*quant.quantize_fp8_blocks(w, b), torch.float32)
            assert torch.allclose(got, w, rtol=2.0 ** -4, atol=1e-3 * w.abs().max().item()), t.name
        elif t.kind == FP4:
            want = quant.dequantize_mxfp4(*quant.quantize_mxfp4(w), torch.float32)
            assert (got - w).abs().max() <= w.abs().max() / 4, t.name
        elif t.kind == FP8_TABLE:
            want = quant.dequantize_fp8_rows(*quant.quantize_fp8_rows(w), torch.float32)
            assert torch.allclose(got, w, rtol=2.0 ** -4, atol=1e-6), t.name
        elif t.kind == "bf16":
            want = w.to(torch.bfloat16).float()
        else:
            want = w
        assert torch.equal(got, want), t.name


def test_block_size_is_read_from_the_scales(tmp_path: Path) -> None:
    """A config whose weight_block_size disagrees with the files still decodes them (inferred from shapes)."""
    cfg = preset_config("tiny-v4")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path, cfg)  # 32 x 32 blocks
    ref, dest = empty_like_poisoned(src), empty_like_poisoned(src)
    load_checkpoint(ref, tmp_path, cfg)
    other = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, weight_block_size=128))
    load_checkpoint(dest, tmp_path, other)
    assert all(torch.equal(dest[k], ref[k]) for k in src)


def test_quantized_storage_dtypes_and_index(tmp_path: Path) -> None:
    cfg = preset_config("tiny-v41")
    src = random_weights(cfg)
    shards = save_checkpoint(src, tmp_path, cfg, max_shard_bytes=200_000)
    assert len(shards) > 1 and all(p.name.startswith("model-") for p in shards)
    index = json.loads((tmp_path / ckpt.INDEX_FILE).read_text())
    stored: dict[str, tuple[str, list[int]]] = {}
    for p in shards:
        with safe_open(p, "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == p.name
                stored[k] = (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
    assert set(stored) == set(index["weight_map"])
    sizes = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
    assert index["metadata"]["total_size"] == sum(
        sizes[d] * torch.Size(s).numel() for d, s in stored.values())
    assert stored["layers.0.attn.wq_a.weight"] == ("F8_E4M3", [32, 64])
    assert stored["layers.0.attn.wq_a.scale"] == ("F8_E8M0", [1, 2])
    assert stored["layers.0.ffn.experts.3.w2.weight"] == ("I8", [64, 32])
    assert stored["layers.0.ffn.experts.3.w2.scale"] == ("F8_E8M0", [64, 2])
    rows = cfg.engram_num_embeddings[0]
    assert stored["layers.1.engram.embed.weight"] == ("F8_E4M3", [rows, 16])
    assert stored["layers.1.engram.embed.scale"] == ("F8_E8M0", [rows, 1])
    assert stored["layers.0.attn.attn_sink"][0] == "F32" and stored["embed.weight"][0] == "BF16"


def test_uint8_scales_are_accepted(tmp_path: Path) -> None:
    """Writers without F8_E8M0 store scales as U8; the reader treats them the same."""
    cfg = preset_config("tiny-v4")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path, cfg)
    ref = empty_like_poisoned(src)
    load_checkpoint(ref, tmp_path, cfg)

    def to_u8(tensors: dict[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            if v.dtype == torch.float8_e8m0fnu:
                tensors[k] = v.view(torch.uint8)

    rewrite_single_file(tmp_path, to_u8)
    dest = empty_like_poisoned(src)
    load_checkpoint(dest, tmp_path, cfg)
    assert all(torch.equal(dest[k], ref[k]) for k in src)


def test_chunked_reads_match_whole_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset_config("tiny-v41")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path, cfg)
    whole = empty_like_poisoned(src)
    load_checkpoint(whole, tmp_path, cfg)
    monkeypatch.setattr(ckpt, "_CHUNK_BYTES", 4096)  # forces row chunks aligned to the 32-row FP8 blocks
    chunked = empty_like_poisoned(src)
    load_checkpoint(chunked, tmp_path, cfg)
    assert all(torch.equal(chunked[k], whole[k]) for k in src)


def test_fills_views_and_other_dtypes(tiny_v4_float) -> None:
    cfg, src, path = tiny_v4_float
    stacked = torch.zeros(cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, dtype=torch.bfloat16)
    dest = {k: torch.empty_like(v) for k, v in src.items()}
    for e in range(cfg.n_routed_experts):
        dest[f"layers.3.ffn.experts.{e}.w1.weight"] = stacked[e]
    dest["embed.weight"] = torch.nn.Parameter(torch.zeros_like(src["embed.weight"]))  # requires grad
    load_checkpoint(dest, path, cfg)
    for e in range(cfg.n_routed_experts):
        assert torch.equal(stacked[e], src[f"layers.3.ffn.experts.{e}.w1.weight"].to(torch.bfloat16))
    assert torch.equal(dest["embed.weight"].detach(), src["embed.weight"])


def test_strict_false_ignores_tensors_the_model_lacks(tiny_v4_float) -> None:
    cfg, src, path = tiny_v4_float
    dest = {k: torch.empty_like(v) for k, v in src.items() if not k.startswith("mtp.")}
    with pytest.raises(CheckpointError, match=r"unexpected[\s\S]*mtp\.0\."):
        load_checkpoint(dest, path, cfg)
    load_checkpoint(dest, path, cfg, strict=False)
    assert all(torch.equal(dest[k], src[k]) for k in dest)


def test_never_unpickles(tiny_v4_float, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, src, path = tiny_v4_float

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, path, cfg)


# ------------------------------------------------------------------------------------------ save validation


def test_save_without_mtp_and_rejects_partial_groups(tmp_path: Path) -> None:
    cfg = preset_config("tiny-v41")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path / "ok", cfg)
    with safe_open(tmp_path / "ok" / "model.safetensors", "pt") as f:
        assert not any(k.startswith("mtp.") for k in f.keys())
    partial = dict(src, **{"mtp.0.attn_norm.weight": torch.zeros(cfg.hidden_size)})
    with pytest.raises(CheckpointError, match=r"missing[\s\S]*mtp\.0\.ffn_norm\.weight"):
        save_checkpoint(partial, tmp_path / "bad1", cfg)
    wrong = dict(src, **{"norm.weight": torch.zeros(3), "layers.0.bogus.weight": torch.zeros(1)})
    del wrong["head.weight"]
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(wrong, tmp_path / "bad2", cfg)
    msg = str(info.value)
    assert "head.weight" in msg and "layers.0.bogus.weight" in msg and "norm.weight: given [3]" in msg


# ------------------------------------------------------------------------------------------ corrupt checkpoints


def test_missing_tensor(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    rewrite_single_file(folder, lambda t: t.pop("layers.5.attn.wkv.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing[\s\S]*layers\.5\.attn\.wkv\.weight"):
        load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, folder, cfg)


def test_extra_tensor(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    rewrite_single_file(folder, lambda t: t.update({"layers.2.attn.surprise": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected[\s\S]*layers\.2\.attn\.surprise \(in model"):
        load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, folder, cfg)


def test_wrong_shape(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    rewrite_single_file(folder, lambda t: t.update({"layers.4.attn.wo_b.weight": torch.zeros(64, 33)}))
    with pytest.raises(CheckpointError, match=r"layers\.4\.attn\.wo_b\.weight: checkpoint \[64, 33\] vs model \[64, 64\]"):
        load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, folder, cfg)


def test_all_problems_reported_at_once_and_nothing_copied(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)

    def edit(t: dict[str, torch.Tensor]) -> None:
        for e in range(3):
            t.pop(f"layers.1.ffn.experts.{e}.w3.weight")
        t["extra.a"] = torch.zeros(1)
        t["layers.0.attn.q_norm.weight"] = torch.zeros(5)

    rewrite_single_file(folder, edit)
    dest = empty_like_poisoned(src)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(dest, folder, cfg)
    msg = str(info.value)
    for needle in ("3 missing", "layers.1.ffn.experts.2.w3.weight", "1 unexpected", "extra.a", "1 mis-shaped",
                   "layers.0.attn.q_norm.weight", str(folder)):
        assert needle in msg, needle
    assert torch.isnan(dest["embed.weight"]).all()  # validated before any copy


def test_long_lists_are_truncated(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    rewrite_single_file(folder, lambda t: [t.pop(k) for k in list(t) if k.startswith("layers.7.")])
    with pytest.raises(CheckpointError, match=r"\d+ missing[\s\S]*\.\.\. and \d+ more"):
        load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, folder, cfg)


def test_scale_that_does_not_fit_its_weight(tmp_path: Path) -> None:
    cfg = preset_config("tiny-v4")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path, cfg)
    bad = torch.full((3, 5), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    rewrite_single_file(tmp_path, lambda t: t.update({"layers.2.attn.wq_b.scale": bad,
                                                       "layers.2.ffn.experts.0.w1.scale": bad.clone()}))
    dest = empty_like_poisoned(src)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(dest, tmp_path, cfg)
    assert "layers.2.attn.wq_b.weight" in str(info.value) and "layers.2.ffn.experts.0.w1.weight" in str(info.value)
    assert torch.isnan(dest["embed.weight"]).all()


def test_truncated_file(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    f = folder / "model.safetensors"
    whole = f.read_bytes()
    f.write_bytes(whole[:-1000])
    dest = {k: torch.empty_like(v) for k, v in src.items()}
    with pytest.raises(CheckpointError, match=rf"model\.safetensors is {len(whole) - 1000} bytes, but its header "
                                              rf"describes {len(whole)} \(1000 missing: truncated\?\)"):
        load_checkpoint(dest, folder, cfg)
    f.write_bytes(whole[:20])  # not even the whole header
    with pytest.raises(CheckpointError, match=r"model\.safetensors is 20 bytes, shorter than its \d+-byte header"):
        load_checkpoint(dest, folder, cfg)


def test_pickle_files_are_refused(tmp_path: Path) -> None:
    cfg = preset_config("tiny-v4")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        load_checkpoint({}, tmp_path, cfg)
    with pytest.raises(CheckpointError, match=r"pickle"):
        load_checkpoint({}, tmp_path / "pytorch_model.bin", cfg)


def test_missing_shard_named_by_index(tiny_v4_float, tmp_path: Path) -> None:
    cfg, src, path = tiny_v4_float
    folder = fresh_copy(path, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint({k: torch.empty_like(v) for k, v in src.items()}, folder, cfg)


# ------------------------------------------------------------------------------------------ transformers naming


def test_hf_name_mapping_examples() -> None:
    cases = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "head.weight": "head.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.self_attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.self_attn.compressor.kv_norm.weight": "layers.3.attn.compressor.norm.weight",
        "model.layers.3.self_attn.sinks": "layers.3.attn.attn_sink",
        "model.layers.3.self_attn.compressor.position_bias": "layers.3.attn.compressor.ape",
        "model.layers.3.self_attn.compressor.indexer.position_bias": "layers.3.attn.indexer.compressor.ape",
        "model.layers.3.self_attn.compressor.indexer.kv_proj.weight": "layers.3.attn.indexer.compressor.wkv.weight",
        "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight": "layers.3.attn.indexer.wq_b.weight",
        "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight":
            "layers.3.attn.indexer.weights_proj.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        "model.layers.3.mlp.gate.tid2eid": "layers.3.ffn.gate.tid2eid",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
        "model.layers.3.attn_hc.scale": "layers.3.hc_attn_scale",
        "model.layers.3.post_attention_layernorm.weight": "layers.3.ffn_norm.weight",
        "layers.3.attn.wq_a.weight": "layers.3.attn.wq_a.weight",
    }
    for hf, released in cases.items():
        assert ckpt.hf_to_released_name(hf) == released, hf
    for released in ("embed.weight", "head.weight", "hc_head_base", "layers.0.attn.kv_norm.weight",
                     "layers.2.attn.indexer.compressor.ape"):
        assert ckpt.hf_to_released_name(ckpt.released_to_hf_name(released)) == released
    split = ckpt.split_fused_experts("layers.1.ffn.experts.gate_up_proj", (2, 8, 4))
    assert [(n, e, r.start, r.stop) for n, (e, r) in split] == [
        ("layers.1.ffn.experts.0.w1.weight", 0, 0, 4), ("layers.1.ffn.experts.0.w3.weight", 0, 4, 8),
        ("layers.1.ffn.experts.1.w1.weight", 1, 0, 4), ("layers.1.ffn.experts.1.w3.weight", 1, 4, 8)]


@pytest.fixture(scope="module")
def hf_model():
    """A tiny random transformers DeepSeek-V4 with every floating parameter and buffer randomised."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
        index_n_heads=4, index_head_dim=32, index_topk=4, sliding_window=8, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.random_(0, hf_cfg.n_routed_experts)
            elif name.endswith("e_score_correction_bias"):
                b.normal_()
    return model


def hf_state_in_released_names(model) -> dict[str, torch.Tensor]:
    """transformers' in-memory state (parameters + persistent buffers) under released names."""
    out = {}
    for k, v in model.state_dict().items():
        if "rotary_emb" in k:
            continue
        name = ckpt.hf_to_released_name(k)
        fused = ckpt.split_fused_experts(name, tuple(v.shape))
        if fused is None:
            out[name] = v
        for expert_name, (e, rows) in fused or []:
            out[expert_name] = v[e, rows]
    return out


@pytest.mark.parametrize("original_format", [True, False], ids=["save_pretrained", "in_memory_names"])
def test_loads_transformers_save_pretrained(hf_model, tmp_path: Path, original_format: bool) -> None:
    hf_model.save_pretrained(tmp_path, save_original_format=original_format)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert ckpt.detect_scheme(keys) == (ckpt.HF if original_format else ckpt.HF_MODULES)
    cfg = read_config_json(tmp_path)
    layout = checkpoint_layout(cfg, mtp=False)
    dest = {t.name: torch.full(t.shape, -1, dtype=torch.int64) if t.kind == INT else torch.full(t.shape, float("nan"))
            for t in layout}
    load_checkpoint(dest, tmp_path, cfg)
    expected = hf_state_in_released_names(hf_model)
    assert set(expected) == set(dest)  # the mapping covers the whole layout and nothing else
    for name, value in expected.items():
        assert torch.equal(dest[name], value), name


def test_transformers_loads_our_hf_format(tmp_path: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    cfg = preset_config("tiny-v4")
    src = random_weights(cfg, mtp=False)
    save_checkpoint(src, tmp_path, cfg, fmt="hf")
    model, info = DeepseekV4ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.mlp_layer_types[:3] == ["hash_moe", "hash_moe", "moe"]
    got = hf_state_in_released_names(model)
    assert set(got) == set(src)
    assert all(torch.equal(got[k], src[k]) for k in src)
    dest = empty_like_poisoned(src)
    load_checkpoint(dest, tmp_path, cfg)  # and back through the hf scheme
    assert all(torch.equal(dest[k], src[k]) for k in src)
    with pytest.raises(ValueError, match="V4 configs only"):
        save_checkpoint(random_weights(preset_config("tiny-v41"), mtp=False), tmp_path / "x",
                        preset_config("tiny-v41"), fmt="hf")
