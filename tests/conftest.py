"""Shared pytest setup: tests import helper modules from their own folder; one torch thread per test
process (pytest-xdist runs one worker per core, and two busy workers with two threads each spin-wait).

Every test must leave the process as it found it, so that the suite passes in any order and in any worker:
``torch_and_env_unchanged`` checks torch's global settings, torch's compiler configs, ``os.environ`` and that no
decode step still compiles in the background after each test. ``--reverse`` and ``--shuffle SEED`` run the
collected tests in another order to show it (``python -m pytest tests -n 0 --shuffle 7``); every xdist worker
collects the same order from the same seed."""

import os
import random
import sys
import threading
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # subprocesses (CLI, servers) too
# inductor compiles in this process, not in a pool of its own (two more processes importing torch in every process
# that compiles, on the suite's two cores)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402  (after the environment its import reads)

torch.set_num_threads(1)

for sub in ("model", "engine", "server", "config", "plan"):
    path = Path(__file__).parent / sub
    if path.is_dir() and str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def released_tiny_v41(tmp_path_factory) -> Path:
    """tiny-v41 written in the released storage (FP8 blocks, MXFP4 experts: 8 a layer in 10 MoE layers, FP8 engram
    tables, BF16 embedding and head), once a test process; tests that change files copy it first."""
    from flashserve.config import load_config
    from flashserve.model.checkpoint import save_checkpoint
    from flashserve.model.loader import load_model

    path = tmp_path_factory.mktemp("tiny_v41_released")
    save_checkpoint(load_model("tiny-v41", with_mtp=False).checkpoint_tensors(), path, load_config("tiny-v41"))
    return path


def pytest_addoption(parser):
    group = parser.getgroup("flashserve order")
    group.addoption("--reverse", action="store_true", help="run the collected tests in reverse order")
    group.addoption("--shuffle", type=int, default=None, metavar="SEED",
                    help="run the collected tests in an order shuffled with this seed")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)


def pytest_report_header(config):
    order = "reversed" if config.getoption("--reverse") else "as collected"
    seed = config.getoption("--shuffle")
    return f"test order: {order}" + (f", shuffled with seed {seed}" if seed is not None else "")


_MISSING = object()


def _compiler_configs() -> dict[str, dict]:
    """torch's dynamo and inductor configs as a test would read them, for those already imported. Each entry
    is read with ``getattr``: an entry deleted from a config module (as pytest's monkeypatch undo does from 9.2
    on) is hidden from every later reader, while ``get_config_copy`` still lists its default."""
    out = {}
    for name in ("torch._dynamo.config", "torch._inductor.config"):
        module = sys.modules.get(name)
        if module is not None:
            with warnings.catch_warnings():  # reading a deprecated entry warns
                warnings.simplefilter("ignore")
                out[name] = {k: getattr(module, k, _MISSING) for k in module.get_config_copy()}
    return out


# variables pytest sets for each phase of a test, and those torch's compilers set once a process, at first use
# (the inductor cache's folder, the address of a function its C++ bindings call, ...): where the test found
# them unset, their appearance is torch's, not the test's
_OWN_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
            "KMP_DUPLICATE_LIB_OK", "TORCH_WARM_POOL", "TRITON_CACHE_DIR")


def _env_changes(before: dict[str, str]) -> list[str]:
    keys = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    return sorted(k for k in keys if not (k in _OWN_ENV and k not in before))


def _torch_globals() -> dict:
    return {"threads": torch.get_num_threads(), "default dtype": torch.get_default_dtype(),
            "grad enabled": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@pytest.fixture(autouse=True)
def torch_and_env_unchanged():
    env, settings, configs = dict(os.environ), _torch_globals(), _compiler_configs()
    env.pop("PYTEST_CURRENT_TEST", None)
    yield
    changed = []
    if keys := _env_changes(env):
        changed.append(f"os.environ: {keys}")
    now = _torch_globals()
    changed += [f"torch {k}: {settings[k]!r} -> {now[k]!r}" for k in settings if settings[k] != now[k]]
    # a decode step compiling in the background would go on using the CPU (and dynamo) after its test
    compiling = [t for t in threading.enumerate() if t.name == "flashserve-compile"]
    for t in compiling:
        t.join(10)
    if any(t.is_alive() for t in compiling):
        changed.append("a decode step still compiling in the background (wait_compiled, or enforce_eager=True)")
    after = _compiler_configs()
    for name, before in configs.items():
        for k, was in before.items():
            value = after[name].get(k, _MISSING)
            if value is _MISSING:
                changed.append(f"{name}.{k}: missing")
            elif value is not was and value != was:
                changed.append(f"{name}.{k}: {was!r} -> {value!r}")
    assert not changed, "the test left the process changed: " + "; ".join(changed)
