"""Machines as their owners describe them: a small JSON file, or a preset under ``machines`` in
``hardware.json``, read and checked before the planner does any work.

A machine is one box: its GPUs (each one's memory in GiB, memory bandwidth in GB/s, dense TFLOP/s per dtype,
how many), its host (memory in GiB, bandwidth in GB/s or memory channels x MT/s, CPU cores, the CPU's
expert-kernel TFLOP/s), the link between GPU and host (PCIe generation and lanes, or GB/s), its disk (read
GB/s, IOPS) and whether GPU and CPU share one memory (``unified``). Every field is optional except what the
kind of machine needs (see :func:`parse_machine`); a figure nobody published is left out, and may be named
under ``not_published`` with the reason, which the planner repeats where it would have needed it.

A number is written bare (``"memory_gib": 32``) or with its source (``{"value": 32, "source": "..."}``);
presets in ``hardware.json`` must give the source. This module only reads and checks; turning a machine
into the planner's :class:`~flashserve.plan.hardware.Hardware` is :func:`flashserve.plan.hardware.machine_hardware`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import PlanError

GIB = float(2**30)
GB = 1e9
TERA = 1e12
TFLOPS_DTYPES = ("fp4", "fp8", "bf16", "fp32")
CHANNEL_BYTES = 8  # one 64-bit DDR channel moves 8 bytes per transfer
# PCIe per-lane signalling rate (GT/s) and line-code efficiency by generation (PCI-SIG base specifications:
# 8b/10b up to 2.0, 128b/130b from 3.0); bandwidth per direction = lanes x GT/s x efficiency / 8 bits
PCIE_GTS: dict[int, tuple[float, float]] = {1: (2.5, 8 / 10), 2: (5.0, 8 / 10), 3: (8.0, 128 / 130),
                                            4: (16.0, 128 / 130), 5: (32.0, 128 / 130)}

NUMBER, INTEGER, TEXT, FLAG, SECTION, REASONS = "number", "integer", "text", "flag", "section", "reasons"
SCHEMA: dict[str, dict[str, str]] = {
    "": {"name": TEXT, "description": TEXT, "source": TEXT, "unified": FLAG, "efficiency": TEXT,
         "gpu": SECTION, "host": SECTION, "link": SECTION, "disk": SECTION, "not_published": REASONS},
    "gpu": {"model": TEXT, "count": INTEGER, "memory_gib": NUMBER, "bandwidth_gbs": NUMBER, "tflops": SECTION},
    "gpu.tflops": {d: NUMBER for d in TFLOPS_DTYPES},
    "host": {"cpu": TEXT, "memory_gib": NUMBER, "bandwidth_gbs": NUMBER, "channels": INTEGER, "mts": NUMBER,
             "cpu_cores": INTEGER, "expert_tflops": NUMBER, "expert_gbs": NUMBER},
    "link": {"pcie_gen": INTEGER, "lanes": INTEGER, "bandwidth_gbs": NUMBER},
    "disk": {"read_gbs": NUMBER, "iops": NUMBER},
}

# ``--flag`` of PlanInputs.hardware_overrides -> the field it sets
OVERRIDE_FIELDS: dict[str, tuple[str, str]] = {
    "gpu_memory": ("gpu", "memory_gib"), "gpu_bandwidth": ("gpu", "bandwidth_gbs"),
    "host_memory": ("host", "memory_gib"), "host_bandwidth": ("host", "bandwidth_gbs"),
    "disk_bandwidth": ("disk", "read_gbs"),
}


def flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


@dataclass(frozen=True)
class Machine:
    """One machine, its fields in the units its description uses (GiB, GB/s, TFLOP/s, MT/s)."""

    name: str
    description: str = ""
    unified: bool = False
    gpu_model: str = ""
    gpu_count: int = 0  # 0: no GPU (the CPU computes)
    gpu_memory_gib: float | None = None
    gpu_bandwidth_gbs: float | None = None
    gpu_tflops: dict[str, float] = field(default_factory=dict)
    cpu: str = ""
    host_memory_gib: float | None = None
    host_bandwidth_gbs: float | None = None  # given, or channels x 8 B x MT/s
    host_channels: int | None = None
    host_mts: float | None = None
    cpu_cores: int | None = None
    expert_tflops: float | None = None
    expert_gbs: float | None = None  # measured read rate of the CPU's expert kernels over host memory
    pcie_gen: int | None = None
    pcie_lanes: int | None = None
    link_bandwidth_gbs: float | None = None  # given, or derived from the PCIe generation and lanes
    disk_read_gbs: float | None = None
    disk_iops: float | None = None
    efficiency: str | None = None  # efficiency profile in hardware.json (None: the default for machines)
    origin: str = ""  # where it was read: "hardware.json" or the file's path
    source: str = ""
    sources: dict[str, str] = field(default_factory=dict)  # field path -> where its value came from
    derived: tuple[str, ...] = ()  # field paths computed from others
    not_published: dict[str, str] = field(default_factory=dict)  # field path -> why it is left out

    @property
    def kind(self) -> str:
        """``gpu`` (discrete GPUs beside host memory), ``unified`` (one memory for GPU and CPU), ``cpu``."""
        if self.unified:
            return "unified"
        return "gpu" if self.gpu_count else "cpu"

    @property
    def devices(self) -> int:
        """Devices the planner places weights on: the GPUs, or the one CPU."""
        return self.gpu_count if self.kind == "gpu" else 1

    @property
    def device_memory_gib(self) -> float | None:
        """Memory holding the weights on one device (None: not given)."""
        if self.kind == "gpu":
            return self.gpu_memory_gib
        if self.kind == "unified" and self.gpu_memory_gib is not None:
            return self.gpu_memory_gib
        return self.host_memory_gib

    @property
    def device_bandwidth_gbs(self) -> float | None:
        return self.gpu_bandwidth_gbs if self.kind == "gpu" else self.host_bandwidth_gbs

    @property
    def device_tflops(self) -> dict[str, float]:
        """Dense TFLOP/s per dtype of the device that computes: the GPU's, or the CPU expert kernels' for every
        dtype (weights are widened to what the CPU computes in, as on ``cpu-local``)."""
        if self.kind == "cpu":
            return {"fp32": self.expert_tflops} if self.expert_tflops else {}
        return dict(self.gpu_tflops)

    def as_dict(self) -> dict[str, Any]:
        """The fields as given (and the derived ones, listed under ``derived``), in the file's layout."""
        def section(**values: Any) -> dict[str, Any]:
            return {k: v for k, v in values.items() if v not in (None, "", {})}

        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "unified": self.unified,
                               "description": self.description, "origin": self.origin}
        gpu = section(model=self.gpu_model, count=self.gpu_count or None, memory_gib=self.gpu_memory_gib,
                      bandwidth_gbs=self.gpu_bandwidth_gbs, tflops=dict(self.gpu_tflops))
        host = section(cpu=self.cpu, memory_gib=self.host_memory_gib, bandwidth_gbs=self.host_bandwidth_gbs,
                       channels=self.host_channels, mts=self.host_mts, cpu_cores=self.cpu_cores,
                       expert_tflops=self.expert_tflops, expert_gbs=self.expert_gbs)
        link = section(pcie_gen=self.pcie_gen, lanes=self.pcie_lanes, bandwidth_gbs=self.link_bandwidth_gbs)
        disk = section(read_gbs=self.disk_read_gbs, iops=self.disk_iops)
        for key, value in (("gpu", gpu), ("host", host), ("link", link), ("disk", disk)):
            if value:
                out[key] = value
        out.update(efficiency=self.efficiency, derived=list(self.derived), not_published=dict(self.not_published),
                   sources=dict(self.sources))
        return out


