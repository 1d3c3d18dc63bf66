"""A CPU engine's decode step compiled by a child process (the default where the engine loads its own model): the
child compiles each step key and saves its graphs, the engine loads them and calls them without dynamo, with an
eager engine's tokens; a later start loads them at once; a child that fails leaves the compile to the engine; a
child whose parent has gone ends (flashserve/engine/graphs/compile_child.py, step_artifacts.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from flashserve.config import config_from_dict, preset_json
from flashserve.config.checkpoint_layout import INT, checkpoint_layout
from flashserve.engine import EngineConfig, LLMEngine, SamplingParams
from flashserve.model.checkpoint import save_checkpoint
from engine_helpers import wait_compiled

pytestmark = pytest.mark.xdist_group("compile_child")  # one worker: the compiles would share two cores


def _one_layer_checkpoint(path: Path) -> Path:
    """A float32 tiny-v4 checkpoint of one window-attention layer, no MTP: four regions to compile."""
    raw = preset_json("tiny-v4")
    raw.get("text_config", raw).update(num_hidden_layers=1, compress_ratios=[0], num_nextn_predict_layers=0)
    cfg = config_from_dict(raw)
    g = torch.Generator().manual_seed(0)
    src = {t.name: (torch.randint(0, cfg.n_routed_experts, t.shape, generator=g) if t.kind == INT
                    else torch.randn(t.shape, generator=g) * 0.05) for t in checkpoint_layout(cfg, mtp=False)}
    save_checkpoint(src, path, cfg, quantize=False)
    return path


def _engine(model: str, **kw) -> LLMEngine:
    kw.setdefault("speculative_config", "off")
    return LLMEngine(EngineConfig(model=model, max_num_seqs=1, threads=1, kv_memory="16MiB", **kw))


def _greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o.outputs[0].token_ids
    return out


def _compiled_here() -> int:
    return sum(counters["aot_autograd"].values()) + counters["inductor"]["fxgraph_cache_miss"]


def test_a_child_compiles_and_the_engine_loads_its_graphs_with_eager_tokens(tmp_path, monkeypatch, caplog):
    """With no flags a CPU engine decodes eagerly at once; a child process compiles the step and saves its graphs,
    which the engine loads and calls without tracing anything itself; a growing context's new table width is
    compiled the same way; the tokens are the eager engine's. A second engine over the same cache loads the
    saved graphs at once, with no child."""
    model = str(_one_layer_checkpoint(tmp_path / "ckpt"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompt = [(7 * i) % 500 + 3 for i in range(120)]
    expected = _greedy(_engine(model, enforce_eager=True), prompt, 20)  # crosses from 2 pages to 3
    before = _compiled_here()
    with caplog.at_level(logging.INFO, logger="flashserve.engine"):
        engine = _engine(model)
        step = engine.runner.decode_step
        assert step.child is not None and step.state() == "compiling"
        assert wait_compiled(engine) and engine.stats()["decode_step"] == "compiled"
        assert _greedy(engine, prompt, 20) == expected
        assert wait_compiled(engine)
    assert _compiled_here() == before  # nothing traced or compiled in this process
    assert step.child_s > 0 and step.loaded_s > 0
    assert len(step._ready) >= 2  # the bucket's key, and a wider table's
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("decode step compiled in the background for buckets [1] in ") and "a child process "
               "compiled for" in m for m in said)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), said

    again = _engine(model)
    assert wait_compiled(again) and again.runner.decode_step.child_s == 0  # loaded, not compiled
    assert _greedy(again, prompt, 20) == expected
    assert _compiled_here() == before


def test_a_failed_child_leaves_the_compile_to_the_engine(caplog):
    """A child that cannot build its engine answers every key with the reason; the engine says so, compiles the
    step itself and decodes with the eager engine's tokens."""
    prompt = list(range(20, 60))
    expected = _greedy(_engine("tiny-v41", enforce_eager=True), prompt, 6)
    engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=1, threads=1, kv_memory="16MiB",
                                    speculative_config="off", compile_backend="eager", compile_child=True),
                       warm_up=False)
    step = engine.runner.decode_step
    step.child.options["model"] = "no-such-model"
    with caplog.at_level(logging.WARNING, logger="flashserve.engine"):
        step.warm_up()
        assert wait_compiled(engine)
    assert step.child is None and step.child_s == 0
    assert any("the compiling child process failed: building its engine: ConfigError" in r.getMessage()
               and "compiles in this process from now on" in r.getMessage() for r in caplog.records)
    assert _greedy(engine, prompt, 6) == expected


