"""``--hardware`` as people write it: any case (``GB300``, ``H200``) or a prefix naming one preset (``gb300``);
a prefix of several is refused with the candidates. Run as a user runs the command (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--model", "deepseek-v41-flash", "--gpus", "8", "--concurrency", "16", "--json", "--allow-misfit"]


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashserve", "plan", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("written,preset", [("GB300", "gb300-nvl72"), ("gb300", "gb300-nvl72"), ("H200", "h200"),
                                            ("Cpu", "cpu-local")])
def test_hardware_in_any_case_or_a_unique_prefix(written, preset):
    given, exact = _plan("--hardware", written, *BASE), _plan("--hardware", preset, *BASE)
    assert given.returncode == 0, given.stderr
    got, want = json.loads(given.stdout), json.loads(exact.stdout)
    assert got["hardware"] == preset and got == want  # the same plan as the preset's own name gives


def test_a_prefix_of_several_presets_is_refused_with_them():
    p = _plan("--hardware", "gb", *BASE)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "flashserve plan: error: --hardware: 'gb' could be any of" in p.stderr
    assert "gb300-nvl72" in p.stderr and "gb200-nvl72" in p.stderr
    unknown = _plan("--hardware", "tpu-v9", *BASE)
    assert unknown.returncode == 2 and "unknown hardware 'tpu-v9'; known: " in unknown.stderr


def test_verdict_takes_the_short_name_as_its_default_hardware():
    short, full = _plan("verdict", "--hardware", "GB300", "--json"), _plan("verdict", "--json")
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout) == json.loads(full.stdout)
