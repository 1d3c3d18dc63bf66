"""The decode step compiled in the background (the CPU's default): the engine serves with the eager step at once,
compiles on a thread of its own, and switches to the compiled step between two steps, with the same greedy tokens
as an eager engine throughout (flashserve/engine/graphs/decode_step.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from engine_helpers import make_engine, prompt_of, run_greedy, wait_compiled
from flashserve.config.presets import preset_json
from flashserve.engine import SamplingParams
from flashserve.engine.graphs.decode_step import DecodeStep
from flashserve.model import modes
from test_regions import _model


def _engine(model, **kw):
    kw.setdefault("max_num_seqs", 2)
    return make_engine(model, "tiny-v41", enforce_eager=False, background_compile=True, compile_backend="eager",
                       dtype="float32", cache_dtype="packed", **kw)


@pytest.fixture
def gate(monkeypatch):
    """The compiling thread waits at its start until the test sets this event."""
    release = threading.Event()
    compile_in_background = DecodeStep._compile_in_background

    def gated(self):
        release.wait(60)
        compile_in_background(self)

    monkeypatch.setattr(DecodeStep, "_compile_in_background", gated)
    yield release
    release.set()


def _steps(engine, prompts, max_tokens, before_step=None, **params):
    """Greedy tokens of ``prompts`` and, for each decode step, (rows it computed, whether compiled)."""
    step = engine.runner.decode_step
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    done, shapes = {}, []
    inputs = step.inputs

    def noted(*a, **k):
        out = inputs(*a, **k)
        shapes.append((*out.ids.shape, out.compiled))
        return out

    step.inputs = noted
    try:
        while engine.has_unfinished_requests():
            if before_step is not None:
                before_step(shapes)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        del step.inputs
    return [done[f"r{i}"] for i in range(len(prompts))], shapes


def test_requests_decode_eagerly_while_it_compiles_then_compiled_with_the_same_tokens(gate, caplog):
    """Requests that start while the step compiles decode eagerly, go on compiled from the first step after their
    shape is compiled, and make the tokens an eager engine makes; the log says what happened."""
    model = _model(preset_json("tiny-v41"))
    prompts = [prompt_of(40, seed=1)]  # one bucket to compile (batch 2's graphs: test_regions)
    expected = run_greedy(make_engine(model, "tiny-v41", dtype="float32", cache_dtype="packed", max_num_seqs=1),
                          prompts, 8)
    with caplog.at_level(logging.INFO, logger="flashserve.engine"):
        engine = _engine(model, max_num_seqs=1)
        assert engine.stats()["decode_step"] == "compiling"

        def release_after_three(shapes):
            if len(shapes) == 3 and not gate.is_set():
                gate.set()
                assert wait_compiled(engine)

        tokens, shapes = _steps(engine, prompts, 8, release_after_three)
    assert tokens == expected
    assert shapes[:3] == [(1, 1, False)] * 3  # eager
    assert shapes[3:] == [(1, 1, True)] * (len(shapes) - 3)  # compiled
    assert engine.stats()["decode_step"] == "compiled"
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("decode step (eager until compiled) warmed up") and "compiling in the background" in m
               for m in said)
    assert any(m.startswith("decode step compiled in the background for buckets [1] in ") for m in said)


def test_verification_rows_are_compiled_when_first_asked_for(caplog):
    """A shape the warm-up did not compile (k+1 rows to verify k drafted tokens) runs eagerly at once and is
    compiled on the thread; later steps of that shape run compiled, with the eager engine's tokens."""
    model = _model(preset_json("tiny-v41"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompt = list(range(16, 80)) * 2  # most tokens seen before: a draft at almost every step
    expected = run_greedy(make_engine(model, "tiny-v41", dtype="float32", cache_dtype="packed", max_num_seqs=1,
                                      speculative_config=spec), [prompt], 16)
    with caplog.at_level(logging.INFO, logger="flashserve.engine"):
        engine = _engine(model, speculative_config=spec, max_num_seqs=1)
        assert wait_compiled(engine)

        def wait_for_shape(shapes):
            if shapes and not shapes[-1][2]:
                assert wait_compiled(engine)

        tokens, shapes = _steps(engine, [prompt], 16, wait_for_shape)
    assert tokens == expected
    verifying = sorted({R for _, R, _ in shapes if R > 1})
    assert verifying and any(sum(R == r for _, R, _ in shapes) > 1 for r in verifying)
    for r in verifying:  # each shape: eager the first time, compiled after
        compiled = [c for _, R, c in shapes if R == r]
        assert compiled == [False] + [True] * (len(compiled) - 1)
        assert (True, r) in engine.runner.decode_step.compiled_shapes
        assert any(m.getMessage().startswith(f"decode step compiled in the background for batches of 1 of {r} rows")
                   for m in caplog.records)


def test_a_failed_background_compile_leaves_the_step_eager(gate, caplog):
    """A compile that fails is logged and the engine goes on decoding eagerly, with the same tokens."""
    model = _model(preset_json("tiny-v41"))
    prompts = [prompt_of(12, seed=3)]
    expected = run_greedy(make_engine(model, "tiny-v41", dtype="float32", cache_dtype="packed", max_num_seqs=2),
                          prompts, 5)
    engine = _engine(model)
    step = engine.runner.decode_step

    def broken(*args):
        raise RuntimeError("no compiler here")

    step._forward = broken
    with caplog.at_level(logging.ERROR, logger="flashserve.engine"):
        gate.set()
        assert not wait_compiled(engine)
    assert engine.stats()["decode_step"] == "eager" and isinstance(step.compile_error, RuntimeError)
    assert any("steps not compiled yet stay eager: RuntimeError: no compiler here" in r.getMessage()
               for r in caplog.records)
    tokens, shapes = _steps(engine, prompts, 5)
    assert tokens == expected and not any(s[2] for s in shapes)


def test_a_forward_mode_is_per_thread():
    """A thread that runs its forwards compiled leaves another thread's forwards eager."""
    seen = {}
    inside, leave = threading.Event(), threading.Event()

    def compiling():
        with modes.running(modes.COMPILED_CPU):
            seen["thread"] = modes.active()
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=compiling)
    t.start()
    assert inside.wait(10)
    seen["main"] = modes.active()
    leave.set()
    t.join()
    assert seen == {"thread": modes.COMPILED_CPU, "main": modes.EAGER}


def test_the_cpu_compiles_in_the_background_unless_told_not_to():
    """With no flags the CPU engine's step is compiled in the background (here on a thread: a model passed to the
    engine is not rebuilt by a child process); ``background_compile=False`` compiles it before the engine serves,
    and ``enforce_eager`` compiles nothing."""
    model = _model(preset_json("tiny-v41"))
    default = make_engine(model, "tiny-v41", enforce_eager=None, background_compile=None, compile_backend="eager",
                          dtype="float32", max_num_seqs=1)
    step = default.runner.decode_step
    assert step.regions is not None and step.background and step.child is None
    assert wait_compiled(default) and default.stats()["decode_step"] == "compiled"
    now = make_engine(model, "tiny-v41", enforce_eager=False, background_compile=False, compile_backend="eager",
                      dtype="float32", max_num_seqs=1)
    step = now.runner.decode_step
    assert step.regions is not None and not step.background
    assert now.stats()["decode_step"] == "compiled" and step.warmup_s > 0
    eager = make_engine(model, "tiny-v41", enforce_eager=True, dtype="float32", max_num_seqs=1)
    assert eager.runner.decode_step.regions is None and eager.stats()["decode_step"] == "eager"


def test_a_model_drafters_verification_steps_have_one_shape_with_the_eager_tokens():
    """With DSpark every compiled verification step computes k+1 rows (a shorter draft padded, as a batch pads
    shorter drafts to the longest): one graph and one key, not one per draft length; the tokens are the eager
    engine's."""
    from flashserve.model.loader import load_model

    model = load_model("tiny-v41", dtype="float32")
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    prompts = [prompt_of(30, seed=5)]
    expected = run_greedy(make_engine(model, "tiny-v41", dtype="float32", max_num_seqs=1, speculative_config=spec),
                          prompts, 24)
    engine = make_engine(model, "tiny-v41", dtype="float32", max_num_seqs=1, speculative_config=spec,
                         enforce_eager=False, compile_backend="eager")
    tokens, shapes = _steps(engine, prompts, 24)
    assert tokens == expected
    drafted = engine.spec_stats.as_dict()
    assert drafted["num_accepted_tokens"] < 3 * drafted["num_drafts"]  # not every draft whole: rows were padded
    assert {R for _, R, _ in shapes} <= {1, 4} and 4 in {R for _, R, _ in shapes}
    assert all(compiled for _, _, compiled in shapes)


def test_the_warm_up_compiles_the_table_width_the_first_steps_ask_for(monkeypatch):
    """Where the fewest pages a step reads is not itself a table width (9 pages: tables of 10 columns), the
    warm-up compiles the width the first steps ask for: they run compiled, and no other key is queued."""
    init = DecodeStep.__init__

    def nine_pages(self, *a, **k):
        init(self, *a, **k)
        self.min_pages = 9

    monkeypatch.setattr(DecodeStep, "__init__", nine_pages)
    model = _model(preset_json("tiny-v41"))
    engine = _engine(model, max_num_seqs=1)
    step = engine.runner.decode_step
    assert wait_compiled(engine)
    warmed = set(step._asked)
    _, shapes = _steps(engine, [prompt_of(9, seed=3)], 4)
    assert step.table_width(9) == 10 and {k[2] for k in warmed} == {10}
    assert all(c for *_, c in shapes) and step._asked == warmed
