"""What the engine benchmark and its llama.cpp rows share: the prompts, and a flashserve engine run over a
batch of them with its wall and decode-only times."""

from __future__ import annotations

import time

import torch


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 500, (n, length), generator=g).tolist()  # ids valid in every shape's vocabulary


def engine_for(model, path: str, **kw):
    from ..engine import EngineConfig, LLMEngine

    kw.setdefault("kv_memory", "512MiB")
    kw.setdefault("dtype", str(model.dtype).removeprefix("torch."))
    kw.setdefault("threads", torch.get_num_threads())  # keep the benchmark's --threads
    engine = LLMEngine(EngineConfig(model=path, **kw), model=model)
    engine.wait_compiled()  # a compiled step is measured compiled, not while it compiles in the background
    return engine


def fs_run(engine, batch: list[list[int]], new: int) -> tuple[float, float]:
    """(total wall time, decode-only time after every request's first token). Outputs are "delta", as the
    server and ``flashserve generate`` stream them: each step's output holds only what is new."""
    from ..engine import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, output_kind="delta")
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"b{i}-{t0}", p, sp)
    started: set[str] = set()
    t_first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t_first is None:
            started.update(o.request_id for o in outs if o.outputs[0].delta_token_ids)
            if len(started) == len(batch):
                t_first = time.perf_counter()
    t1 = time.perf_counter()
    return t1 - t0, t1 - (t_first or t0)
