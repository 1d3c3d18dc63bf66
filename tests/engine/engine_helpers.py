"""Helpers shared by the engine tests: engines over the session's models, greedy runs, reference decoding."""

from __future__ import annotations

import os
import time

import torch


def use_cuda_buckets(monkeypatch) -> None:
    """Compiled CPU engines made after this take the buckets CUDA gets: no graph of its own for batch 1 (a lone
    request runs padded to 2 rows in the graph every batch shares), so an engine compiles one graph, not two."""
    from flashserve.engine.graphs import decode_step

    real = decode_step.decode_buckets
    monkeypatch.setattr(decode_step, "decode_buckets", lambda n, one_row_graph=True: real(n, one_row_graph=False))


def make_engine(model, name: str, **kw):
    from flashserve.engine import EngineConfig, LLMEngine

    kw.setdefault("dtype", "float64")
    kw.setdefault("enforce_eager", True)  # the compiled step only where a test asks for it, compiled at start-up
    kw.setdefault("background_compile", False)
    kw.setdefault("kv_memory", "64MiB")  # ~900 (V4) to ~9900 (V4.1) pages: plenty, and 15x faster to set up than 1GiB
    cfg = EngineConfig(model=name, **kw)
    return LLMEngine(cfg, model=model)


def run_greedy(engine, prompts, max_tokens, **params):
    from flashserve.engine import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def reference_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]), logits_rows=1).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def prompt_of(length: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab - 1, (length,), generator=g).tolist()


def dynamic_decode(runner):
    """``runner.decode`` through the dynamic :class:`BatchState` instead of the fixed-shape step: the same logits
    [B, V] (the reference the fixed step is tested against)."""
    from flashserve.engine.batch_state import BatchState

    @torch.inference_mode()
    def decode(seqs):
        device = runner.device
        ids = torch.tensor([[s.tokens[s.num_computed]] for s in seqs], dtype=torch.long, device=device)
        start = torch.tensor([s.num_computed for s in seqs], dtype=torch.long, device=device)
        state = BatchState(runner.cache, [s.slot for s in seqs], max(len(s.pages) for s in seqs))
        return runner.model(ids, state, start=start, logits_rows=1).logits[:, -1]

    return decode


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds process ``pid`` has used (0 where it has ended or there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError, IndexError):
        return 0.0


def wait_compiled(engine, stall_s: float = 120.0) -> bool:
    """``engine.wait_compiled()`` for as long as the compile makes progress: the child process or this process (its
    compiling thread) using CPU time. False once the queue is done without a compiled step, or after ``stall_s``
    seconds in which neither used any: a wait bounded by what it waits for, not by a wall-clock guess that a
    loaded 2-core machine can miss."""
    step = engine.runner.decode_step
    used, last = -1.0, time.monotonic()
    while not engine.wait_compiled(2):
        if not step._queue.unfinished_tasks:
            return engine.wait_compiled(0)  # finished between the two reads, or failed
        proc = getattr(step.child, "_proc", None)
        now = cpu_seconds(getattr(proc, "pid", None)) + time.process_time()
        if now > used + 0.05:
            used, last = now, time.monotonic()
        elif time.monotonic() - last > stall_s:
            return False
    return True
