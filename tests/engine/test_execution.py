"""The execution plan an engine makes once at start-up (:mod:`flashserve.engine.execution`): what it decided,
in the log and on ``engine.plan``; the int8 kernel choice timed at start-up, never at import, and overridable."""

from __future__ import annotations

import logging
import subprocess
import sys
from unittest import mock

import pytest
import torch

from flashserve.config import ConfigError
from flashserve.engine.engine_config import EngineConfig
from flashserve.model import cpu_kernels, packed

OPTS = dict(model="tiny-v41", kv_memory="8MiB", max_num_seqs=2, enforce_eager=True)


def test_importing_the_model_times_nothing():
    """Importing the packed-weight module used to time torch's int8 kernel (a second, on every import of the
    CLI's engine paths): now the engine's plan does, once."""
    code = ("import flashserve.model.packed as p, flashserve.model.loader; "
            "assert p._INT8PACK_TIMED is None and p._INT8PACK is None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_plan_is_logged_and_kept(caplog, monkeypatch):
    from flashserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)  # the plan sets it process-wide
    with caplog.at_level(logging.INFO, logger="flashserve"):
        engine = LLMEngine(EngineConfig(**OPTS, quantization="int8", int8_kernel="chunked"))
    plan = engine.plan
    assert (plan.device, plan.compiled) == ("cpu", False)
    assert plan.formats["int8"] > 0 and plan.formats["int8 experts"] == engine.model_config.num_hidden_layers
    assert plan.int8_aten == (False, False) and plan.int8_source == "given"
    assert "index_topk" in plan.kernels  # built by the warm-up: the packed V4.1 cache's indexer
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution plan:")]
    assert len(logged) == 1 and "decode eager" in logged[0] and "int8 experts" in logged[0]
    assert "chunked float products (given)" in logged[0]


def test_a_model_without_int8_weights_times_nothing(monkeypatch):
    """The int8 timing costs a second or two of start-up: an engine of float weights does not pay it."""
    from flashserve.engine.llm_engine import LLMEngine

    def timed():
        raise AssertionError("the int8 kernel was timed for a model without int8 weights")

    monkeypatch.setattr(packed, "int8pack_pays", timed)
    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)
    assert LLMEngine(EngineConfig(**OPTS, dtype="float32")).plan.int8_source == "no int8 weights"


@pytest.mark.parametrize("choice,calls", [("aten", True), ("chunked", False)])
def test_int8_kernel_choice_is_what_runs(choice, calls, monkeypatch):
    """``int8_kernel`` decides whether eager int8 products call torch's int8 kernel, whatever this CPU's timing
    would say; both give the same tokens."""
    from flashserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(packed, "_INT8PACK", packed._INT8PACK)
    seen = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(packed.torch.ops.aten, "_weight_int8pack_mm", lambda *a: seen.append(1) or real(*a),
                        raising=False)
    engine = LLMEngine(EngineConfig(**OPTS, quantization="int8", int8_kernel=choice, dtype="float32"))
    seen.clear()  # the warm-up's products
    from flashserve import SamplingParams

    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert bool(seen) == calls


def test_a_bad_int8_kernel_is_refused_before_loading():
    from flashserve.engine import preflight

    with pytest.raises(ConfigError, match="int8_kernel: must be one of auto, aten, chunked"):
        preflight.check(EngineConfig(**OPTS, int8_kernel="fast"))


def test_the_plan_counts_the_bytes_it_laid_out_again(monkeypatch, caplog):
    """Weights laid out again for the chosen path are counted by weight and by byte in the logged plan (here every
    float32 linear weight made column-major, by lowering what counts as tall)."""
    from flashserve.engine.execution import plan_execution
    from flashserve.model import weight_layout
    from flashserve.model.loader import load_model

    monkeypatch.setattr(weight_layout, "TALL_RATIO", 1)
    monkeypatch.setattr(weight_layout, "TALL_MIN_ELEMENTS", 1)
    model = load_model("tiny-v4", with_mtp=False)
    plan = plan_execution(model, device="cpu", compiled=False, rows=1, int8_kernel="chunked")
    names = plan.relayouts["column-major tall weights"]
    weights = [model.get_parameter(n) for n in names]
    assert names and all(w.stride() == (1, w.shape[0]) for w in weights)
    nbytes = sum(w.numel() * 4 for w in weights)
    assert plan.relayout_bytes["column-major tall weights"] == nbytes
    assert f"column-major tall weights: {len(names)} weights, {nbytes / 1e6:.1f} MB" in plan.describe()


