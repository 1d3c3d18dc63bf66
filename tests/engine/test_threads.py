"""``LLM(..., threads=N)`` and ``--threads N`` (``generate``, ``serve``) set torch's intra-op threads at
start-up; a bad N is refused with a message naming the option, before any model is loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashserve.cli import build_parser, main
from flashserve import LLM
from flashserve.engine import EngineConfig, LLMEngine
from flashserve.engine.threads import physical_cores
from flashserve.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the engine gets as far as loading a model."""
    import flashserve.model.loader as loader

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad value was refused")

    monkeypatch.setattr(loader, "load_model", refuse)


def test_llm_threads_reach_torch():
    torch.set_num_threads(1)
    LLM("tiny-v41", threads=2, kv_memory="16MiB", enforce_eager=True)
    assert torch.get_num_threads() == 2


def test_default_is_omp_num_threads_when_set(models, monkeypatch):
    """``$OMP_NUM_THREADS`` is the default where it is set (as torch and llama.cpp read it), applied even where
    the process had more."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(model="tiny-v41", num_pages=16, enforce_eager=True), model=models("tiny-v41"))
    assert torch.get_num_threads() == 1


def _default_in_subprocess(prefix: list[str]) -> tuple[int, int]:
    """(the default, the threads an engine set) in a fresh process without $OMP_NUM_THREADS."""
    code = ("from flashserve.engine.threads import default_threads; import torch; from flashserve import LLM; "
            "d = default_threads(); LLM('tiny-v41', kv_memory='8MiB', max_num_seqs=2, enforce_eager=True); "
            "print(d, torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(prefix + [sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    return int(out[-2]), int(out[-1])


def test_default_is_the_physical_cores_this_process_may_use():
    """Without $OMP_NUM_THREADS, one thread per physical core in the process's CPU affinity: all of them, or
    one when ``taskset`` pins it to one CPU."""
    cores = physical_cores(os.sched_getaffinity(0))
    assert _default_in_subprocess([]) == (cores, cores)
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1:
        assert _default_in_subprocess(["taskset", "-c", str(min(os.sched_getaffinity(0)))]) == (1, 1)


def test_hyperthreads_count_once(tmp_path):
    """Two CPUs on one core (SMT siblings) are one physical core; CPUs without topology count each."""
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):  # CPUs 2 and 3: the siblings of 0 and 1
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3}, sysfs=tmp_path) == 2
    assert physical_cores({0, 2}, sysfs=tmp_path) == 1
    assert physical_cores({0, 7}, sysfs=tmp_path) == 2  # cpu7 has no topology: counted as its own core


@pytest.mark.parametrize("bad", [0, -3, 1.5, "2", True])
def test_bad_threads_are_refused_before_loading(bad, no_loading):
    with pytest.raises(UserError, match=r"threads: must be an integer >= 1, got "):
        LLM("tiny-v41", threads=bad)


@pytest.mark.parametrize("command", [["generate", "tiny-v41", "hi"], ["serve", "tiny-v41"]])
def test_cli_flag_parses(command):
    parser = build_parser()
    assert parser.parse_args(command + ["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--threads", "two"])


def test_generate_threads_flag_sets_torch_threads(capsys):
    torch.set_num_threads(1)
    assert main(["generate", "tiny-v41", "Hello", "--max-tokens", "2", "--kv-memory", "16MiB",
                 "--threads", "2", "--enforce-eager"]) == 0
    assert torch.get_num_threads() == 2


def test_serve_threads_flag_reaches_the_engine():
    from flashserve.server.cli import build_engine

    torch.set_num_threads(1)
    build_engine(build_parser().parse_args(["serve", "tiny-v41", "--kv-memory", "16MiB", "--threads", "2",
                                            "--enforce-eager"]))
    assert torch.get_num_threads() == 2


def test_generate_zero_threads_exits_2_with_the_message(no_loading, capsys):
    assert main(["generate", "tiny-v41", "Hello", "--threads", "0"]) == 2
    assert "flashserve generate: error: threads: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_subprocess_bad_threads_has_no_traceback():
    run = subprocess.run([sys.executable, "-m", "flashserve", "serve", "tiny-v41", "--threads", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "threads: must be an integer >= 1, got 0" in run.stderr
    assert "Traceback" not in run.stderr
