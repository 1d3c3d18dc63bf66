"""Per-rank parameter bytes follow the layout's arithmetic (experts split, split parts 1/TP, replicated parts
whole), ``flashserve info --memory`` counts the same bytes on the meta device, and for V4.1-Flash it agrees
with ``flashserve plan``'s memory terms for the same layout. Layout validation names what does not divide."""

import pytest
import torch

from flashserve.config import ConfigError, load_config
from flashserve.model.loader import load_model
from flashserve.config.ranks import Layout
from flashserve.parallel.memory import is_split, rank_memory
from flashserve.parallel.shard import shard_model

LAYOUTS = {"tp2": Layout(2, False, 1), "ep2": Layout(2, True, 1), "dp2": Layout(1, True, 2),
           "tp2dp2": Layout(2, True, 2)}


def _parts(model) -> dict[str, int]:
    out = {"experts": 0, "split": 0, "replicated": 0}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(("rope.", "engram_hasher.", "vision.", "aligner.", "image_")):
            continue  # computed tables; the vision tower (replicated, left out of the text model's report)
        n = p.numel() * p.element_size()
        if ".experts.w" in name:
            out["experts"] += n
        elif is_split(name):
            out["split"] += n
        else:
            out["replicated"] += n
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_rank_bytes_follow_the_layout(name, layout):
    lay = LAYOUTS[layout]
    whole = _parts(load_model(name, dtype=torch.float64, with_mtp=False))
    for rank in range(lay.world):
        part = _parts(shard_model(load_model(name, dtype=torch.float64, with_mtp=False), lay, rank, comm=None))
        assert part["experts"] * lay.world == whole["experts"]  # EP: E/2 whole experts; TP: every expert's width/2
        assert part["split"] * lay.tp == whole["split"]
        assert part["replicated"] == whole["replicated"]
    meta = rank_memory(name, lay, dtype="float64")
    assert meta.routed_expert_bytes == part["experts"]
    assert meta.split_dense_bytes + meta.replicated_dense_bytes + meta.host_table_bytes == (
        part["split"] + part["replicated"])


