"""Sharded engines (gloo on the CPU) compute the same tokens as one process: TP=2, EP=2, attention-DP=2 with
EP, and TP=2 inside each of 2 attention-DP groups (4 ranks), on tiny-v4 and tiny-v41 (float64; V4.1's
encoder-only prefill, prefix-cache hits and seeded sampling included), also in a process whose torch already ran
on two threads; a killed or hung worker ends the engine with a clear error within its timeout and leaves no
process behind, at start-up too."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashserve.entrypoints.llm import LLM
from flashserve.engine.interface import Engine
from flashserve.engine.sampling_params import SamplingParams
from flashserve.parallel.executor import WorkerFailure

OPTS = dict(dtype="float64", kv_memory="16MiB", max_num_seqs=8, block_size=16, threads=1, enforce_eager=True)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=4, temperature=1.0, top_k=50, seed=7 + i, ignore_eos=True) for i in range(2)]
PREFIX = {"tiny-v4": list(range(3, 133)), "tiny-v41": list(range(3, 43))}  # a whole page to share (128, 16 tokens)


def _run(llm: LLM, model: str) -> dict:
    """One request alone, then 12 at once (8 greedy, a prefix-cache hit on the first request's pages, 2
    seeded samples, one with prompt logprobs, which V4.1 prefills exactly; max_num_seqs 8, so some wait)."""
    prefix = PREFIX[model]
    alone = llm.generate([prefix + [400, 401]], GREEDY)[0].outputs[0].token_ids
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(8)]
    prompts += [prefix + [402, 403, 404], [11, 12, 13], [21, 22], [31, 32, 33, 34, 35]]
    exact = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, [GREEDY] * 9 + SEEDED + [exact])
    plp = [max(d, key=d.get) if d else None for d in outs[-1].prompt_logprobs]
    return {"alone": alone, "batch": [o.outputs[0].token_ids for o in outs], "prompt_logprob_top": plp,
            "prefix_hit": llm.engine.stats()["prefix_cache_hit_rate"] > 0}


_REF: dict = {}


def _reference(model: str) -> dict:
    if model not in _REF:
        _REF[model] = _run(LLM(model, **OPTS), model)
    return _REF[model]


LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "dp2": dict(data_parallel_size=2, enable_expert_parallel=True),
           "tp2dp2": dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)}


_TP = {"attn_wo_b_allreduce", "embed_allreduce", "head_allgather"}
_DP = {"moe_dp_header", "moe_dp_dispatch_x", "moe_dp_dispatch_route", "moe_dp_combine"}
COLLECTIVES = {"tp2": _TP | {"moe_tp_allreduce"}, "ep2": _TP | {"moe_ep_allreduce"}, "dp2": _DP,
               "tp2dp2": _TP | _DP | {"moe_dp_tp_allreduce"}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", ["tiny-v41", "tiny-v4"])
def test_sharded_tokens_equal_one_process(model, layout):
    ref = _reference(model)
    assert ref["prefix_hit"]  # the prefix pair did hit the cache
    llm = LLM(model, **OPTS, **LAYOUTS[layout])
    try:
        got = _run(llm, model)
        counters = llm.engine.collective_counters()
        if (model, layout) == ("tiny-v41", "tp2"):
            # TP's all-reduces per decode step are plan's TP link-bytes term for the same layout and batch
            # (the plan counts bf16, this run float64: four times as many bytes)
            assert _decode_allreduce_bytes(llm.engine) == 4 * _plan_tp_link_bytes(4)  # 20,480 B
    finally:
        llm.engine.shutdown()
    assert got == ref
    # the collectives this layout runs, each called (a layout that skipped one, or ran another's, fails here)
    assert set(counters[0]) == COLLECTIVES[layout]
    assert all(counters[0][k]["calls"] > 0 for k in COLLECTIVES[layout])
    if layout == "tp2dp2":  # 4 ranks: a DP group's TP ranks run the same collectives; the MoE keeps all in step
        calls = [{k: v["calls"] for k, v in c.items()} for c in counters]
        assert calls[0] == calls[1] and calls[2] == calls[3]
        assert len({c["moe_dp_header"] for c in calls}) == 1
    elif layout == "dp2":  # same collectives; each rank's dispatched rows come back to it as combined rows
        assert {k: v["calls"] for k, v in counters[0].items()} == {k: v["calls"] for k, v in counters[1].items()}
        for a, b in ((0, 1), (1, 0)):
            assert counters[a]["moe_dp_dispatch_x"]["link_bytes"] == counters[b]["moe_dp_combine"]["link_bytes"]
    else:  # replicas: the same collectives with the same bytes
        assert counters[0] == counters[1]
    assert all(p.exitcode is not None for p in llm.engine.procs)


def _engine(**kw):
    return LLM("tiny-v41", **OPTS, tensor_parallel_size=2, worker_timeout=4.0, **kw)


def test_killed_worker_ends_engine_within_timeout():
    llm = _engine()
    proc = llm.engine.procs[0]
    llm.generate([[1, 2, 3]], GREEDY)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert time.monotonic() - t0 < 4.0 + 2.0
    with pytest.raises(WorkerFailure):  # the engine stays stopped
        llm.generate([[1, 2, 3]], GREEDY)
    assert all(p.exitcode is not None for p in llm.engine.procs)


def test_hung_worker_ends_engine_within_timeout():
    llm = _engine()
    proc = llm.engine.procs[0]
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailure, match="did not answer within the 4 s worker timeout"):
            llm.generate([[1, 2, 3]], GREEDY)
        assert time.monotonic() - t0 < 4.0 + 3.0
        # the engine's own cleanup killed (and reaped) the stopped worker, before any cleanup of this test's
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_packed_weights_sharded_tokens_equal_one_process():
    """A checkpoint's packed weights (here MXFP4 experts, FP8 dense) are sharded as stored: TP=2 with EP gives
    one process's tokens."""
    opts = dict(OPTS, quantization="mxfp4")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(8)]
    ref = [o.outputs[0].token_ids for o in LLM("tiny-v41", **opts).generate(prompts, GREEDY)]
    llm = LLM("tiny-v41", **opts, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    finally:
        llm.engine.shutdown()


def test_speculative_decoding_sharded_tokens_equal_one_process():
    """DSpark drafting (replicated drafter, verification rows through the sharded decode step) gives one
    process's tokens under TP=2 with EP."""
    opts = dict(OPTS, speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(4)]
    ref = [o.outputs[0].token_ids for o in LLM("tiny-v41", **opts).generate(prompts, GREEDY)]
    llm = LLM("tiny-v41", **opts, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    finally:
        llm.engine.shutdown()



def _decode_allreduce_bytes(eng) -> float:
    """Attention + MoE all-reduce link bytes per decode step of 4 sequences, measured on rank 0."""
    start = eng.stats()["generation_tokens_total"]
    for i in range(4):
        eng.add_request(f"d{i}", [3 + i, 9, 27, 81], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.stats()["generation_tokens_total"] < start + 4:  # every prompt prefilled: only decode steps from here
        eng.step()
    eng.collective_counters()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    c = eng.collective_counters()[0]
    return (c["attn_wo_b_allreduce"]["link_bytes"] + c["moe_tp_allreduce"]["link_bytes"]) / steps


def _plan_tp_link_bytes(concurrency: int) -> float:
    from flashserve.plan.inputs import PlanInputs
    from flashserve.plan.planner import build_deployment
    from flashserve.plan.roofline import decode_step

    dep = build_deployment(PlanInputs(model="tiny-v41", hardware="h200", gpus=2, tp=2, ep=1, attention_dp=1,
                                      weight_dtype="bf16", stack="none"))
    return decode_step(dep, concurrency, 8).comm_bytes_tp


# ---------------------------------------------------------------------------------------------- requests under DP
def _dp_engine(layout: str, **kw):
    return LLM("tiny-v41", **dict(OPTS, **kw), **LAYOUTS[layout])


@pytest.mark.parametrize("layout", ["tp2dp2", "dp2"])
def test_rejected_request_under_dp_raises_and_engine_keeps_serving(layout):
    """A request a DP group refuses (RequestError: an empty prompt; QueueFullError: its waiting queue is full, the
    server's 429) raises that error to the caller, from the first group and from the second (whose ranks are 2
    and 3 under TP=2 x DP=2), and the engine serves on."""
    from flashserve.engine.sampling_params import QueueFullError, RequestError

    llm = _dp_engine(layout, max_waiting=2)
    eng = llm.engine
    two = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    one = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        eng.add_request("a", [5, 6, 7], two)  # group 0: 2 sequences waiting (full)
        with pytest.raises(RequestError, match="prompt"):
            eng.add_request("bad", [], one)  # group 1 (the least loaded) refuses it
        eng.add_request("b", [8, 9], one)  # group 1: 1 waiting
        with pytest.raises(QueueFullError):
            eng.add_request("c", [10, 11], two)  # group 1: 1 + 2 > 2
        eng.add_request("d", [12, 13], one)  # group 1: full
        with pytest.raises(QueueFullError):
            eng.add_request("e", [14, 15], one)  # group 0 (load 2 = 2): full
        with pytest.raises(RequestError, match="prompt"):
            eng.add_request("bad2", [], one)  # group 0 refuses it
        assert eng.failure is None and eng.owner == {"a": 0, "b": 1, "d": 1}
        assert isinstance(eng, Engine) and not hasattr(eng, "scheduler")  # the interface, nothing forwarded
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = [len(c.token_ids) for c in o.outputs]
        assert done == {"a": [3, 3], "b": [3], "d": [3]}
        assert len(llm.generate([[1, 2, 3], [4, 5]], GREEDY)) == 2  # still serving
    finally:
        eng.shutdown()


def test_dp_balances_sequences_over_groups():
    """New requests go to the DP group with the fewest unfinished sequences, counted the same way (n per request)
    when a request is added and when the counts are redone after a step; each group gets requests."""
    llm = _dp_engine("dp2")
    eng = llm.engine
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        eng.add_request("A", [5, 6, 7], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
        eng.step()  # counts redone from the owners: A still holds 3 sequences
        assert eng.load == [3, 0]
        eng.add_request("B", [8, 9], p)
        eng.add_request("C", [10, 11], p)
        assert (eng.owner["B"], eng.owner["C"]) == (1, 1) and eng.load == [3, 2]
        for i in range(4):
            eng.add_request(f"x{i}", [20 + i, 3], p)
        eng.step()
        per_rank = {r: s["num_running"] + s["num_waiting"] for r, s in eng._stats.items()}
        assert per_rank == {0: 3 + 2, 1: 2 + 2}  # every rank's own engine holds its group's sequences
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.load == [0, 0]
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------------------------------- start-up
def test_sharded_engines_start_after_an_engine_ran_on_two_threads(monkeypatch):
    """In a process whose torch already ran on two threads (a one-process engine at the default threads on 2
    cores: OpenMP's pool is running), TP=2, EP=2 and DP=2 with EP each start with two threads a rank (a rank's
    share of a larger machine's cores) and give the one-process engine's greedy tokens. Every worker is a fresh
    interpreter, which inherits no pool: a worker forked from this process hung in its first parallel op on two
    threads (torch.zeros, allocating its KV cache), forever."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(4)]
    opts = dict(OPTS, threads=2)  # the suite runs on one thread (tests/conftest.py)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the workers' idle threads sleep: 2 cores, 2 x 2 threads
    threads = torch.get_num_threads()
    try:
        one = LLM("tiny-v41", **opts)
        assert torch.get_num_threads() == 2
        ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
        for layout in ("tp2", "ep2", "dp2"):
            llm = LLM("tiny-v41", **opts, **LAYOUTS[layout], startup_timeout=120.0)  # a hang fails, not waits
            try:
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            finally:
                llm.engine.shutdown()
            assert got == ref, layout
            assert [p.exitcode for p in llm.engine.procs] == [0]  # told to stop, each exited cleanly
    finally:
        torch.set_num_threads(threads)


def test_ranks_share_the_default_threads(monkeypatch):
    """With no ``threads`` given, each of the machine's ranks keeps its share of the cores (cores / ranks) once
    its engine is built, not every core (two ranks on every core spin-wait on each other)."""
    from flashserve.engine import threads as engine_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine_threads, "physical_cores", lambda *a, **k: 8)  # rank 0 (this process) sees 8 cores
    threads = torch.get_num_threads()
    try:
        llm = LLM("tiny-v41", **dict(OPTS, threads=None), tensor_parallel_size=2)
        try:
            assert torch.get_num_threads() == 4
        finally:
            llm.engine.shutdown()
    finally:
        torch.set_num_threads(threads)


def _hangs_building_its_engine(*args):
    """A spawned worker's target (pickled by reference, imported in the worker) whose engine build never ends."""
    from flashserve.parallel import executor

    def hang(config, layout, rank, comm):
        time.sleep(3600)

    executor.build_rank_engine = hang
    executor._spawned_worker(*args)


def _hangs_before_the_rendezvous(*args):
    """A spawned worker's target that never reaches rank 0's store."""
    time.sleep(3600)


# (worker target, startup timeout, the error, the most seconds the start may take). Never ready: 10 s, as the
# worker's fresh interpreter imports torch before it reaches the store (3 s idle, 5 s on two busy cores), and the
# rendezvous and the wait for ready are each bounded by it. Never joins: the rendezvous alone.
HUNG_WORKERS = {
    "never_gets_ready": (_hangs_building_its_engine, 10.0,
                         r"^TP=2 \(2 ranks\): start-up failed: worker rank 1 \(pid \d+\) was not ready within the 10 s "
                         r"startup timeout \(--startup-timeout\); it was building its engine$", 2 * 10.0 + 10.0),
    "never_joins": (_hangs_before_the_rendezvous, 3.0,
                    r"^TP=2 \(2 ranks\): start-up failed: the ranks did not meet within the 3 s startup timeout "
                    r"\(--startup-timeout\): worker rank 1 \(pid \d+\) never reached rank 0's store \(", 3.0 + 5.0),
}


@pytest.mark.parametrize("case", HUNG_WORKERS)
def test_startup_timeout_bounds_a_hung_worker(case, monkeypatch):
    """A worker that hangs while building its engine, or before it reaches rank 0's store, ends the start-up after
    --startup-timeout seconds (not an hour), naming the rank, its pid and what it was doing (or that it never
    reached the store), and is killed and reaped."""
    from flashserve.parallel import executor

    target, timeout, message, most_s = HUNG_WORKERS[case]
    monkeypatch.setattr(executor, "_spawned_worker", target)
    before = set(_child_pids())
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match=message):
        LLM("tiny-v41", **OPTS, tensor_parallel_size=2, startup_timeout=timeout)
    assert time.monotonic() - t0 < most_s
    assert set(_child_pids()) <= before  # the worker was killed and reaped


def test_worker_process_does_not_rerun_the_callers_main(tmp_path):
    """A worker is a fresh interpreter that runs its target only: a script without an ``if __name__ ==
    "__main__"`` guard (whose top level starts the worker) runs its top level once, as multiprocessing's spawn
    would not."""
    script = tmp_path / "script.py"
    script.write_text("import sys\n"
                      "from flashserve.parallel.executor import WorkerProcess\n"
                      "print('top level', flush=True)\n"
                      "p = WorkerProcess(print, ('worker', sys.argv[1]), name='w')\n"
                      "p.join(120)\n"
                      "print('exit', p.exitcode, flush=True)\n")
    out = subprocess.run([sys.executable, str(script), "ran"], capture_output=True, text=True, timeout=180)
    assert out.stdout.split("\n") == ["top level", "worker ran", "exit 0", ""], out.stdout + out.stderr


def _child_pids() -> list[int]:
    from pathlib import Path

    me, out = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_engine_is_collected_and_stops_its_workers_without_shutdown():
    """An engine that is dropped without shutdown() is not kept alive (no atexit reference, the heartbeat holds a
    weak one): collecting it tells its workers to stop, and they exit 0."""
    import gc
    import weakref

    llm = _engine()
    llm.generate([[1, 2, 3]], GREEDY)
    ref, procs = weakref.ref(llm.engine), list(llm.engine.procs)
    del llm
    gc.collect()
    assert ref() is None
    for p in procs:
        p.join(10)
    assert [p.exitcode for p in procs] == [0]
