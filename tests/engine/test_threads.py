"""``LLM(..., threads=N)`` and ``--threads N`` (``generate``, ``serve``) set torch's intra-op threads at
start-up; a bad N is refused with a message naming the option, before any model is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashserve.cli import build_parser, main
from flashserve import LLM
from flashserve.engine import EngineConfig, LLMEngine
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
    LLM("tiny-v41", threads=2, kv_memory="16MiB")
    assert torch.get_num_threads() == 2


def test_default_is_one_thread(models):
    """docs/engine-speed.md#threads: one thread by default, applied even where the process had more."""
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(model="tiny-v41", num_pages=16), model=models("tiny-v41"))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("bad", [0, -3, 1.5, "2", True, None])
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
                 "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2


def test_serve_threads_flag_reaches_the_engine():
    from flashserve.server.cli import build_engine

    torch.set_num_threads(1)
    build_engine(build_parser().parse_args(["serve", "tiny-v41", "--kv-memory", "16MiB", "--threads", "2"]))
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
