"""Engine benchmark against transformers' ``generate`` on the same tiny V4 checkpoint.

    python -m flashserve.bench.engine [--quick] [--threads N] [--repeats R] [--dtype float32|bfloat16]

Measures (a) decode tokens/s per agent at batch 1, (b) aggregate output tokens/s with 16 and 64 concurrent
requests, end to end (prompt included) and decode only, (c) prefill tokens/s on a 4K-token prompt: V4 (exact)
against transformers, and V4.1 encoder-only against exact prefill; (d) the machine's bounds that decide
whether the speed goals are reachable (one pass over the active weights; large-matmul GFLOP/s). Every figure is
the median of ``--repeats`` runs, the two engines alternating; ratios are of medians. (e) The decode step at
32K against 1K context. With llama-cpp-python installed, (f) llama.cpp on the same weights (see
:mod:`flashserve.bench.llamacpp`). Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import llamacpp
from .hf_reference import randomize_hf_v4
from .workload import engine_for, fs_run, prompts

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# The checkpoint shapes compared. "peers" is the tiny V4 that docs/peers.md describes, measured with transformers and
# llama.cpp on (91M parameters, 53M active: vocab 32000, hidden 512, 8 layers, 16 experts top-4); "tiny" is
# shaped like the ``tiny-v4`` preset (1.4M parameters), where both engines measure mostly per-op overhead.
SHAPES = {
    "peers": dict(vocab_size=32000, hidden_size=512, moe_intermediate_size=256, num_attention_heads=8, head_dim=64,
                  q_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4, sliding_window=32, o_lora_rank=128,
                  index_head_dim=64, index_topk=16),
    "tiny": dict(vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
                 q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, o_lora_rank=32,
                 index_head_dim=32, index_topk=8),
}


def build_hf_v4(path: Path, shape: str = "peers", seed: int = 0):
    """A random ``DeepseekV4ForCausalLM`` of one of :data:`SHAPES`, saved with save_pretrained."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    dims = SHAPES[shape]
    layer_types = [SWA, SWA, CSA, HCA, CSA, HCA, CSA, SWA]
    cfg = DeepseekV4Config(
        **dims, num_hidden_layers=len(layer_types), partial_rotary_factor=16 / 64, n_shared_experts=1,
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (len(layer_types) - 2),
        o_groups=2, index_n_heads=8, max_position_embeddings=8192, num_nextn_predict_layers=0,
        pad_token_id=2, eos_token_id=1, bos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_hf_v4(DeepseekV4ForCausalLM(cfg).eval(), seed)
    model.save_pretrained(path)
    return model


# --------------------------------------------------------------------------- transformers
class _StepClock:
    """A ``generate`` streamer that only records when each step's tokens arrive (the first call is the
    prompt), so decode time is read directly instead of as a difference of two noisy runs."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate(model, batch: list[list[int]], new: int) -> tuple[float, float]:
    """transformers generating ``new`` tokens after each prompt of ``batch``: (total seconds, prompt
    included; seconds from the first generated token to the last)."""
    ids = torch.tensor(batch)
    clock = _StepClock()
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=2, streamer=clock)
    total = time.perf_counter() - t
    if len(clock.times) != new + 1:
        raise RuntimeError(f"expected {new + 1} streamer calls from generate, got {len(clock.times)}")
    return total, clock.times[-1] - clock.times[1]


def hf_decode_rate(model, prompt_len: int, new: int) -> float:
    _, dec = hf_generate(model, prompts(1, prompt_len, 1), new)
    return (new - 1) / dec


@torch.inference_mode()
def hf_prefill_rate(model, length: int, repeats: int = 2) -> float:
    model(torch.tensor(prompts(1, 64, 3)), logits_to_keep=1)
    best = 0.0
    for r in range(repeats):
        ids = torch.tensor(prompts(1, length, 4 + r))
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        best = max(best, length / (time.perf_counter() - t))
    return best


# --------------------------------------------------------------------------- flashserve
def fs_decode_rate(engine, prompt_len: int, new: int) -> float:
    p = prompts(1, prompt_len, 1)
    fs_run(engine, p, 4)
    _, dec = fs_run(engine, p, new)
    return (new - 1) / dec


def fs_prefill_rate(engine, length: int, repeats: int = 2) -> float:
    """Prompt tokens/s to the first token (best of ``repeats``, after a warm-up; prefix caching off)."""
    from ..engine import SamplingParams

    engine.scheduler.prefix = False
    best = 0.0
    for r in range(repeats + 1):
        p = prompts(1, length if r else 64, 3 + r)[0]
        t = time.perf_counter()
        engine.add_request(f"pf{t}", p, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        if r:
            best = max(best, length / (time.perf_counter() - t))
    return best


@torch.inference_mode()
def model_floor_rate(model, prompt_len: int, new: int) -> float:
    """Decode tokens/s of the bare model through its reference DenseState (no engine): the floor we sit on."""
    state = model.new_state(1)
    model(torch.tensor(prompts(1, prompt_len, 1)), state, logits_rows=1)
    tok = torch.tensor([[17]])
    t = time.perf_counter()
    for _ in range(new):
        model(tok, state, logits_rows=1)
    return new / (time.perf_counter() - t)


def long_context_v41(dtype: torch.dtype, positions: int):
    """``tiny-v41`` with its position limit raised to ``positions`` (same seeded weights)."""
    import dataclasses

    from ..config import load_config
    from ..model.init import random_init
    from ..model.transformer import Transformer

    cfg = dataclasses.replace(load_config("tiny-v41"), max_position_embeddings=positions)
    model = random_init(Transformer(cfg, with_mtp=False)).to(dtype).eval()
    model.rope.float()
    model.fake_quant = True
    return model


def decoding_engine(model, context: int, steps: int, **engine_kw):
    """A ``tiny-v41`` engine holding one request past its prompt of ``context`` tokens, with ``steps`` decode
    steps left."""
    from ..engine import SamplingParams

    engine = engine_for(model, "tiny-v41", max_num_seqs=2, max_model_len=context + steps + 8, **engine_kw)
    engine.add_request("ctx", prompts(1, context, 7)[0], SamplingParams(max_tokens=steps + 2, ignore_eos=True,
                                                                        temperature=0.0))
    while not any(s.prefill_done for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step (warm-up)
    return engine


def step_ms(engine, steps: int) -> float:
    """Median wall time (ms) of the engine's next ``steps`` steps."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def context_step_pair(model, short: int, long: int, steps: int, repeats: int, **engine_kw) -> tuple[float, float]:
    """Median decode step (ms, batch 1) after prompts of ``short`` and ``long`` tokens: both requests are
    prefilled once, then blocks of ``steps`` steps alternate between them (``repeats`` blocks each), so
    machine noise falls on both alike."""
    engines = [decoding_engine(model, n, steps * repeats, **engine_kw) for n in (short, long)]
    return median_pair(lambda: step_ms(engines[0], steps), lambda: step_ms(engines[1], steps), repeats)


def median_pair(ours, theirs, repeats: int) -> tuple[float, float]:
    """Medians of ``repeats`` alternating calls of two zero-argument measurements."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        b.append(theirs())
    return statistics.median(a), statistics.median(b)


@torch.inference_mode()
@torch.inference_mode()
def active_pass_rate(model, repeats: int) -> float:
    """Tokens/s bound at batch 1 in the model's dtype: one single-row product
    (:func:`flashserve.model.blas.linear`, the engine's for its linear layers; its step multiplies the picked
    experts with torch) by every weight matrix a decode token touches (attention and mHC matrices, shared
    expert, top-k routed experts, LM head)."""
    from ..model import blas

    mats = []
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:
            mats.append(p)
        elif p.dim() == 3 and ".experts." in name:
            mats.extend(p[:model.cfg.num_experts_per_tok])
    x = {(p.shape[1], p.dtype): torch.ones(1, p.shape[1], dtype=p.dtype) for p in mats}
    times = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        for p in mats:
            blas.linear(x[p.shape[1], p.dtype], p)
        times.append(time.perf_counter() - t)
    return 1 / statistics.median(times)


@torch.inference_mode()
def matmul_gflops(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of a large [64, 512] x [512, 32000] product (the LM head at 64 agents): a compute ceiling."""
    a, w = torch.randn(64, 512, dtype=dtype), torch.randn(32000, 512, dtype=dtype)
    a @ w.t()
    times = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        for _ in range(5):
            a @ w.t()
        times.append((time.perf_counter() - t) / 5)
    return 2 * 64 * 512 * 32000 / statistics.median(times) / 1e9


def llama_cpp_rows(model, work: Path, table, args, repeats: int, prompt_len: int, new: int) -> None:
    """llama.cpp's rows (see :mod:`flashserve.bench.llamacpp`); skipped with the reason when it cannot run,
    and a failure of the peer is reported, never raised."""
    reason = llamacpp.unavailable()
    if reason:
        print(f"llama.cpp peer skipped: {reason}", flush=True)
        return
    try:
        llamacpp.compare(model, work, table, threads=torch.get_num_threads(), repeats=repeats,
                         batches=tuple(args.llama_batches), prompt_len=prompt_len, new=new,
                         engine_kw=dict(enforce_eager=args.enforce_eager), rows=tuple(args.llama_rows))
    except Exception as exc:  # a peer that breaks must not end the benchmark
        print(f"llama.cpp peer failed: {type(exc).__name__}: {exc}", flush=True)


def transformers_missing() -> str | None:
    """Why the comparison cannot run (transformers, the baseline, is an optional extra), or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ("the engine benchmark compares flashserve with transformers, which is not installed; "
                "install it with: pip install 'flashserve[bench]'")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer tokens (smoke run)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and activations of both engines")
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="peers", help="the V4 checkpoint compared")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every row as JSON")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="flashserve's decode step eager, or compiled with --no-enforce-eager (default: the "
                         "engine's, compiled; measured once the compile is done)")
    ap.add_argument("--contexts", type=int, nargs=2, default=[1024, 32 * 1024], metavar=("SHORT", "LONG"),
                    help="decode step time at LONG against SHORT context on tiny-v41 (default 1K and 32K)")
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                    help="compare with llama.cpp through llama-cpp-python when it is installed (default on)")
    ap.add_argument("--llama-batches", type=int, nargs="+", default=[1, 8, 16],
                    help="concurrent sequences of the llama.cpp rows")
    ap.add_argument("--llama-rows", nargs="+", choices=tuple(llamacpp.ROWS), default=list(llamacpp.ROWS),
                    help="the llama.cpp comparisons to run (each compiled flashserve engine compiles on its own)")
    ap.add_argument("--sweep-json", default=None, metavar="PATH",
                    help="also write the measured points as a bench sweep (PATH) and the checkpoint's config "
                         "(PATH.config.json), the input of `flashserve plan --calibrate`")
    args = ap.parse_args(argv)
    missing = transformers_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    from ..config.arithmetic import model_arithmetic
    from ..model.loader import load_model

    dtype = getattr(torch, args.dtype)
    new1, newb = (16, 8) if args.quick else (64, 32)
    plen, R = 128, args.repeats
    rows: list[dict] = []
    rel = float("nan")

    def table(name, ours_v, theirs_v, unit="tok/s", goal=None, vs="transformers"):
        ratio = ours_v / theirs_v if theirs_v else float("nan")
        rows.append({"name": name, "flashserve": ours_v, "baseline": theirs_v, "baseline_name": vs,
                     "unit": unit, "ratio": ratio, "goal": goal, "met": None if goal is None else ratio >= goal})
        mark = "" if goal is None else f"   goal {goal:g}x {vs}: {'reached' if ratio >= goal else 'NOT reached'}"
        print(f"{name:<40} flashserve {ours_v:9.1f} {unit}   {vs} {theirs_v:9.1f} {unit}   "
              f"ratio {ratio:5.2f}x{mark}", flush=True)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, median of {R} runs")
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import DeepseekV4ForCausalLM

        build_hf_v4(Path(tmp), args.shape)
        hf = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="eager").eval()
        print(f"checkpoint shape {args.shape!r}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters")
        ours = load_model(tmp, dtype=dtype, fake_quant=False, with_mtp=False)
        active = model_arithmetic(ours.cfg).params_active_decode
        ids = torch.tensor(prompts(1, 40, 5))
        with torch.no_grad():
            ref = hf(ids).logits.float()
            rel = float((ours(ids).logits.float() - ref).abs().max() / ref.abs().max())
        print(f"both engines run the same checkpoint: their logits differ by at most {rel:.2e} of the largest "
              f"(logits max rel diff); {active / 1e6:.1f}M parameters active per decode token")

        t0 = time.perf_counter()
        eng = engine_for(ours, tmp, max_num_seqs=max(64, *args.concurrency), enforce_eager=args.enforce_eager)
        print(f"engine start-up {time.perf_counter() - t0:.1f} s (decode step compile/warm-up "
              f"{eng.runner.decode_step.warmup_s:.1f} s)", flush=True)
        p1 = prompts(1, plen, 1)
        fs_run(eng, p1, 4)
        hf_generate(hf, p1, 2)
        ours1, hf1 = median_pair(lambda: fs_decode_rate(eng, plen, new1), lambda: hf_decode_rate(hf, plen, new1), R)
        table("decode per agent, batch 1", ours1, hf1, goal=5)
        bound1 = active_pass_rate(ours, R)
        floor = statistics.median(model_floor_rate(ours, plen, new1) for _ in range(R))
        print(f"  the model alone, without the engine's scheduler and paged cache: {floor:.1f} tok/s (the engine "
              f"reaches {ours1 / floor:.0%} of it); reading every weight a token uses once caps one agent at "
              f"{bound1:.0f} tok/s on this machine = {bound1 / hf1:.1f}x transformers", flush=True)
        sweep = [{"concurrency": 1, "tokens_per_s_per_agent": ours1, "output_tokens_per_s_per_gpu": ours1}]
        agg64 = None
        for b in args.concurrency:
            batch = prompts(b, plen, 10 + b)
            fs_run(eng, batch[:2], 2)

            def ours_b():
                total, dec = fs_run(eng, batch, newb)
                return b * newb / total, b * (newb - 1) / dec

            def hf_b():
                total, dec = hf_generate(hf, batch, newb)
                return b * newb / total, b * (newb - 1) / dec

            o, h = [], []
            for _ in range(R):
                o.append(ours_b())
                h.append(hf_b())
            goal = 20 if b == 64 else None
            table(f"aggregate output, {b} concurrent", statistics.median(x[0] for x in o),
                  statistics.median(x[0] for x in h), goal=goal)
            table(f"  decode only, {b} concurrent", statistics.median(x[1] for x in o),
                  statistics.median(x[1] for x in h))
            if b == 64:
                agg64 = statistics.median(x[1] for x in h)
            e2e = statistics.median(x[0] for x in o)
            sweep.append({"concurrency": b, "tokens_per_s_per_agent": e2e / b, "output_tokens_per_s_per_gpu": e2e})
        peak = {str(d).removeprefix("torch."): matmul_gflops(d, R) for d in (torch.float32, torch.bfloat16)}
        print("  this machine's large-matmul ceiling: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()))
        if agg64:
            need = 20 * agg64 * 2 * active / 1e9
            print(f"  20x transformers' decode rate with 64 agents needs {need:.0f} GFLOP/s of matrix multiplies "
                  f"alone ({2 * active / 1e6:.0f} MFLOP per token), {need / max(peak.values()):.1f}x what this "
                  f"machine's fastest matmul reaches")
        if args.sweep_json:
            import shutil

            out = Path(args.sweep_json)
            out.write_text(json.dumps({"hardware": "cpu-local", "context": plen + newb, "points": sweep}, indent=1))
            shutil.copy(Path(tmp) / "config.json", f"{out}.config.json")
            print(f"wrote {out} and {out}.config.json")
        if args.llama_cpp:
            llama_cpp_rows(ours, Path(tmp), table, args, R, plen, new1)
        L = args.prefill_len
        # prefill runs eagerly: no decode step to compile for these rows
        eng = engine_for(ours, tmp, max_num_seqs=4, max_model_len=max(8192, L + 8), enforce_eager=True)
        a, h = median_pair(lambda: fs_prefill_rate(eng, L, 1), lambda: hf_prefill_rate(hf, L, 1), R)
        table(f"prefill {L} tokens (V4, exact)", a, h)
    short, long_ = args.contexts
    long_model = long_context_v41(dtype, long_ + 1024)
    steps = 16 if args.quick else 32
    # eager: what is measured is how the step scales with context (a compiled step would compile per engine)
    short_ms, long_ms = context_step_pair(long_model, short, long_, steps, R, enforce_eager=True)
    # steps/s, so the ratio reads like the others (higher is better): within 1.25x slower is a ratio >= 0.8
    print(f"decode step at {long_} context {long_ms:.1f} ms, at {short} {short_ms:.1f} ms", flush=True)
    table(f"decode step at {long_} vs {short} context (tiny-v41)", 1000 / long_ms, 1000 / short_ms,
          unit="step/s", goal=0.8, vs=f"{short} context")
    v41 = load_model("tiny-v41", dtype=dtype, with_mtp=False)
    L = min(args.prefill_len, v41.cfg.max_position_embeddings - 8)
    enc_engine = engine_for(v41, "tiny-v41", max_num_seqs=4, enforce_eager=True)  # prefill only
    exact_engine = engine_for(v41, "tiny-v41", max_num_seqs=4, exact_prefill=True, enforce_eager=True)
    enc, exact = median_pair(lambda: fs_prefill_rate(enc_engine, L, 1), lambda: fs_prefill_rate(exact_engine, L, 1), R)
    table(f"prefill {L} tokens (V4.1)", enc, exact, goal=1.6, vs="exact prefill")
    if args.json:
        report = {"dtype": args.dtype, "repeats": R, "threads": torch.get_num_threads(), "logits_rel_diff": rel,
                  "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
