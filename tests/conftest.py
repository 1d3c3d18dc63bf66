"""Shared pytest setup: tests import helper modules from their own folder; one torch thread per test
process (pytest-xdist runs one worker per core, and two busy workers with two threads each spin-wait).

Every test must leave the process as it found it, so that the suite passes in any order and in any worker:
``torch_and_env_unchanged`` checks torch's global settings, torch's compiler configs and ``os.environ`` after
each test. ``--reverse`` and ``--shuffle SEED`` run the collected tests in another order to show it
(``python -m pytest tests -n 0 --shuffle 7``); every xdist worker collects the same order from the same seed."""

import os
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # subprocesses (CLI, servers) too
torch.set_num_threads(1)

for sub in ("model", "engine", "server", "config", "plan"):
    path = Path(__file__).parent / sub
    if path.is_dir() and str(path) not in sys.path:
        sys.path.insert(0, str(path))


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


# set by pytest for each phase of a test, and by inductor once a process (the address of a function its C++
# bindings call, at the first load of one)
_OWN_ENV = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _OWN_ENV}


def _torch_globals() -> dict:
    return {"threads": torch.get_num_threads(), "default dtype": torch.get_default_dtype(),
            "grad enabled": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@pytest.fixture(autouse=True)
def torch_and_env_unchanged():
    env, settings, configs = _environ(), _torch_globals(), _compiler_configs()
    yield
    changed = []
    if _environ() != env:
        keys = {k for k in set(env) | set(_environ()) if env.get(k) != os.environ.get(k)}
        changed.append(f"os.environ: {sorted(keys)}")
    now = _torch_globals()
    changed += [f"torch {k}: {settings[k]!r} -> {now[k]!r}" for k in settings if settings[k] != now[k]]
    after = _compiler_configs()
    for name, before in configs.items():
        diff = sorted(k for k in before if after[name].get(k, _MISSING) is not before[k]
                      and after[name].get(k, _MISSING) != before[k])
        changed += [f"{name}.{k}: {'missing' if after[name].get(k, _MISSING) is _MISSING else 'changed'}"
                    for k in diff]
    assert not changed, "the test left the process changed: " + "; ".join(changed)