def _leaf(raw: Any, path: str, where: str, require_source: bool, sources: dict[str, str]) -> Any:
    """The value of a leaf written bare or as ``{"value": ..., "source": ...}``; records its source."""
    if isinstance(raw, dict) and ("value" in raw or "source" in raw):
        extra = set(raw) - {"value", "source"}
        if extra:
            raise PlanError(where + path, f"unknown field {sorted(extra)[0]!r} beside 'value' and 'source'")
        if "value" not in raw:
            raise PlanError(where + path, "has a 'source' but no 'value'")
        src = raw.get("source")
        if not isinstance(src, str) or not src.strip():
            raise PlanError(where + path, "has no 'source' string")
        sources[path] = src
        return raw["value"]
    if require_source:
        raise PlanError(where + path, "must be an object with 'value' and 'source'")
    return raw


def _check(kind: str, value: Any, path: str, where: str) -> Any:
    if kind == TEXT:
        if not isinstance(value, str):
            raise PlanError(where + path, f"must be a string, got {value!r}")
        return value
    if kind == FLAG:
        if not isinstance(value, bool):
            raise PlanError(where + path, f"must be true or false, got {value!r}")
        return value
    if kind == INTEGER:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(where + path, f"must be a whole number, got {value!r}")
        if value < 1:
            raise PlanError(where + path, f"must be at least 1, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise PlanError(where + path, f"must be a number, got {value!r}")
    if value <= 0 or math.isinf(value):
        raise PlanError(where + path, f"must be a positive number, got {value!r}")
    return float(value)


def _section(raw: Any, scope: str, where: str, require_source: bool, sources: dict[str, str]) -> dict[str, Any]:
    """One object of the description, every key known and every value of its type."""
    label = scope or "the machine"
    if not isinstance(raw, dict):
        raise PlanError(where + (scope or "machine"), f"must be a JSON object, got {type(raw).__name__}")
    fields_ = SCHEMA[scope]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{scope}.{key}" if scope else key
        if key not in fields_:
            raise PlanError(where + path, f"unknown field in {label}; known: {', '.join(fields_)}")
        kind = fields_[key]
        if kind == SECTION:
            out[key] = _section(value, path, where, require_source, sources)
        elif kind == REASONS:
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                raise PlanError(where + path, "must map field names to the reason each is left out")
            out[key] = dict(value)
        elif kind in (TEXT, FLAG) and not isinstance(value, dict):
            out[key] = _check(kind, value, path, where)
        else:
            out[key] = _check(kind, _leaf(value, path, where, require_source and kind in (NUMBER, INTEGER),
                                          sources), path, where)
    return out


def _pcie_gbs(gen: int, lanes: int, where: str) -> float:
    if gen not in PCIE_GTS:
        raise PlanError(where + "link.pcie_gen", f"must be 1 to {max(PCIE_GTS)} (for another link give "
                        f"link.bandwidth_gbs), got {gen}")
    if lanes > 32:
        raise PlanError(where + "link.lanes", f"must be 1 to 32, got {lanes}")
    rate, code = PCIE_GTS[gen]
    return lanes * rate * code / 8.0


def parse_machine(raw: Any, name: str, where: str = "", require_source: bool = False,
                  origin: str = "") -> Machine:
    """Check a machine description and read it. ``where`` prefixes every error's field (the file or the
    catalog key); ``require_source`` demands ``{"value", "source"}`` for every number (presets).

    Required: a ``gpu`` or a ``host`` section; a discrete GPU (``gpu`` without ``unified``) needs
    ``gpu.memory_gib``, ``gpu.bandwidth_gbs`` and a ``link``; a unified or GPU-less machine needs the host's
    bandwidth (``host.bandwidth_gbs``, or ``host.channels`` and ``host.mts``)."""
    sources: dict[str, str] = {}
    top = _section(raw, "", where, require_source, sources)
    gpu, host = top.get("gpu"), top.get("host")
    link, disk = top.get("link", {}), top.get("disk", {})
    unified = top.get("unified", False)
    if gpu is None and host is None:
        raise PlanError(where + "machine", "needs a 'gpu' or a 'host' section")
    gpu = gpu or {}
    host = host or {}
    derived: list[str] = []

    if host.get("channels") is not None or host.get("mts") is not None:
        if host.get("bandwidth_gbs") is not None:
            raise PlanError(where + "host.bandwidth_gbs", "give either host.bandwidth_gbs or host.channels with "
                            "host.mts, not both")
        for key in ("channels", "mts"):
            if host.get(key) is None:
                raise PlanError(where + f"host.{key}", "missing: host.channels and host.mts go together "
                                "(bandwidth = channels x 8 bytes x MT/s)")
        host["bandwidth_gbs"] = host["channels"] * CHANNEL_BYTES * host["mts"] * 1e6 / GB
        derived.append("host.bandwidth_gbs")
    if link.get("pcie_gen") is not None or link.get("lanes") is not None:
        if link.get("bandwidth_gbs") is not None:
            raise PlanError(where + "link.bandwidth_gbs", "give either link.bandwidth_gbs or link.pcie_gen with "
                            "link.lanes, not both")
        for key in ("pcie_gen", "lanes"):
            if link.get(key) is None:
                raise PlanError(where + f"link.{key}", "missing: link.pcie_gen and link.lanes go together")
        link["bandwidth_gbs"] = _pcie_gbs(link["pcie_gen"], link["lanes"], where)
        derived.append("link.bandwidth_gbs")

    if unified:
        if not host:
            raise PlanError(where + "host", "missing: a unified machine's memory is its host memory")
        if gpu.get("bandwidth_gbs") is not None:
            raise PlanError(where + "gpu.bandwidth_gbs", "a unified machine's GPU reads the host memory; give "
                            "host.bandwidth_gbs instead")
        if gpu.get("count", 1) != 1:
            raise PlanError(where + "gpu.count", f"a unified machine has one GPU, got {gpu['count']}")
        mem, total = gpu.get("memory_gib"), host.get("memory_gib")
        if mem is not None and total is not None and mem > total:
            raise PlanError(where + "gpu.memory_gib", f"{mem:g} GiB exceeds the {total:g} GiB the GPU shares "
                            "with the CPU (host.memory_gib)")
    elif top.get("gpu") is not None:
        for key, why in (("memory_gib", "its memory holds the weights"),
                         ("bandwidth_gbs", "it sets how fast the weights are read")):
            if gpu.get(key) is None:
                raise PlanError(where + f"gpu.{key}", f"missing: a discrete GPU needs it ({why})")
        if link.get("bandwidth_gbs") is None:
            raise PlanError(where + "link", "missing: a discrete GPU reaches host memory over it; give "
                            "link.pcie_gen and link.lanes, or link.bandwidth_gbs")
    if (unified or top.get("gpu") is None) and host.get("bandwidth_gbs") is None:
        what = "a unified machine" if unified else "a machine without a GPU"
        raise PlanError(where + "host.bandwidth_gbs", f"missing: {what} computes from host memory; give "
                        "host.bandwidth_gbs, or host.channels and host.mts")
    profile = top.get("efficiency")
    return Machine(
        name=top.get("name") or name, description=top.get("description", ""), unified=unified,
        gpu_model=gpu.get("model", ""), gpu_count=gpu.get("count", 1) if top.get("gpu") is not None else 0,
        gpu_memory_gib=gpu.get("memory_gib"), gpu_bandwidth_gbs=gpu.get("bandwidth_gbs"),
        gpu_tflops=dict(gpu.get("tflops", {})), cpu=host.get("cpu", ""), host_memory_gib=host.get("memory_gib"),
        host_bandwidth_gbs=host.get("bandwidth_gbs"), host_channels=host.get("channels"),
        host_mts=host.get("mts"), cpu_cores=host.get("cpu_cores"), expert_tflops=host.get("expert_tflops"),
        expert_gbs=host.get("expert_gbs"),
        pcie_gen=link.get("pcie_gen"), pcie_lanes=link.get("lanes"), link_bandwidth_gbs=link.get("bandwidth_gbs"),
        disk_read_gbs=disk.get("read_gbs"), disk_iops=disk.get("iops"), efficiency=profile, origin=origin,
        source=top.get("source", ""), sources=sources, derived=tuple(derived),
        not_published=dict(top.get("not_published", {})))


def with_overrides(raw: Any, overrides: dict[str, float], name: str, sourced: bool) -> Any:
    """A copy of a raw description with the ``--gpu-memory``-style flags written in (their source: the flag).
    ``--host-bandwidth`` replaces channels x MT/s. Flags the machine has no place for are refused."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # parse_machine names the problem
    out = copy.deepcopy(raw)
    for key, value in overrides.items():
        if key not in OVERRIDE_FIELDS:
            raise PlanError(flag_of(key), "is not a machine field")
        section, leaf = OVERRIDE_FIELDS[key]
        if section == "gpu" and "gpu" not in out and out.get("unified") is not True:
            raise PlanError(flag_of(key), f"{name} has no GPU (it computes on its CPU from host memory)")
        if key == "gpu_bandwidth" and out.get("unified") is True:
            raise PlanError(flag_of(key), f"{name} is a unified machine: its GPU reads the host memory; give "
                            "--host-bandwidth")
        part = out.setdefault(section, {})
        if not isinstance(part, dict):
            return out  # parse_machine names the problem
        if key == "host_bandwidth":
            part.pop("channels", None)
            part.pop("mts", None)
        part[leaf] = {"value": value, "source": flag_of(key)} if sourced else value
    return out


def read_machine_file(path: str | Path, overrides: dict[str, float] | None = None) -> Machine:
    """A machine from a JSON file, checked (errors name ``--hardware FILE: field``)."""
    path = Path(path)
    where = f"--hardware {path}: "
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"--hardware {path}", f"cannot read the machine file: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"--hardware {path}", f"not valid JSON: {exc}") from None
    raw = with_overrides(raw, overrides or {}, path.stem, sourced=False)
    machine = parse_machine(raw, path.stem, where, require_source=False, origin=str(path))
    sources = {p: f"given in {path.name}" for p in _paths(raw)}
    sources.update(machine.sources)
    for key in overrides or {}:
        section, leaf = OVERRIDE_FIELDS[key]
        sources[f"{section}.{leaf}"] = flag_of(key)
    return _with_sources(machine, sources)


def _paths(raw: Any, prefix: str = "") -> list[str]:
    """Field paths of the numbers in a raw description."""
    out: list[str] = []
    if isinstance(raw, dict):
        if "value" in raw and prefix:
            return [prefix]
        for k, v in raw.items():
            if k != "not_published":
                out += _paths(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        out.append(prefix)
    return out


def _with_sources(m: Machine, sources: dict[str, str]) -> Machine:
    for path in m.derived:
        sources.setdefault(path, _derivation(m, path))
    return replace(m, sources=sources)


def _derivation(m: Machine, path: str) -> str:
    if path == "host.bandwidth_gbs":
        return (f"derived: {m.host_channels} channels x {CHANNEL_BYTES} B x {m.host_mts:g} MT/s = "
                f"{m.host_bandwidth_gbs:g} GB/s")
    rate, code = PCIE_GTS[m.pcie_gen or 0]
    return (f"derived: PCIe {m.pcie_gen}.0 x{m.pcie_lanes}: {m.pcie_lanes} lanes x {rate:g} GT/s x "
            f"{'128/130' if code > 0.9 else '8/10'} line code / 8 = {m.link_bandwidth_gbs:.1f} GB/s per direction")


def catalog_machine(raw: Any, name: str, overrides: dict[str, float] | None = None) -> Machine:
    """A preset from ``hardware.json``'s ``machines`` (every number with its source), with the flags'
    values written in."""
    raw = with_overrides(raw, overrides or {}, name, sourced=True)
    m = parse_machine(raw, name, f"machines.{name}.", require_source=True, origin="hardware.json")
    return _with_sources(m, dict(m.sources))
