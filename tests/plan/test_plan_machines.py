"""Machines as owners describe them (``--hardware FILE.json``, the machine presets, ``--gpu-memory``-style flags):
the file read back as written, every malformed field refused by name before any work, the flags written over a
preset, every machine preset sourced, datacenter presets untouched, and each kind of machine planned as far as
its published figures allow (and no further)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashserve.plan.cli import main
from flashserve.plan.hardware import HARDWARE_JSON, get_hardware, load_catalog
from flashserve.plan.inputs import PlanInputs
from flashserve.plan.planner import plan

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]
MACHINE_PRESETS = ("rtx-3090", "rtx-4090", "rtx-5090", "rtx-pro-6000", "dgx-spark", "apple-m3-ultra", "strix-halo",
                   "epyc-ddr4-8ch", "epyc-ddr5-12ch", "dev-epyc-2core")
DATACENTER = ("gb300-nvl72", "gb200-nvl72", "b200", "h200", "h100", "h800", "cpu-local")
BOX = {  # two 24 GiB GPUs on PCIe 4.0 x16, 8 channels of DDR4-3200, an NVMe disk
    "name": "two-card-box",
    "gpu": {"model": "test card", "count": 2, "memory_gib": 24, "bandwidth_gbs": 936, "tflops": {"bf16": 71}},
    "host": {"memory_gib": 256, "channels": 8, "mts": 3200, "cpu_cores": 24, "expert_tflops": 1.5},
    "link": {"pcie_gen": 4, "lanes": 16},
    "disk": {"read_gbs": 7, "iops": 1000000},
}
TINY = ["--model", "tiny-v41", "--weight-dtype", "bf16"]


def _write(tmp_path: Path, data: object, name: str = "box.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_machine_file_round_trip(tmp_path, capsys) -> None:
    path = _write(tmp_path, BOX)
    d = _json(capsys, ["--hardware", path, *TINY, "--json"])
    m = d["machine"]
    assert (m["name"], m["kind"], m["unified"], m["origin"]) == ("two-card-box", "gpu", False, path)
    for section in ("gpu", "disk"):
        assert m[section] == {k: v for k, v in BOX[section].items()}, section
    assert {k: m["host"][k] for k in BOX["host"]} == BOX["host"]
    assert {k: m["link"][k] for k in BOX["link"]} == BOX["link"]
    # derived: 8 channels x 8 bytes x 3200 MT/s; 16 lanes x 16 GT/s x 128/130 / 8 bits
    assert m["host"]["bandwidth_gbs"] == pytest.approx(204.8)
    assert m["link"]["bandwidth_gbs"] == pytest.approx(16 * 16 * 128 / 130 / 8)
    assert set(m["derived"]) == {"host.bandwidth_gbs", "link.bandwidth_gbs"}
    assert m["sources"]["gpu.memory_gib"] == "given in box.json"
    assert d["gpus"] == 2 and d["hardware"] == "two-card-box"  # --gpus defaults to the machine's GPUs
    assert d["cost_per_million_output_tokens"] is None and d["tokens_per_s_per_agent"] > 0
    # the planner's per-GPU hardware: each card's memory and bandwidth, the host memory shared by the two cards
    hw = plan(PlanInputs(model="tiny-v41", hardware=path, gpus=2, weight_dtype="bf16")).deployment.hw
    assert hw.hbm_bytes == 24 * GIB and hw.hbm_bw == 936e9 and hw.flops == {"bf16": 71e12}
    assert hw.host_mem_bytes == 256 * GIB / 2 and hw.scaleup_domain == 2
    assert hw.host_link_bw == pytest.approx(16 * 16e9 * 128 / 130 / 8)


def test_numbers_with_their_sources_are_read_as_numbers(tmp_path, capsys) -> None:
    box = json.loads(json.dumps(BOX))
    box["gpu"]["memory_gib"] = {"value": 24, "source": "nvidia-smi on my machine"}
    d = _json(capsys, ["--hardware", _write(tmp_path, box), *TINY, "--json"])
    assert d["machine"]["gpu"]["memory_gib"] == 24
    assert d["machine"]["sources"]["gpu.memory_gib"] == "nvidia-smi on my machine"


def _bad(**changes: object) -> dict:
    """BOX with fields replaced (section.key=value; a value of None removes the field)."""
    box = json.loads(json.dumps(BOX))
    for path, value in changes.items():
        *sections, key = path.split("__")
        node = box
        for s in sections:
            node = node.setdefault(s, {})
        if value is None:
            node.pop(key, None)
        else:
            node[key] = value
    return box


@pytest.mark.parametrize("data,field,message", [
    (_bad(gpu__bandwith_gbs=936), "gpu.bandwith_gbs", "unknown field in gpu; known: model, count, memory_gib"),
    (_bad(colour="red"), "colour", "unknown field in the machine"),
    (_bad(gpu__tflops__int8=100), "gpu.tflops.int8", "unknown field in gpu.tflops; known: fp4, fp8, bf16, fp32"),
    (_bad(gpu__memory_gib="24"), "gpu.memory_gib", "must be a number, got '24'"),
    (_bad(gpu__memory_gib=True), "gpu.memory_gib", "must be a number, got True"),
    (_bad(gpu__count=1.5), "gpu.count", "must be a whole number, got 1.5"),
    (_bad(unified="yes"), "unified", "must be true or false, got 'yes'"),
    (_bad(gpu=[1, 2]), "gpu", "must be a JSON object, got list"),
    (_bad(gpu__memory_gib=-24), "gpu.memory_gib", "must be a positive number, got -24"),
    (_bad(host__mts=0), "host.mts", "must be a positive number, got 0"),
    (_bad(gpu__count=0), "gpu.count", "must be at least 1, got 0"),
    (_bad(gpu__bandwidth_gbs=None), "gpu.bandwidth_gbs", "missing: a discrete GPU needs it"),
    (_bad(gpu__memory_gib=None), "gpu.memory_gib", "missing: a discrete GPU needs it"),
    (_bad(link=None), "link", "missing: a discrete GPU reaches host memory over it"),
    (_bad(host__mts=None), "host.mts", "missing: host.channels and host.mts go together"),
    (_bad(link__lanes=None), "link.lanes", "missing: link.pcie_gen and link.lanes go together"),
    (_bad(host__bandwidth_gbs=200), "host.bandwidth_gbs", "give either host.bandwidth_gbs or host.channels"),
    (_bad(link__pcie_gen=7), "link.pcie_gen", "must be 1 to 5"),
    ({"host": {"memory_gib": 256}}, "host.bandwidth_gbs", "missing: a machine without a GPU computes from host"),
    ({"unified": True, "gpu": {"bandwidth_gbs": 800}, "host": {"bandwidth_gbs": 800}}, "gpu.bandwidth_gbs",
     "a unified machine's GPU reads the host memory"),
    ({"unified": True, "gpu": {"memory_gib": 300}, "host": {"memory_gib": 256, "bandwidth_gbs": 800}},
     "gpu.memory_gib", "300 GiB exceeds the 256 GiB"),
    ({}, "machine", "needs a 'gpu' or a 'host' section"),
    ([BOX], "machine", "must be a JSON object, got list"),
    (_bad(gpu__memory_gib={"value": 24, "sauce": "x"}), "gpu.memory_gib", "unknown field 'sauce'"),
    (_bad(efficiency="no-such-profile"), "efficiency", "unknown profile 'no-such-profile'"),
])
def test_each_malformed_field_is_refused_by_name(tmp_path, capsys, data, field, message) -> None:
    path = _write(tmp_path, data)
    assert main(["--hardware", path, *TINY]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"flashserve plan: error: --hardware {path}: {field}: {message}" in err or (
        field == "efficiency" and f"--hardware two-card-box: {field}: {message}" in err), err


def test_a_file_that_is_not_json_or_not_there(tmp_path, capsys) -> None:
    path = _write(tmp_path, '{"gpu": {"memory_gib": 24,}')
    assert main(["--hardware", path]) == 2
    assert f"--hardware {path}: not valid JSON" in capsys.readouterr().err
    missing = str(tmp_path / "absent.json")
    assert main(["--hardware", missing]) == 2
    assert f"--hardware {missing}: cannot read the machine file" in capsys.readouterr().err


def test_the_file_is_checked_before_any_work(tmp_path, capsys) -> None:
    """A bad file and a bad model: the file is named (the model is never resolved), and no sweep is written."""
    path = _write(tmp_path, _bad(gpu__memory_gib=-1))
    assert main(["sweep", "--hardware", path, "--model", "no-such-model", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "gpu.memory_gib: must be a positive number" in err and "--model" not in err
    assert not list(tmp_path.glob("s.*"))


FLAGS = ["--gpu-memory", "48", "--gpu-bandwidth", "2000", "--host-memory", "128", "--host-bandwidth", "100",
         "--disk-bandwidth", "14"]


def test_flags_override_a_preset(capsys) -> None:
    base = _json(capsys, ["--hardware", "rtx-5090", *TINY, "--host-memory", "64", "--json"])
    d = _json(capsys, ["--hardware", "rtx-5090", *TINY, *FLAGS, "--json"])
    m = d["machine"]
    assert (m["gpu"]["memory_gib"], m["gpu"]["bandwidth_gbs"]) == (48, 2000)
    assert (m["host"]["memory_gib"], m["host"]["bandwidth_gbs"], m["disk"]["read_gbs"]) == (128, 100, 14)
    assert m["sources"]["gpu.memory_gib"] == "--gpu-memory" and m["sources"]["disk.read_gbs"] == "--disk-bandwidth"
    assert base["machine"]["gpu"]["memory_gib"] != 48  # the preset's own value was replaced, not repeated
    assert d["sessions_fit"] > base["sessions_fit"]  # more GPU memory holds more sessions
    hw = get_hardware("rtx-5090", overrides={"gpu_memory": 48, "gpu_bandwidth": 2000})
    assert hw.hbm_bytes == 48 * GIB and hw.hbm_bw == 2000e9


def test_host_bandwidth_replaces_channels_and_flags_override_a_file(tmp_path, capsys) -> None:
    d = _json(capsys, ["--hardware", _write(tmp_path, BOX), *TINY, "--host-bandwidth", "150", "--gpu-memory", "32",
                       "--json"])
    host = d["machine"]["host"]
    assert host["bandwidth_gbs"] == 150 and "channels" not in host and "mts" not in host
    assert d["machine"]["gpu"]["memory_gib"] == 32 and "host.bandwidth_gbs" not in d["machine"]["derived"]


@pytest.mark.parametrize("argv,flag,message", [
    (["--hardware", "h200", "--host-memory", "512"], "--host-memory", "not the datacenter preset h200"),
    (["--hardware", "epyc-ddr5-12ch", "--gpu-memory", "24"], "--gpu-memory", "epyc-ddr5-12ch has no GPU"),
    (["--hardware", "dgx-spark", "--gpu-bandwidth", "500"], "--gpu-bandwidth", "dgx-spark is a unified machine"),
    (["--hardware", "rtx-5090", "--gpu-memory", "0"], "--gpu-memory", "must be a positive number"),
    (["--hardware", "rtx-5090", "--gpus", "2"], "--gpus", "rtx-5090 has 1 GPU; the deployment asks for 2"),
    (["--hardware", "epyc-ddr4-8ch"], "--host-memory", "epyc-ddr4-8ch gives no memory size"),
])
def test_machine_flags_refused_where_they_do_not_apply(argv, flag, message, capsys) -> None:
    assert main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: " in err and message in err and "Traceback" not in err


def test_fixed_scenarios_refuse_the_machine_flags(capsys) -> None:
    assert main(["seed", "--host-memory", "64"]) == 2
    assert "--host-memory" in capsys.readouterr().err


@pytest.mark.parametrize("name", MACHINE_PRESETS)
def test_every_machine_preset_loads_with_its_sources(name: str) -> None:
    hw = load_catalog()[name]
    m = hw.machine
    # a vendor's page, or for the machine the engine measured (dev-epyc-2core) the stored measurement
    assert m is not None and m.name == name and (m.source.startswith("https://") or (ROOT / m.source).is_file())
    numbers = [f"{section}.{key}" for section, fields in m.as_dict().items() if isinstance(fields, dict)
               and section in ("gpu", "host", "link", "disk") for key, value in fields.items()
               if isinstance(value, (int, float))]
    numbers += [f"gpu.tflops.{d}" for d in m.gpu_tflops]
    assert numbers and all(m.sources.get(path, "").strip() for path in numbers), m.sources
    assert all(why.strip() for why in m.not_published.values())
    assert hw.cost_per_gpu_hour == 0.0  # an owned machine has no rental price of its own


def test_machine_kinds_and_published_bandwidths() -> None:
    cat = load_catalog()
    kinds = {name: cat[name].machine.kind for name in MACHINE_PRESETS}
    assert {n for n, k in kinds.items() if k == "unified"} == {"dgx-spark", "apple-m3-ultra", "strix-halo"}
    assert {n for n, k in kinds.items() if k == "cpu"} == {"epyc-ddr4-8ch", "epyc-ddr5-12ch", "dev-epyc-2core"}
    # the machine the engine measured is the stored measurement, as the slice check reads it
    import json
    from pathlib import Path

    stored = json.loads((Path(__file__).parent / "data" / "slice_runs" / "machine.json").read_text())
    dev = cat["dev-epyc-2core"].machine
    assert (dev.host_bandwidth_gbs, dev.expert_gbs, dev.disk_read_gbs) == (
        stored["host"]["bandwidth_gbs"]["value"], stored["host"]["expert_gbs"]["value"],
        stored["disk"]["read_gbs"]["value"])
    # channels x MT/s reproduces the bandwidths the vendors publish: AMD's 204.8 GB/s per Milan socket and
    # 460.8 GB/s per Genoa socket, AMD's 256 GB/s for Strix Halo's 256-bit LPDDR5X-8000
    assert cat["epyc-ddr4-8ch"].hbm_bw == pytest.approx(204.8e9)
    assert cat["epyc-ddr5-12ch"].hbm_bw == pytest.approx(460.8e9)
    assert cat["strix-halo"].hbm_bw == pytest.approx(256e9)
    # what is not published is named, not filled in
    assert cat["apple-m3-ultra"].flops == {} and "gpu.tflops" in cat["apple-m3-ultra"].machine.not_published
    assert cat["epyc-ddr5-12ch"].machine.host_memory_gib is None


def test_datacenter_presets_untouched_by_the_machines(tmp_path) -> None:
    """The datacenter presets load to the same values with the machines and their profile removed."""
    data = json.loads(HARDWARE_JSON.read_text())
    del data["machines"]
    del data["efficiency"]["machine-prior"]
    bare = load_catalog(Path(_write(tmp_path, data, "hw.json")))
    full = load_catalog()
    assert set(bare) == set(DATACENTER)
    for name in DATACENTER:
        assert full[name] == bare[name] and full[name].machine is None and not full[name].unified


def test_a_model_too_big_for_the_gpu_does_not_fit(capsys) -> None:
    assert main(["--hardware", "rtx-5090", "--model", "deepseek-v41-flash", "--host-memory", "512"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("machine rtx-5090 (gpu, from hardware.json)")  # what was loaded, beside the refusal
    text = " ".join(err.split())
    assert "does not fit: the weights need" in text and "--resident-experts" in text
    assert "tokens/s" not in out


def test_the_fit_check_uses_the_gpu_memory(capsys) -> None:
    """The weights fit when the GPU memory less the workspace holds them, and not when it does not."""
    argv = ["--hardware", "rtx-pro-6000", "--model", "deepseek-v4-flash", "--json"]
    d = _json(capsys, argv + ["--allow-misfit"])
    cap = d["capacity"]
    weights, fraction = cap["weight_bytes_per_gpu"], cap["workspace_bytes_per_gpu"] / (96 * GIB)
    needed_gib = weights / (1 - fraction) / GIB
    assert d["fits"] is False and needed_gib > 96
    fits = _json(capsys, argv + ["--gpu-memory", f"{needed_gib * 1.01:.3f}"])
    assert fits["fits"] is True and fits["sessions_fit"] > 0
    assert main(argv + ["--gpu-memory", f"{needed_gib * 0.99:.3f}"]) == 1
    assert "does not fit: the weights need" in " ".join(capsys.readouterr().err.split())


def test_engram_tables_need_host_memory_on_a_gpu_machine(capsys) -> None:
    assert main(["--hardware", "rtx-5090", *TINY]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "the engram tables" in err and "rtx-5090 gives no host memory size: pass --host-memory GIB" in err
    d = _json(capsys, ["--hardware", "rtx-5090", *TINY, "--host-memory", "8", "--json"])
    assert d["fits"] is True and d["tokens_per_s_per_agent"] > 0
    assert any("engram rows read from host memory" in line for line in d["machine"]["planned"])


def test_without_published_flops_the_speed_is_not_predicted(capsys) -> None:
    assert main(["--hardware", "apple-m3-ultra", "--model", "deepseek-v4-flash", "--json"]) == 1
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert d["speed_predicted"] is False and d["fits"] is True and d["sessions_fit"] > 0
    assert "tokens_per_s_per_agent" not in d
    err = " ".join(err.split())
    assert "cannot predict speed" in err and "Apple publishes no FLOP/s for the M3 Ultra GPU" in err
    assert main(["sweep", "--hardware", "apple-m3-ultra", "--model", "deepseek-v4-flash", "--out", "/nonexistent/s"]) == 2
    assert "cannot predict speed" in capsys.readouterr().err


def test_a_unified_machine_with_flops_is_planned_and_counts_the_tables(tmp_path, capsys) -> None:
    box = {"unified": True, "gpu": {"tflops": {"fp8": 100, "bf16": 50}}, "host": {"memory_gib": 512, "bandwidth_gbs": 800}}
    d = _json(capsys, ["--hardware", _write(tmp_path, box), "--model", "deepseek-v4-flash", "--json"])
    assert d["gpus"] == 1 and d["tokens_per_s_per_agent"] > 0
    assert d["capacity"]["host_table_bytes_in_device"] == 0  # V4-Flash has no engram tables
    # V4.1-Flash: memory for the weights alone, not for the weights and the engram tables they share it with
    probe = _json(capsys, ["--hardware", _write(tmp_path, box), "--model", "deepseek-v41-flash", "--json",
                           "--allow-misfit"])
    cap = probe["capacity"]
    frac = cap["workspace_bytes_per_gpu"] / (512 * GIB)
    between = (cap["weight_bytes_per_gpu"] + cap["host_table_bytes"] / 2) / (1 - frac) / GIB
    assert main(["--hardware", _write(tmp_path, box), "--model", "deepseek-v41-flash", "--host-memory",
                 f"{between:.1f}"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "and the engram tables" in err and "share the unified memory" in err


def test_a_cpu_machine_plans_with_the_cpu_throughput_it_is_given(tmp_path, capsys) -> None:
    assert main(["--hardware", "epyc-ddr5-12ch", "--model", "deepseek-v4-flash", "--host-memory", "384"]) == 1
    out, err = capsys.readouterr()
    assert "machine epyc-ddr5-12ch (cpu" in out and "cannot predict speed" in err
    box = {"host": {"memory_gib": 384, "channels": 12, "mts": 4800, "expert_tflops": 2.0}}
    res = plan(PlanInputs(model="deepseek-v4-flash", hardware=_write(tmp_path, box), gpus=1))
    assert res.deployment.hw.flops == {"fp32": 2e12} and res.deployment.hw.hbm_bw == pytest.approx(460.8e9)
    assert res.tokens_per_s_per_agent > 0 and not res.misfit()


def test_explain_shows_the_machine_in_80_columns(capsys) -> None:
    assert main(["--hardware", "rtx-5090", *TINY, "--host-memory", "64", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[machine]" in lines and max(len(line) for line in lines) <= 80
    text = " ".join(lines)
    assert "nvidia-rtx-blackwell-gpu-architecture.pdf" in text.replace(" ", "") and "not priced" in text