def test_the_plan_gives_block_fp8_layers_panels_that_their_decode_rows_read(released_tiny_v41):
    """On a CPU the plan copies every block-FP8 layer's codes into column panels (counted like every copy), eager
    or compiled; every FP8 layer's decode rows then read them, and each call's products are its input's times the
    layer's decoded weights (alone and grouped)."""
    from flashserve.engine.execution import FP8_PANELS, plan_execution
    from flashserve.model.loader import load_model

    model = load_model(released_tiny_v41, with_mtp=False)
    plan = plan_execution(model, device="cpu", compiled=False, rows=1, int8_kernel="chunked")
    fp8 = {n for n, m in model.named_modules() if isinstance(m, packed.PackedLinear) and m.packed.fmt.name == "fp8"}
    names = plan.relayouts[FP8_PANELS]
    assert fp8 and sorted(names) == sorted(f"{n}.fp8_panels" for n in fp8)
    nbytes = sum(model.get_buffer(n).numel() for n in names)
    assert plan.relayout_bytes[FP8_PANELS] == nbytes >= sum(model.get_submodule(n).packed.qweight.numel() for n in fp8)
    assert f"{FP8_PANELS}: {len(names)} weights, {nbytes / 1e6:.1f} MB" in plan.describe()
    by_panels = {model.get_buffer(n).data_ptr(): model.get_submodule(n.rpartition(".")[0]) for n in names}
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    calls = []
    real = cpu_kernels.fp8_panels

    def checked(x, experts, panels, s, n, rb, cb):
        """The call's products against its layer's decoded weights (a grouped view: one matrix a group)."""
        y = real(x, experts, panels, s, n, rb, cb)
        layer = by_panels[panels.data_ptr()]
        w = layer.packed.dequantize(torch.float64).view(panels.shape[0], n, -1)[experts]  # [P, n, K]
        xp = x.double().repeat_interleave(experts.numel() // x.shape[0], 0)[:, None, :]
        want, size = (xp * w).sum(-1), (xp.abs() * w.abs()).sum(-1)
        assert ((y.double() - want).abs() <= 1e-5 * size + 1e-30).all(), layer
        calls.append(x.shape[0])
        return y

    with torch.no_grad(), mock.patch.object(cpu_kernels, "fp8_panels", checked):
        got = model(ids).logits
    assert len(calls) >= len(fp8) and set(calls) <= {6, 6 * model.cfg.o_groups}
    assert got.shape == (1, 6, model.cfg.vocab_size) and bool(got.isfinite().all())
    # The whole forward is not compared with the codes read as stored at 1e-4: the two kernels sum each output in
    # another order, and the cache's rounding points (FP8 window rows, FP4 compressed entries) turn a last-bit
    # difference at a rounding boundary into a step of one quantum (this prompt on an Intel Xeon: 0.596 in the
    # logits; the FP8 layers decoded instead of either kernel give the same step on an AMD EPYC, and without either
    # rounding point the difference is 8e-6).


def test_a_kernel_that_disagrees_with_torch_here_is_refused_loudly_and_the_logits_stay_right(released_tiny_v41,
                                                                                               caplog, monkeypatch):
    """The plan checks each weight kernel against torch's products at start-up: a kernel whose products are wrong
    on this CPU (here made wrong on purpose) is refused with an error in the log and on the plan, and its layers
    run without it: wrong panels fall back to the codes as stored (fp8_pairs: the logits of a model without
    panels, bit for bit), a wrong fp8_pairs to the decoded weights (those of a model whose FP8 layers decode)."""
    from flashserve.engine.execution import FP8_PANELS, plan_execution
    from flashserve.model.loader import load_model

    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    stored = load_model(released_tiny_v41, with_mtp=False)  # no plan: no panels, the codes read as stored
    with torch.no_grad():
        want = stored(ids).logits
        with mock.patch.object(packed.PackedLinear, "fp8_kernel", lambda self, x, groups=1: False):
            want_decoded = stored(ids).logits  # the FP8 layers' weights decoded, torch's products
    monkeypatch.setattr(cpu_kernels, "_REFUSED", {})  # this process's refusals, restored after the test
    real_panels, real_pairs = cpu_kernels.fp8_panels, cpu_kernels.fp8_pairs
    monkeypatch.setattr(cpu_kernels, "fp8_panels", lambda *a: real_panels(*a) * 1.01)
    model = load_model(released_tiny_v41, with_mtp=False)
    with caplog.at_level(logging.ERROR, logger="flashserve"):
        plan = plan_execution(model, device="cpu", compiled=False, rows=1, int8_kernel="chunked")
    assert list(plan.refused) == ["fp8_panels"] and plan.relayouts[FP8_PANELS] == []
    assert "fp8_panels" not in cpu_kernels.built() and "refused" in plan.describe()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "fp8_panels failed its check" in errors[0] and "outputs wrong" in errors[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)

    monkeypatch.setattr(cpu_kernels, "_REFUSED", {})
    calls = []
    monkeypatch.setattr(cpu_kernels, "fp8_pairs", lambda *a: calls.append(1) or real_pairs(*a) + 1.0)
    model = load_model(released_tiny_v41, with_mtp=False)
    plan = plan_execution(model, device="cpu", compiled=False, rows=1, int8_kernel="chunked")
    assert set(plan.refused) == {"fp8_pairs", "fp8_panels"} and plan.relayouts[FP8_PANELS] == []
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want_decoded)
    assert not calls


