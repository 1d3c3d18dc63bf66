"""GPU checks of the fixed-shape decode step (run by scripts/device-check.sh on a machine with CUDA).

Not part of the test suite (CI has no GPU, and the suite leaves no skipped test): each check prints PASS or FAIL
with its numbers, and the exit status counts the failures.

1. The compiled step, with CUDA graphs and without, gives the eager step's greedy tokens on tiny-v41 and tiny-v4
   (float32, packed and float cache), at a batch size between buckets; logits within 1e-5 relative; CUDA graphs
   really recorded.
2. Steady-state decode steps never sync with the host (``torch.cuda.set_sync_debug_mode("error")``).
3. No recompilation over mixed steps after warm-up (joins, leaves, bucket changes).
4. Decode tokens/s at batch 1, 8 and 16: eager, compiled, compiled + CUDA graphs (medians of 3).
5. Routed experts split between the GPU and the CPU (``gpu_experts``): tokens equal to all experts on the GPU,
   decode tokens/s.

``python scripts/device_check.py [part ...]`` runs the named parts only (tokens, logits_and_sync, recompiles,
bench, more_tokens, hybrid; batch1, not run by default, is a short check of one compiled graph). Engines are made once
and shared between parts, so a compiled engine's warm-up (every bucket compiled, and recorded as CUDA graphs)
is paid once.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch

from flashserve.engine import EngineConfig, LLMEngine, SamplingParams

MODES = ("eager", "compiled", "compiled+graphs")


class Checks:
    """The engines the parts share (by model, cache layout, eager or compiled) and the failed checks' names. One
    compiled engine serves both compiled modes: CUDA graphs are switched on and off on its step, so the modes
    share one compile (a cold one takes minutes)."""

    def __init__(self):
        self.engines: dict[tuple[str, str, bool], LLMEngine] = {}
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            self.failed.append(name)

    def engine(self, name: str, cache: str, mode: str) -> LLMEngine:
        key = (name, cache, mode != "eager")
        if key not in self.engines:
            t = time.perf_counter()
            self.engines[key] = LLMEngine(EngineConfig(model=name, device="cuda", dtype="float32", cache_dtype=cache,
                                                       kv_memory="256MiB", max_num_seqs=16,
                                                       enforce_eager=mode == "eager", cuda_graphs=True))
            warm = self.engines[key].runner.decode_step.warmup_s
            print(f"   engine {name} {cache} cache {'eager' if mode == 'eager' else 'compiled'}: made in "
                  f"{time.perf_counter() - t:.1f} s (decode step warm-up {warm:.1f} s)", flush=True)
            if mode != "eager":
                compile_report()
        eng = self.engines[key]
        if mode != "eager":
            eng.runner.decode_step.cuda_graphs = mode == "compiled+graphs"
        return eng


def compile_report(top: int = 12) -> None:
    """Where the compiles so far spent their time (dynamo's timers, summed over calls), largest first."""
    from torch._dynamo.utils import compilation_time_metrics

    total = sorted(((sum(v), len(v), k) for k, v in compilation_time_metrics.items()), reverse=True)
    print("   compile time so far: " + "; ".join(f"{k} {s:.1f} s ({n}x)" for s, n, k in total[:top]), flush=True)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 510, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def greedy(eng: LLMEngine, batch: list[list[int]], new: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}-{time.perf_counter()}" for i in range(len(batch))]
    for rid, p in zip(ids, batch):
        eng.add_request(rid, p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[r] for r in ids]


def equal_tokens(c: Checks, combos: list[tuple[str, str]]) -> None:
    batch = prompts(5, 40, 1)  # 5 requests: padded to bucket 8
    for name, cache in combos:
        want = greedy(c.engine(name, cache, "eager"), batch, 12)
        for mode in ("compiled", "compiled+graphs"):
            eng = c.engine(name, cache, mode)
            before = replays(eng)
            got = greedy(eng, batch, 12)
            c.check(f"tokens {name} {cache} cache, {mode}", got == want,
                    "" if got == want else f"(first row {got[0]} against {want[0]})")
            steps = replays(eng) - before
            if mode == "compiled+graphs":  # the batch's steps replayed recorded graphs, not dynamo's call
                c.check(f"CUDA graphs replayed, {name} {cache} cache", steps > 0, f"({steps} replays for 11 steps)")
            else:
                c.check(f"no CUDA graph replayed with graphs off, {name} {cache} cache", steps == 0)


def replays(eng: LLMEngine) -> int:
    return sum(g.replays for g in eng.runner.decode_step._graphs.values())


def tokens(c: Checks) -> None:
    equal_tokens(c, [("tiny-v41", "packed"), ("tiny-v4", "float")])


def more_tokens(c: Checks) -> None:
    equal_tokens(c, [("tiny-v41", "float"), ("tiny-v4", "packed")])


def running(eng: LLMEngine, tag: str, n: int = 3):
    for i, p in enumerate(prompts(n, 30, 2)):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while not all(s.prefill_done for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    return eng.scheduler.running


def logits_and_sync(c: Checks, mode: str = "compiled+graphs", n: int = 3) -> None:
    eng, eager = c.engine("tiny-v41", "packed", mode), c.engine("tiny-v41", "packed", "eager")
    seqs_c, seqs_e = running(eng, "s", n), running(eager, "s", n)
    for _ in range(3):  # decode steps: compiled where new, then recorded as a CUDA graph, then replayed
        eng.step()
        eager.step()
    lc, le = eng.runner.decode(seqs_c), eager.runner.decode(seqs_e)
    rel = float(((lc - le).abs().max() / le.abs().max()))
    c.check(f"logits {mode} vs eager, batch {n}", rel < 1e-5, f"(max relative difference {rel:.2e})")
    step = eng.runner.decode_step
    # the inputs are built on the host and copied over first (a copy from pageable memory waits for the
    # stream): the check is of the step itself, as the issue asks
    inp = step.inputs([[s.tokens[s.num_computed]] for s in seqs_c], [s.num_computed for s in seqs_c],
                      [s.slot for s in seqs_c], [len(s.pages) for s in seqs_c])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(inp)
        c.check(f"no host sync inside the decode step, {mode}", True)
    except RuntimeError as e:
        c.check(f"no host sync inside the decode step, {mode}", False, str(e).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for e in (eng, eager):  # leave them empty for the next part
        for rid in {s.group.request_id for s in e.scheduler.running}:
            e.abort_request(rid)
        while e.has_unfinished_requests():
            e.step()


def recompiles(c: Checks) -> None:
    import torch._dynamo.utils as du

    eng = c.engine("tiny-v41", "packed", "compiled+graphs")
    greedy(eng, prompts(3, 20, 3), 4)
    before = du.counters["stats"]["unique_graphs"]
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    steps = 0
    for wave in range(6):  # joins and leaves change the batch size across buckets
        for i, p in enumerate(prompts(1 + 2 * wave, 20 + wave, 10 + wave)):
            eng.add_request(f"w{wave}-{i}", p, sp)
        for _ in range(30):
            eng.step()
            steps += 1
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    after = du.counters["stats"]["unique_graphs"]
    c.check("no recompiles after warm-up", after == before, f"({steps} steps, graphs {before} -> {after})")


def decode_rate(eng: LLMEngine, batch: int, new: int = 64) -> float:
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(batch, 64, 5)):
        eng.add_request(f"b{batch}-{i}-{time.perf_counter()}", p, sp)
    while not all(s.prefill_done for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    torch.cuda.synchronize()
    t, toks = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        toks += len(eng.scheduler.running)  # every running sequence decodes one token per step
        eng.step()
    torch.cuda.synchronize()
    return toks / (time.perf_counter() - t)


def bench(c: Checks) -> None:
    for m in MODES:
        for batch in (1, 8, 16):
            decode_rate(c.engine("tiny-v41", "packed", m), batch, 8)  # every shape used below seen once
    for batch in (1, 8, 16):
        rates = {m: [] for m in MODES}
        for _ in range(3):
            for m in MODES:
                rates[m].append(decode_rate(c.engine("tiny-v41", "packed", m), batch))
        med = {m: statistics.median(v) for m, v in rates.items()}
        print(f"BENCH tiny-v41 decode batch {batch}: " + ", ".join(
            f"{m} {v:.0f} tok/s ({v / med['eager']:.2f}x eager)" for m, v in med.items()), flush=True)


def batch1(c: Checks) -> None:
    """Batch 1 alone, with its own graph as on the CPU and the other buckets left uncompiled: what a lease too
    short for the whole check can show with one compiled graph (eager against compiled + CUDA graphs: tokens,
    logits, host sync, tok/s)."""
    from flashserve.engine.graphs import decode_step

    real_warm, real_buckets = decode_step.DecodeStep.warm_up, decode_step.decode_buckets
    decode_step.DecodeStep.warm_up = lambda self, rows=1: 0.0
    decode_step.decode_buckets = lambda n, one_row_graph=True: real_buckets(n)
    try:
        eager, graphs = c.engine("tiny-v41", "packed", "eager"), c.engine("tiny-v41", "packed", "compiled+graphs")
    finally:
        decode_step.DecodeStep.warm_up, decode_step.decode_buckets = real_warm, real_buckets
    batch = prompts(1, 40, 1)
    want = greedy(eager, batch, 12)
    t = time.perf_counter()
    got = greedy(graphs, batch, 12)
    c.check("tokens tiny-v41 packed cache, compiled+graphs, batch 1", got == want,
            f"(first request, compile included: {time.perf_counter() - t:.1f} s; "
            f"{len(graphs.runner.decode_step._graphs)} CUDA graph(s) recorded, {replays(graphs)} replays)")
    logits_and_sync(c, "compiled+graphs", 1)
    rates = {"eager": [], "compiled+graphs": []}
    for _ in range(3):
        rates["eager"].append(decode_rate(eager, 1))
        rates["compiled+graphs"].append(decode_rate(graphs, 1))
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"BENCH tiny-v41 decode batch 1: eager {med['eager']:.0f} tok/s, compiled+graphs "
          f"{med['compiled+graphs']:.0f} tok/s ({med['compiled+graphs'] / med['eager']:.2f}x eager; runs "
          + ", ".join(f"{m} {[round(x) for x in v]}" for m, v in rates.items()) + ")", flush=True)


def hybrid(c: Checks) -> None:
    """Routed experts split (``gpu_experts``, flashserve/model/hybrid.py): tiny-v41 in the released layout (MXFP4
    experts), three of eight experts a layer on the GPU and the rest on the CPU kernels, against every expert on the
    GPU, both eager: greedy tokens, decode tok/s at batch 1 and 8 (medians of 3), the share of pairs the GPU ran."""
    from flashserve.model.hybrid import hybrid_layers, hybrid_stats, rebalance
    from flashserve.model.loader import load_model

    engines = {}
    for name, kw in (("all on the GPU", {}), ("3 of 8 on the GPU", {"gpu_experts": 3})):
        model = load_model("tiny-v41", dtype=torch.float32, device="cuda", quantization="mxfp4", with_mtp=False, **kw)
        engines[name] = LLMEngine(EngineConfig(model="tiny-v41", device="cuda", dtype="float32", kv_memory="256MiB",
                                               max_num_seqs=16, enforce_eager=True, speculative_config=None),
                                  model=model)
    batch = prompts(3, 40, 2)
    want, got = (greedy(engines[n], batch, 24) for n in engines)
    c.check("tokens tiny-v41 mxfp4, gpu_experts=3 against all experts on the GPU", got == want)
    split = engines["3 of 8 on the GPU"]
    rebalance(hybrid_layers(split.model))
    for b in (1, 8):
        rates = {n: [] for n in engines}
        for _ in range(3):
            for n, eng in engines.items():
                rates[n].append(decode_rate(eng, b))
        med = {n: statistics.median(v) for n, v in rates.items()}
        print(f"BENCH tiny-v41 mxfp4 eager decode batch {b}: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in
                                                                            med.items()), flush=True)
    print(f"   split: {hybrid_stats(hybrid_layers(split.model))}", flush=True)


PARTS = {f.__name__: f for f in (tokens, logits_and_sync, recompiles, bench, more_tokens, batch1, hybrid)}
DEFAULT = [p for p in PARTS if p != "batch1"]


def main(names: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"unknown parts {unknown}; the parts are {list(PARTS)}")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    c = Checks()
    for name in names or DEFAULT:
        t = time.perf_counter()
        try:
            PARTS[name](c)
        except Exception as e:  # one broken part must not hide the others' results
            traceback.print_exc()
            c.check(name, False, f"raised {type(e).__name__}: {e}")
        print(f"-- {name}: {time.perf_counter() - t:.1f} s", flush=True)
    print(f"{len(c.failed)} failed: {c.failed}" if c.failed else "all device checks passed")
    return len(c.failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