def test_a_shutdown_ends_the_child_and_compiles_nothing_in_the_engine(caplog):
    """The child runs in the engine's scheduling group and a process group of its own. Shutting the engine down while its
    child compiles ends the child, and the compiling thread stops: it does not take the ended child for a failed
    one and start compiling in the engine's own process."""
    engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=1, threads=1, kv_memory="16MiB",
                                    speculative_config="off", compile_backend="eager", compile_child=True),
                       warm_up=False)
    step = engine.runner.decode_step
    with caplog.at_level(logging.INFO, logger="flashserve.engine"):
        step.warm_up()
        proc = step.child._proc
        # the child shares the engine's os.getsid, so its lower priority counts against the engine (Linux's
        # autogroup schedules each setsid as a group of its own), and is in a process group of its own, so a
        # Ctrl-C typed at the terminal reaches the engine only
        assert os.getsid(proc.pid) == os.getsid(0) and os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        engine.shutdown()
        deadline = time.monotonic() + 30
        while step._thread is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert step._thread is None, "the compiling thread outlived the shutdown by 30 s"
    assert proc.poll() is not None
    assert not step._ready and step.state() == "compiling"  # nothing compiled: every step stays eager
    assert not any("compiles in this process" in r.getMessage() for r in caplog.records)


def test_a_model_passed_in_cannot_be_compiled_by_a_child():
    from flashserve.config import ConfigError
    from flashserve.model.loader import load_model

    model = load_model("tiny-v41")
    with pytest.raises(ConfigError, match="compile_child: a model passed to the engine cannot be rebuilt"):
        LLMEngine(EngineConfig(model="tiny-v41", compile_child=True, kv_memory="16MiB"), model=model)


CHILD_OF_A_GONE_PARENT = r"""
import os, sys, time
from flashserve.engine import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=1, threads=1, kv_memory="16MiB",
                                speculative_config="off", compile_backend="eager", compile_child=True))
print(engine.runner.decode_step.child._proc.pid, flush=True)
time.sleep(2)  # the child is building its engine or compiling
os._exit(0)
"""


def test_the_child_ends_when_its_parent_has_gone():
    p = subprocess.run([sys.executable, "-c", CHILD_OF_A_GONE_PARENT], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert p.returncode == 0, p.stderr
    pid = int(p.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break  # ended, not yet reaped by its new parent
        time.sleep(0.2)
    else:
        pytest.fail(f"the compiling child {pid} outlived its parent by 30 s")


def test_a_childs_engine_maps_what_a_copying_parent_copies_in_the_parents_layout_and_locks_nothing(
        released_tiny_v41, monkeypatch):
    """A parent under --no-mmap --mlock holds a private copy of the weights, locked; the child that compiles its
    steps maps the files instead (the page cache's pages, not a second copy), with the parent's modules (stacked
    experts, not the experts used where they lie that a mapped load makes: the graphs are the parent's), and locks
    nothing."""
    from flashserve.model import mapped_experts
    from flashserve.model.mapped import weights_held

    monkeypatch.setattr(mapped_experts, "MIN_EXPERT_BYTES", 0)  # a mapped load would use every expert in place
    options = dict(model=str(released_tiny_v41), speculative_config="off", kv_memory="16MiB", max_num_seqs=1,
                   enforce_eager=True, mmap=False, mlock=True)
    parent = LLMEngine(EngineConfig(**options))
    child = LLMEngine(EngineConfig(**options), warm_up=False, compile_only=True)
    assert sum(parent.model.load_report.mapped.values()) == 0
    assert sum(child.model.load_report.mapped.values()) > 0.5 * sum(parent.model.load_report.copied.values())
    assert child.model.load_report.locked == 0 and child.page_in is None
    assert weights_held(child.model)["mapped"] > 0
    kinds = lambda engine: [type(m).__name__ for m in engine.model.modules()]  # noqa: E731
    assert kinds(child) == kinds(parent) and "MappedExperts" not in kinds(child)
    mapped = LLMEngine(EngineConfig(**{**options, "mmap": True, "mlock": False}))
    assert "MappedExperts" in kinds(mapped)  # what the child's mapped load would make, left alone


def test_under_a_weight_budget_the_step_compiles_in_the_engines_process(released_tiny_v41):
    """A child would hold a second budget's worth of expert slots (copies): under --weight-memory the background
    compile runs in the engine's own process unless a child is asked for."""
    from flashserve.model.expert_cache import expert_caches
    from flashserve.model.loader import load_model

    model = load_model(released_tiny_v41, with_mtp=False)
    whole = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in
                list(model.parameters()) + list(model.buffers())}.values())
    options = dict(model=str(released_tiny_v41), speculative_config="off", kv_memory="16MiB", max_num_seqs=1,
                   enforce_eager=True)
    budgeted = LLMEngine(EngineConfig(**options, weight_memory=whole - 200_000))
    assert expert_caches(budgeted.model) and budgeted._compile_child(False) is None
    for engine in (LLMEngine(EngineConfig(**options)),
                   LLMEngine(EngineConfig(**options, weight_memory=whole - 200_000, compile_child=True))):
        child = engine._compile_child(False)
        assert child is not None
        child.close()
