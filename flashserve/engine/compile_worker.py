"""The child process of a background compile (:mod:`flashserve.engine.graphs.compile_child` starts it): builds the
engine it is given, compiles each step key it reads on stdin and saves the key's graphs
(:mod:`flashserve.engine.graphs.step_artifacts`), answering one JSON line a key."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time


def _watch_parent(parent: int) -> None:
    """End this process at once when its parent has gone (it would otherwise compile for nobody)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _say(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # as the in-process compiling thread: after the serving process
    except (AttributeError, OSError):
        pass
    logging.basicConfig(level=logging.WARNING, format="flashserve compile child: %(levelname)s %(message)s")
    t0 = time.perf_counter()
    import torch

    from .engine_config import EngineConfig
    from .graphs.step_artifacts import StepArtifacts
    from .llm_engine import LLMEngine

    spec = json.loads(argv[0])
    try:
        engine = LLMEngine(EngineConfig(**spec["options"]), warm_up=False, compile_only=True)
        step = engine.runner.decode_step
        if step.regions is None:
            raise RuntimeError("the child's decode step is not compiled")
        step.regions.recorder.artifacts = step.regions.backend == "inductor"
        artifacts = StepArtifacts(step.regions, spec["artifacts"])
    except Exception as e:  # every key fails with the reason
        reason = f"{type(e).__name__}: {e}"
        for line in sys.stdin:
            _say({"key": json.loads(line), "error": f"building its engine: {reason}"})
        return 1
    _say({"ready": time.perf_counter() - t0})
    for line in sys.stdin:
        key = tuple(json.loads(line))
        t = time.perf_counter()
        try:
            with torch.inference_mode():
                step._forward(*step._scratch(key))
            saved = artifacts.save(key) if step.regions.recorder.artifacts else 0
        except Exception as e:
            _say({"key": list(key), "error": f"{type(e).__name__}: {e}"})
            continue
        _say({"key": list(key), "s": time.perf_counter() - t, "saved": saved})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
