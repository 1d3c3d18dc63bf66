"""What ``flashserve --help``, each command's ``--help`` and ``flashserve info`` print, run as a user runs them
(a subprocess): every default shown once, no developer docstring, units spelled out, errors prefixed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "COLUMNS": "1000"}  # no wrapping: each help text on one line


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashserve", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=120)


def _help_blocks(text: str) -> dict[str, str]:
    """Each option's help text, joined over its wrapped lines: '--port' -> 'TCP port (default: 8000)'."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)(.*)$", line)
        if m:
            current = m.group(1)
            # the invocation (flags, metavar) and, after two spaces, the start of the help
            parts = re.split(r"\s{2,}", m.group(2).strip(), maxsplit=1)
            blocks[current] = parts[1] if len(parts) > 1 else ""
        elif current and line.startswith("   ") and line.strip():
            blocks[current] = (blocks[current] + " " + line.strip()).strip()
        elif not line.strip() or not line.startswith(" "):
            current = None
    return blocks


COMMANDS = [["serve"], ["generate"], ["bench", "serve"], ["bench", "sweep"], ["plan"], ["info"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_each_default_is_said_once(command):
    p = _run(*command, "--help")
    assert p.returncode == 0, p.stderr
    assert "(default: None)" not in p.stdout and "(default: ())" not in p.stdout
    blocks = _help_blocks(p.stdout)
    assert len(blocks) > 5
    for flag, text in blocks.items():
        assert text.count("(default") <= 1, (flag, text)
        appended = re.search(r"\(default: [^()]*\)$", text)
        if appended:  # a "(default: X)" at the end: the text before it must not already say a default
            before = text[:appended.start()].replace("flashserve-default", "")
            assert not re.search(r"\bdefault\b", before, re.I), (flag, text)


def test_serve_help_shows_values_and_says_the_models_own_once():
    blocks = _help_blocks(_run("serve", "--help").stdout)
    assert blocks["--port"].endswith("(default: 8000)")
    assert blocks["--tokenizer"].count("default") == 1 and "the model's own" in blocks["--tokenizer"]


def test_plan_help_lists_hardware_and_defaults():
    catalog = json.loads((ROOT / "flashserve/plan/hardware.json").read_text())["presets"]
    blocks = _help_blocks(_run("plan", "--help").stdout)
    for name in catalog:
        assert name in blocks["--hardware"], name
    assert blocks["--hardware"].endswith("(default: gb300-nvl72)")
    assert blocks["--model"].endswith("(default: deepseek-v41-flash)")
    for flag, value in (("--gpus", "8"), ("--tp", "1"), ("--weight-dtype", "fp4"), ("--concurrency", "1"),
                        ("--prompt-len", "1024"), ("--output-len", "1024")):
        assert blocks[flag].endswith(f"(default: {value})"), (flag, blocks[flag])


def test_top_level_help_is_for_users():
    p = _run("--help")
    assert p.returncode == 0
    assert "``" not in p.stdout and "registers" not in p.stdout
    for command in ("info", "generate", "serve", "plan", "bench", "train"):
        assert re.search(rf"^    {command}\s", p.stdout, re.M), command
    assert "flashserve COMMAND --help" in p.stdout


def test_info_says_params_and_bytes():
    data = json.loads(_run("info", "deepseek-v41-flash", "--json").stdout)
    p = _run("info", "deepseek-v41-flash")
    assert p.returncode == 0, p.stderr
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"│\s*(\w+)\s*│([^│]*)│", p.stdout)}
    assert rows["params_total"] == f"{data['params_total'] / 1e9:.3f} billion params"
    assert rows["params_all"] == f"{data['params_all'] / 1e9:.3f} billion params"
    assert rows["kv_bytes_per_token"] == f"{data['kv_bytes_per_token']:.2f} bytes"
    assert rows["norm"] == f"{data['params_by_part']['norm']:,} params"  # small counts in full, not "0.000 B"
    assert not re.search(r"\d B\b", p.stdout)  # no bare "B" that could be billions or bytes
    said = " ".join(p.stdout.split())
    assert "params_total: the backbone" in said and "params_all: those too" in said


def test_info_of_an_unknown_model_is_prefixed_like_every_command():
    p = _run("info", "tiny-v42")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("flashserve info: error: 'tiny-v42' is neither a preset") and "Traceback" not in p.stderr