def test_decode_rows_attend_through_the_kernel_with_the_tokens_of_torchs_products(monkeypatch):
    """Where it is preferred (AVX-512 CPUs and layers as wide as the real models'; here on any CPU and layer) a
    decode step's rows attend through cpu_kernels.attend_rows (only the keys and picked
    entries each row may see), long prompts through torch's products; the greedy tokens are those of torch's
    products throughout (tiny-v41: window, compressed and sparse layers, a prompt longer than the window)."""
    from engine_helpers import prompt_of, run_greedy
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.model import attention

    prompts = [prompt_of(70, seed=1), prompt_of(9, seed=2), prompt_of(33, seed=3)]
    rows = []
    real = cpu_kernels.attend_rows

    def counting(q, win, win_ok, ent, *args):
        rows.append((q.shape[1], ent.shape[1], ent.shape[2]))
        return real(q, win, win_ok, ent, *args)

    with monkeypatch.context() as m:
        m.setattr(attention.cpu_kernels, "attend_rows", counting)
        m.setattr(attention.cpu_kernels, "attend_rows_preferred", lambda: True)
        m.setattr(attention.cpu_kernels, "ATTEND_ROWS_MIN_WIDTH", 0)  # tiny-v41's layers are narrower
        kernel = run_greedy(LLMEngine(EngineConfig(**{**OPTS, "kv_memory": "32MiB", "max_num_seqs": 3})), prompts, 12)
    # (rows, entry lists, entries) a call: decode rows of window-only layers and of layers with compressed entries,
    # and prompt chunks of up to ATTEND_ROWS_MAX rows with each row's own picks; longer chunks take torch's products
    assert 1 in {s for s, _, _ in rows} and max(s for s, _, _ in rows) <= cpu_kernels.ATTEND_ROWS_MAX
    assert (1, 1, 0) in rows and any(s == 1 and e > 0 for s, _, e in rows)
    assert any(s > 1 and se == s and e > 0 for s, se, e in rows)
    with monkeypatch.context() as m:
        m.setattr(attention.cpu_kernels, "attend_rows_preferred", lambda: False)
        torch_products = run_greedy(LLMEngine(EngineConfig(**{**OPTS, "kv_memory": "32MiB", "max_num_seqs": 3})),
                                    prompts, 12)
    assert kernel == torch_products


def test_mapped_experts_whose_kernel_is_refused_take_torchs_products_eagerly(monkeypatch, caplog):
    """Experts used where they lie in the mapped checkpoint (the real models' MXFP4 experts) are checked too: with
    their kernel wrong on this CPU (here on purpose) the engine refuses it, decodes eagerly (the decoded experts
    read the routing on the host) and never calls it; the decoded experts' products are the kernel's."""
    from flashserve.engine import SamplingParams
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.model import mapped_experts
    from flashserve.models import default_model

    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)  # the default model's experts held as real ones are
    monkeypatch.setattr(cpu_kernels, "_REFUSED", {})
    real = cpu_kernels.mxfp4_mapped
    calls = []

    def wrong(*args):
        calls.append(1)
        return real(*args) * 1.01

    monkeypatch.setattr(cpu_kernels, "mxfp4_mapped", wrong)
    with caplog.at_level(logging.INFO, logger="flashserve"):
        engine = LLMEngine(EngineConfig(model=default_model(), kv_memory="8MiB", max_num_seqs=1, threads=1,
                                        speculative_config="off"))
    model = engine.runner.model
    layer = next(m for m in model.modules() if isinstance(m, mapped_experts.MappedExperts))
    assert "mxfp4_pairs" in engine.plan.refused and "mapped mxfp4 experts" in engine.plan.refused["mxfp4_pairs"]
    said = [r.getMessage() for r in caplog.records]
    assert "mapped MXFP4 experts without their C++ kernel (refused on this CPU): decode steps run eagerly (the " \
           "routing is read on the host between a layer's router and its experts)" in said
    assert engine.runner.decode_step.child is None and engine.stats()["decode_step"] == "eager"
    assert any("mxfp4_pairs failed its check" in m for m in said)
    calls.clear()
    engine.add_request("r", [5, 17, 3, 99, 42, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not calls
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, layer.dim, generator=g)
    idx = torch.randint(0, layer.n_experts, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    decoded = layer(x, idx, w)
    monkeypatch.setattr(cpu_kernels, "_REFUSED", {})
    monkeypatch.setattr(cpu_kernels, "mxfp4_mapped", real)
    torch.testing.assert_close(decoded, layer(x, idx, w), rtol=1e-5, atol=1e-5)