def test_v41_flash_memory_agrees_with_plan():
    from flashserve.plan.capacity import capacity
    from flashserve.plan.inputs import PlanInputs
    from flashserve.plan.models import resolve_model
    from flashserve.plan.planner import build_deployment

    cfg = load_config("deepseek-v41-flash")
    m = rank_memory("deepseek-v41-flash", Layout(4, True, 1))  # released formats: FP8 dense, MXFP4 experts
    dep = build_deployment(PlanInputs(model="deepseek-v41-flash", hardware="b200", gpus=4, tp=4, ep=4,
                                      attention_dp=1))
    terms = resolve_model("deepseek-v41-flash")
    cap = capacity(dep, 8192)
    # routed experts: the same bytes to the byte (MXFP4: half a byte plus one scale byte per 32 per weight)
    routed_plan = terms.routed_params_total * (0.5 + 1 / 32) / dep.gpus
    assert m.routed_expert_bytes == routed_plan
    # every weight: the plan splits all dense weights by TP at one byte each; the engine keeps norms, mHC and
    # router biases in fp32, the vocabulary in bf16 and replicates the small parts: 1.6% more per rank
    assert abs(m.weight_bytes - cap.weight_bytes_per_gpu) / cap.weight_bytes_per_gpu < 0.02
    # the plan models the text backbone; a rank also holds the vision tower (and, with mtp/dspark, the drafter)
    assert m.resident_weight_bytes == m.weight_bytes + m.vision_bytes and m.vision_bytes > 0
    # the global cache per token: equal; bounded state: the plan adds the drafter's stage windows and counts
    # W window rows where the ring keeps W - 1 (the newest row is the step's own), the engine adds the
    # compressors' partial groups and the engram look-back
    assert m.kv_bytes_per_token == terms.kv_bytes_per_token
    window_row = terms.state_bytes_per_sequence / ((cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
                                                   * cfg.sliding_window)
    rings = m.bounded_bytes_per_sequence - cfg.num_hidden_layers * (cfg.sliding_window - 1) * window_row
    assert 0 < rings < 0.01 * m.bounded_bytes_per_sequence
    assert m.host_table_bytes == pytest.approx(cap.host_table_bytes, rel=1e-9)


def test_layout_errors_name_the_sizes():
    cfg = load_config("tiny-v41")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 must divide num_attention_heads \(4\)"):
        Layout(3, False, 1).check(cfg)
    with pytest.raises(ConfigError, match=r"expert-parallel size 3 must divide n_routed_experts \(8\)"):
        Layout(1, True, 3).check(cfg)
    with pytest.raises(ConfigError, match="needs enable_expert_parallel"):
        Layout.from_options(1, False, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        Layout.from_options(0)


@pytest.mark.parametrize("quantization", ["fp8", "mxfp4", "int8"])
def test_packed_weights_shard_byte_for_byte(quantization):
    """Packed (FP8 blocks, MXFP4, int8) weights are split on their scale blocks without re-quantizing: each
    rank's slice dequantizes to the same slice of the whole."""
    from flashserve.model.packed import dequantized_state

    whole = dequantized_state(load_model("tiny-v41", with_mtp=False, quantization=quantization))
    for lay in (Layout(2, False, 1), Layout(2, True, 1)):
        for rank in range(2):
            part = shard_model(load_model("tiny-v41", with_mtp=False, quantization=quantization), lay, rank, None)
            a = part.layers[2].attn
            assert torch.equal(a.wq_b.weight, whole["layers.2.attn.wq_b.weight"][rank * 128:(rank + 1) * 128])
            half = whole["layers.2.attn.wo_b.weight"].shape[1] // 2
            assert torch.equal(a.wo_b.weight, whole["layers.2.attn.wo_b.weight"][:, rank * half:(rank + 1) * half])
            ex = part.layers[2].ffn.experts
            w1 = whole["layers.2.ffn.experts.5.w1.weight"]
            if lay.ep:
                assert ex.n_experts == 4 and (rank == 1) == torch.equal(ex.expert_weights("w1", torch.float32, 1), w1)
            else:
                got = ex.expert_weights("w2", torch.float32, 5)
                w2 = whole["layers.2.ffn.experts.5.w2.weight"]
                assert torch.equal(got, w2[:, rank * 32:(rank + 1) * 32])


def test_info_memory_cli(capsys):
    import json

    from flashserve.cli import main

    assert main(["info", "tiny-v41", "--tensor-parallel-size", "2", "--enable-expert-parallel", "--memory",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    m = rank_memory("tiny-v41", Layout(2, True, 1), dtype="bfloat16")
    assert data["weight_bytes"] == m.weight_bytes and data["kv_replicas"] == 2 and data["layout"] == "TP=2 EP=2 (2 ranks)"
    assert main(["info", "tiny-v41", "--tensor-parallel-size", "3", "--memory"]) == 2  # a clear error, not a trace
    assert "must divide num_attention_heads" in capsys.readouterr().err


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_speculative_tokens": 3}])
def test_resident_bytes_count_what_a_rank_loads(spec):
    """``rank_memory``'s resident bytes are every byte of the model a rank's engine builds (as build_rank_engine
    loads it: the vision tower always, the drafter stack with speculative mtp/dspark), sharded; the vision tower
    and the drafter are counted on their own lines, beside the backbone the plan models."""
    from flashserve.parallel.memory import DRAFTER, VISION

    lay = Layout(2, True, 1)
    with_mtp = spec is not None
    net = shard_model(load_model("tiny-v41", dtype=torch.float64, with_mtp=with_mtp), lay, 0, comm=None)
    held = [(name, p.numel() * p.element_size()) for name, p in list(net.named_parameters())
            + list(net.named_buffers()) if not name.startswith(("rope.", "engram_hasher."))]
    m = rank_memory("tiny-v41", lay, dtype="float64", speculative_config=spec)
    assert m.drafter_loaded == with_mtp
    assert m.resident_weight_bytes + m.host_table_bytes == sum(n for _, n in held)
    assert m.vision_bytes == sum(n for name, n in held if name.startswith(VISION)) > 0
    assert m.drafter_bytes > 0
    if with_mtp:
        assert m.drafter_bytes == sum(n for name, n in held if name.startswith(DRAFTER))
    assert m.weight_bytes == m.routed_expert_bytes + m.split_dense_bytes + m.replicated_dense_bytes
    assert m.resident_weight_bytes == m.weight_bytes + m.vision_bytes + (m.drafter_bytes if with_mtp else 0)


def test_info_memory_cli_counts_vision_and_drafter(capsys):
    from flashserve.cli import main

    assert main(["info", "deepseek-v41-flash", "--tensor-parallel-size", "4", "--enable-expert-parallel",
                 "--memory"]) == 0
    out = capsys.readouterr().out
    m = rank_memory("deepseek-v41-flash", Layout(4, True, 1))
    assert m.vision_bytes > 0.4e9  # 0.41 B parameters, replicated on each rank
    assert f"resident weights   {m.resident_weight_bytes:>20,} B" in out
    assert f"vision tower       {m.vision_bytes:>20,} B" in out
    assert f"drafter (MTP)      {m.drafter_bytes:>20,} B" in out and "NOT counted" in out
    assert main(["info", "deepseek-v41-flash", "--tensor-parallel-size", "4", "--enable-expert-parallel",
                 "--memory", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']) == 0
    out = capsys.readouterr().out
    assert f"resident weights   {m.resident_weight_bytes + m.drafter_bytes:>20,} B" in out


def test_a_sliced_mxfp4_weight_decodes_compiled_as_eager():
    """An expert-parallel rank's slice of MXFP4 experts keeps the computed E2M1 table a compiled step reads."""
    import torch

    from flashserve.model import modes
    from flashserve.model.packed import EXPERT_FP4, PackedWeights
    from flashserve.parallel.shard import slice_packed

    pw = PackedWeights((4, 16, 64), EXPERT_FP4)
    pw.set_float(torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3)))
    part = slice_packed(pw, lead=(2, 4))
    want = pw.dequantize(torch.float32)[2:]
    assert torch.equal(part.dequantize(torch.float32), want)
    with modes.running(modes.COMPILED_CPU):  # as a compiled CPU step decodes them
        assert torch.equal(torch.compile(lambda: part.dequantize(torch.float32), fullgraph=True)(), want)
