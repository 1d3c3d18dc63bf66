"""The engine interface the layers above use (:class:`flashserve.engine.interface.Engine`): a one-process
engine satisfies it, and the server, ``LLM`` and the benchmarks' engine backend use nothing of an engine that
it does not declare (the sharded engine's side is in tests/parallel)."""

from __future__ import annotations

import ast
from pathlib import Path

import flashserve
from flashserve.engine.interface import Engine

PKG = Path(flashserve.__file__).parent
# code that holds an engine it did not build itself: it may use the interface only
USERS = ["server/service.py", "server/engine_loop.py", "server/images.py", "server/cli.py", "server/app.py",
         "server/basic_routes.py", "entrypoints/llm.py", "bench/backends.py"]


def _declared() -> set[str]:
    return {n for n in dir(Engine) if not n.startswith("_")} | set(Engine.__annotations__)


def _engine_attributes(path: Path) -> set[str]:
    """Attributes read or set on a name ``engine`` (``engine.x``, ``self.engine.x``, ``srv.engine.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "engine") or \
                    (isinstance(base, ast.Attribute) and base.attr == "engine"):
                out.add(node.attr)
    return out


def test_the_layers_above_use_only_the_interface():
    used = {f: _engine_attributes(PKG / f) for f in USERS}
    assert any(used.values())  # the scan sees the engine's uses
    beyond = {f: sorted(a - _declared()) for f, a in used.items() if a - _declared()}
    assert not beyond, beyond


def test_one_process_engine_satisfies_the_interface():
    from flashserve.engine.engine_config import EngineConfig
    from flashserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny-v41", dtype="float32", kv_memory="8MiB", max_num_seqs=2,
                                    enforce_eager=True))
    assert isinstance(engine, Engine)
    assert engine.failure is None and not engine.exit_on_failure
    assert engine.reads_images == (engine.model_config.vision is not None)
    engine.add_request("a", [5, 6, 7])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["generation_tokens_total"] > 0
    engine.shutdown()
