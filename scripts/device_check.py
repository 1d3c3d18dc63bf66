"""GPU checks of the fixed-shape decode step (run by scripts/device-check.sh on a machine with CUDA).

Not part of the test suite (CI has no GPU, and the suite leaves no skipped test): each check prints PASS or FAIL
with its numbers, and the exit status counts the failures.

1. The compiled step, with CUDA graphs and without, gives the eager step's greedy tokens on tiny-v4 and tiny-v41
   (float32, packed and float cache), at batch sizes between buckets; logits within 1e-5 relative.
2. Steady-state decode steps never sync with the host (``torch.cuda.set_sync_debug_mode("error")``).
3. No recompilation over mixed steps after warm-up (joins, leaves, bucket changes).
4. Decode tokens/s at batch 1, 8 and 16: eager, compiled, compiled + CUDA graphs (medians of 3).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from flashserve.engine import EngineConfig, LLMEngine, SamplingParams

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def engine(name: str, **kw) -> LLMEngine:
    kw.setdefault("kv_memory", "256MiB")
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine(EngineConfig(model=name, device="cuda", dtype="float32", **kw))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 510, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def greedy(eng: LLMEngine, batch: list[list[int]], new: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        eng.add_request(f"r{i}-{time.perf_counter()}", p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[k] for k in sorted(done, key=lambda r: int(r[1:].split("-")[0]))]


def check_equal_tokens() -> None:
    for name in ("tiny-v4", "tiny-v41"):
        for cache in ("float", "packed"):
            batch = prompts(5, 40, 1)  # 5 requests: padded to bucket 8
            want = greedy(engine(name, cache_dtype=cache, enforce_eager=True), batch, 12)
            for graphs in (False, True):
                got = greedy(engine(name, cache_dtype=cache, enforce_eager=False, cuda_graphs=graphs), batch, 12)
                check(f"tokens {name} {cache} cache, cuda_graphs={graphs}", got == want)


def check_logits_and_sync() -> None:
    eng = engine("tiny-v41", enforce_eager=False, cuda_graphs=True)
    eager = engine("tiny-v41", enforce_eager=True)
    for e in (eng, eager):
        for i, p in enumerate(prompts(3, 30, 2)):
            e.add_request(f"s{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        while not all(s.prefill_done for s in e.scheduler.running):
            e.step()
    seqs_c, seqs_e = eng.scheduler.running, eager.scheduler.running
    lc, le = eng.runner.decode(seqs_c), eager.runner.decode(seqs_e)
    rel = float(((lc - le).abs().max() / le.abs().max()))
    check("logits compiled+graphs vs eager", rel < 1e-5, f"(max relative difference {rel:.2e})")
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inp = eng.runner.decode_step.inputs([[s.tokens[s.num_computed]] for s in seqs_c],
                                            [s.num_computed for s in seqs_c], [s.slot for s in seqs_c],
                                            [len(s.pages) for s in seqs_c])
        eng.runner.decode_step(inp)
        check("no host sync inside the decode step", True)
    except RuntimeError as e:
        check("no host sync inside the decode step", False, str(e).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_recompiles() -> None:
    import torch._dynamo.utils as du

    eng = engine("tiny-v41", enforce_eager=False, cuda_graphs=True)
    greedy(eng, prompts(3, 20, 3), 4)  # warm
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
    check("no recompiles after warm-up", after == before, f"({steps} steps, graphs {before} -> {after})")


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


def bench() -> None:
    modes = {"eager": dict(enforce_eager=True), "compiled": dict(enforce_eager=False, cuda_graphs=False),
             "compiled+graphs": dict(enforce_eager=False, cuda_graphs=True)}
    engines = {m: engine("tiny-v41", **kw) for m, kw in modes.items()}
    for e in engines.values():
        decode_rate(e, 1, 8)  # warm every bucket used below
        decode_rate(e, 8, 8)
        decode_rate(e, 16, 8)
    for batch in (1, 8, 16):
        rates = {m: [] for m in modes}
        for _ in range(3):
            for m, e in engines.items():
                rates[m].append(decode_rate(e, batch))
        med = {m: statistics.median(v) for m, v in rates.items()}
        print(f"BENCH tiny-v41 decode batch {batch}: " + ", ".join(
            f"{m} {v:.0f} tok/s ({v / med['eager']:.2f}x eager)" for m, v in med.items()), flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for part in (check_equal_tokens, check_logits_and_sync, check_recompiles, bench):
        t = time.perf_counter()
        try:
            part()
        except Exception as e:  # one broken part must not hide the others' results
            check(part.__name__, False, f"raised {type(e).__name__}: {e}")
        print(f"-- {part.__name__}: {time.perf_counter() - t:.1f} s", flush=True)
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all device checks passed")
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
