"""Hardware presets: all required entries, a source for every number, bad files refused."""

from __future__ import annotations

import json

import pytest

from flashserve.plan.errors import PlanError
from flashserve.plan.hardware import HARDWARE_JSON, get_hardware, load_catalog


def _numbers_without_source(node: object, path: str = "") -> list[str]:
    bad = []
    if isinstance(node, dict):
        if "value" in node:
            if not str(node.get("source", "")).strip():
                bad.append(path)
            return bad
        for k, v in node.items():
            bad += _numbers_without_source(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            bad += _numbers_without_source(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        bad.append(path)  # a bare number with no source
    return bad


def test_presets_present() -> None:
    assert {"gb300-nvl72", "gb200-nvl72", "b200", "h200", "h100", "h800", "cpu-local"} <= set(load_catalog())


def test_every_number_has_a_source() -> None:
    assert _numbers_without_source(json.loads(HARDWARE_JSON.read_text())) == []


def test_one_profile_per_hardware_type() -> None:
    cat = load_catalog()
    assert cat["h100"].efficiency == cat["h800"].efficiency == cat["h200"].efficiency
    assert cat["gb300-nvl72"].efficiency.name != cat["b200"].efficiency.name
    assert cat["cpu-local"].hbm_bw == pytest.approx(15e9)  # measured here


def test_number_without_source_is_refused(tmp_path) -> None:
    data = json.loads(HARDWARE_JSON.read_text())
    data["presets"]["h100"]["hbm_bw"] = {"value": 3.35e12, "source": ""}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="presets.h100.hbm_bw"):
        load_catalog(path)


def test_unknown_hardware_names_the_known_ones() -> None:
    with pytest.raises(PlanError, match="--hardware.*gb300-nvl72"):
        get_hardware("tpu-v9")
