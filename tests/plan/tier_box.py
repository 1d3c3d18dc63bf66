"""A machine and fixed efficiency terms shared by the tier tests: every time they compute by hand reads these."""

from __future__ import annotations

import json
from pathlib import Path

from flashserve.plan.cli import main

MODEL = "deepseek-v4-flash"
FP4 = 0.5 + 1 / 32  # MXFP4: 4 bits and one scale byte per 32 weights
CTX = 4096
# a 24 GiB GPU at 1,000 GB/s whose FLOP/s never bind, 512 GiB of host memory at 200 GB/s, a 50 GB/s link, a
# 5 GB/s disk
BOX = {"name": "tier-box",
       "gpu": {"memory_gib": 24, "bandwidth_gbs": 1000, "tflops": {"fp4": 1e6, "fp8": 1e6, "bf16": 1e6}},
       "host": {"memory_gib": 512, "bandwidth_gbs": 200},
       "link": {"bandwidth_gbs": 50},
       "disk": {"read_gbs": 5}}
# efficiency terms fixed by flags so the hand computation needs nothing from the planner's profile
ETA_MEM, ETA_COMM, ETA_FLOP, LAYER_US = 0.8, 0.5, 0.5, 10.0
TERMS = ["--eta-mem", str(ETA_MEM), "--eta-comm", str(ETA_COMM), "--eta-flop", str(ETA_FLOP),
         "--layer-overhead-us", str(LAYER_US), "--pass-overhead-us", "0"]


def write_machine(tmp_path: Path, data: dict, name: str = "box.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def plan_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, argv: list[str]) -> str:
    """The flag a refused plan names (exit status 2, one line ``flashserve plan: error: FLAG: why``)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashserve plan: error: "), err
    return err.split(":")[2].strip()
