"""Hardware presets from ``hardware.json``: every number carries the source it came from.

A preset holds one GPU's datasheet figures plus the name of an efficiency profile: the fitted or measured
factors (fraction of peak bandwidth and FLOP/s reached, fixed per-layer and per-pass overheads) that turn
the roofline into a prediction. Each hardware type has exactly one profile.

Besides the datacenter ``presets``, ``hardware.json`` holds ``machines``: single boxes described as their
owners describe them (:mod:`flashserve.plan.machine`), as does a JSON file given to ``--hardware``. A machine
is planned with its weights in the memory of the device that computes (its GPUs, the unified memory, or the
host memory of a machine without a GPU), as ``cpu-local`` is: :func:`machine_hardware`; its routed experts may
be placed in host memory or on disk instead (:mod:`flashserve.plan.tiers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import PlanError
from .machine import GB, GIB, TERA, Machine, catalog_machine, read_machine_file

HARDWARE_JSON = Path(__file__).with_name("hardware.json")
MACHINE_PROFILE = "machine-prior"  # efficiency profile of a machine that names none
OPTIONAL_TERMS = ("eta_flop_prefill", "spec_step_overhead_us", "eta_host_mem")  # profile terms that may be absent (see Efficiency)
FRACTIONS = ("eta_mem", "eta_flop", "eta_comm", "comm_overlap", "workspace_fraction", "eta_flop_prefill",
             "eta_host_mem")


@dataclass(frozen=True)
class Efficiency:
    """Factors applied to the datasheet roofline (fractions are of peak; overheads in microseconds)."""

    eta_mem: float  # HBM bandwidth reached by weight/KV streaming
    eta_flop: float  # tensor-core peak reached by GEMMs and attention
    eta_comm: float  # link bandwidth reached by EP dispatch/combine and TP all-reduce
    layer_overhead_us: float  # launch + synchronisation per layer per forward, not hidden by overlap
    pass_overhead_us: float  # per forward pass: sampling, scheduling, head-side sync
    comm_overlap: float  # fraction of communication hidden behind compute (two-batch overlap)
    workspace_fraction: float  # HBM kept for activations, graphs and allocator slack
    eta_flop_prefill: float | None = None  # tensor-core peak reached by prefill (None: eta_flop)
    # fixed time of one speculative step beyond its layers (rejection sampling, draft/verify metadata, the
    # drafter's heads and the draft-to-verify hand-off): paid once per step whatever the batch; 0 = not known
    spec_step_overhead_us: float = 0.0
    # host memory bandwidth reached by CPU expert kernels reading routed experts beside a discrete GPU (None:
    # eta_mem); a machine term, absent from every datacenter profile
    eta_host_mem: float | None = None
    name: str = ""
    fitted_on: tuple[str, ...] = ()

    @property
    def host_mem_efficiency(self) -> float:
        return self.eta_mem if self.eta_host_mem is None else self.eta_host_mem

    @property
    def prefill_flop_efficiency(self) -> float:
        return self.eta_flop if self.eta_flop_prefill is None else self.eta_flop_prefill

    def with_overrides(self, **values: float | None) -> "Efficiency":
        """A copy with the given (non-None) terms replaced."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})


@dataclass(frozen=True)
class Hardware:
    """One GPU (or CPU) type, per device."""

    name: str
    description: str
    hbm_bytes: float
    hbm_usable_bytes: float
    hbm_bw: float  # bytes/s
    flops: dict[str, float]  # dense FLOP/s per dtype (fp4, fp8, bf16, fp32)
    scaleup_bw: float  # bytes/s per GPU per direction inside the scale-up (NVLink) domain
    scaleup_domain: int  # GPUs in one NVLink domain
    scaleout_bw: float  # bytes/s per GPU per direction across domains (RDMA NIC)
    host_mem_bytes: float  # host memory per GPU (engram tables)
    host_link_bw: float  # bytes/s per GPU per direction between host memory and the GPU
    cost_per_gpu_hour: float  # US$
    efficiency: Efficiency
    sources: dict[str, str] = field(default_factory=dict)
    unified: bool = False  # the engram tables share the device's memory with the weights
    machine: Machine | None = None  # the description a machine preset or file gave (None: datacenter preset)

    def peak(self, dtype: str, order: tuple[str, ...]) -> float:
        """Dense peak for a GEMM in ``dtype``: the first of ``order`` this device has."""
        for d in order:
            if self.flops.get(d, 0.0) > 0:
                return self.flops[d]
        raise PlanError("--hardware", f"{self.name} lists no FLOP/s for {dtype}"
                        + (f" (nor {', '.join(order[1:])})" if len(order) > 1 else ""))

    def has_peak(self, order: tuple[str, ...]) -> bool:
        return any(self.flops.get(d, 0.0) > 0 for d in order)


def _number(entry: Any, where: str, sources: dict[str, str]) -> float:
    """A ``{"value": x, "source": "..."}`` leaf; refuses numbers without a source."""
    if not isinstance(entry, dict) or "value" not in entry:
        raise PlanError(where, "must be an object with 'value' and 'source'")
    src = entry.get("source")
    if not isinstance(src, str) or not src.strip():
        raise PlanError(where, "has no 'source' string")
    value = entry["value"]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise PlanError(where, f"value must be a non-negative number, got {value!r}")
    sources[where] = src
    return float(value)


def _efficiency(name: str, raw: dict[str, Any], sources: dict[str, str]) -> Efficiency:
    vals: dict[str, float] = {}
    for f in fields(Efficiency):
        if f.name in ("name", "fitted_on") or (f.name in OPTIONAL_TERMS and f.name not in raw):
            continue
        if f.name not in raw:
            raise PlanError(f"efficiency.{name}.{f.name}", "missing")
        vals[f.name] = _number(raw[f.name], f"efficiency.{name}.{f.name}", sources)
    for key in FRACTIONS:
        if key not in vals:
            continue
        if not (0 < vals[key] <= 1 or (key == "comm_overlap" and vals[key] == 0)):
            raise PlanError(f"efficiency.{name}.{key}", f"must be a fraction in (0, 1], got {vals[key]}")
    return Efficiency(name=name, fitted_on=tuple(raw.get("fitted_on", ())), **vals)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError("hardware.json", f"cannot read {path}: {exc}") from None
    return data


def load_catalog(path: Path = HARDWARE_JSON) -> dict[str, Hardware]:
    """Every preset in ``path`` (datacenter presets, then machines), validated."""
    data = _read(path)
    profiles = data.get("efficiency", {})
    out: dict[str, Hardware] = {}
    for name, raw in data.get("presets", {}).items():
        src: dict[str, str] = {}
        prof = raw.get("efficiency")
        if prof not in profiles:
            raise PlanError(f"presets.{name}.efficiency", f"unknown profile {prof!r}")
        num = {k: _number(raw[k], f"presets.{name}.{k}", src) for k in (
            "hbm_bytes", "hbm_usable_bytes", "hbm_bw", "scaleup_bw", "scaleup_domain", "scaleout_bw",
            "host_mem_bytes", "host_link_bw", "cost_per_gpu_hour") if k in raw}
        missing = {"hbm_bytes", "hbm_bw", "scaleup_bw", "scaleup_domain", "cost_per_gpu_hour"} - set(num)
        if missing:
            raise PlanError(f"presets.{name}", f"missing {', '.join(sorted(missing))}")
        flops = {d: _number(v, f"presets.{name}.flops.{d}", src) for d, v in raw.get("flops", {}).items()}
        out[name] = Hardware(
            name=name, description=str(raw.get("description", "")), hbm_bytes=num["hbm_bytes"],
            hbm_usable_bytes=num.get("hbm_usable_bytes", num["hbm_bytes"]), hbm_bw=num["hbm_bw"], flops=flops,
            scaleup_bw=num["scaleup_bw"], scaleup_domain=int(num["scaleup_domain"]),
            scaleout_bw=num.get("scaleout_bw", 0.0), host_mem_bytes=num.get("host_mem_bytes", 0.0),
            host_link_bw=num.get("host_link_bw", 0.0),
            cost_per_gpu_hour=num["cost_per_gpu_hour"],
            efficiency=_efficiency(prof, profiles[prof], src), sources=src)
    for name, raw in data.get("machines", {}).items():
        if name in out:
            raise PlanError(f"machines.{name}", "has the name of a datacenter preset")
        out[name] = machine_hardware(catalog_machine(raw, name), profiles)
    return out


def machine_hardware(m: Machine, profiles: dict[str, Any] | None = None) -> Hardware:
    """A machine as the planner's per-device :class:`Hardware`, every weight in the memory of the device that
    computes: each discrete GPU (host memory shared among them, the link between GPU and host also carrying
    GPU-to-GPU traffic), the one GPU of a unified memory (its host memory too), or the CPU of a machine
    without a GPU. Not priced (``cost_per_gpu_hour`` 0: ``--cost-per-gpu-hour`` prices it); memory not given
    is 0 (the planner refuses to plan without it)."""
    profiles = _read(HARDWARE_JSON).get("efficiency", {}) if profiles is None else profiles
    prof = m.efficiency or MACHINE_PROFILE
    if prof not in profiles:
        raise PlanError(f"--hardware {m.name}: efficiency", f"unknown profile {prof!r}; known: {', '.join(profiles)}")
    src: dict[str, str] = {}
    eff = _efficiency(prof, profiles[prof], src)
    p, ms = f"presets.{m.name}.", m.sources
    mem = (m.device_memory_gib or 0.0) * GIB
    bw = (m.device_bandwidth_gbs or 0.0) * GB
    flops = {d: v * TERA for d, v in m.device_tflops.items()}
    mem_key = "gpu.memory_gib" if m.kind == "gpu" or m.gpu_memory_gib is not None else "host.memory_gib"
    bw_key = "gpu.bandwidth_gbs" if m.kind == "gpu" else "host.bandwidth_gbs"
    host = (m.host_memory_gib or 0.0) * GIB
    if m.kind == "gpu":
        link = (m.link_bandwidth_gbs or 0.0) * GB
        host_per_gpu, host_link, scaleup = host / m.devices, link, link
        link_src = ms.get("link.bandwidth_gbs", "")
        src[p + "scaleup_bw"] = f"GPU to GPU over the host link: {link_src}"
        src[p + "host_link_bw"] = link_src
    else:
        host_per_gpu, host_link, scaleup = host, bw, bw
        src[p + "scaleup_bw"] = "single device: no interconnect; set to the memory bandwidth"
        src[p + "host_link_bw"] = f"the same memory: {ms.get(bw_key, '')}"
    known = {"hbm_bytes": ms.get(mem_key), "hbm_usable_bytes": ms.get(mem_key), "hbm_bw": ms.get(bw_key),
             "host_mem_bytes": ms.get("host.memory_gib"),
             **{f"flops.{d}": ms.get("host.expert_tflops" if m.kind == "cpu" else f"gpu.tflops.{d}") for d in flops}}
    src.update({p + k: v for k, v in known.items() if v})
    src[p + "cost_per_gpu_hour"] = "none: a machine is not priced (--cost-per-gpu-hour prices it)"
    src.update({f"machines.{m.name}.{k}": v for k, v in ms.items()})
    return Hardware(
        name=m.name, description=m.description, hbm_bytes=mem, hbm_usable_bytes=mem, hbm_bw=bw, flops=flops,
        scaleup_bw=scaleup, scaleup_domain=m.devices, scaleout_bw=0.0, host_mem_bytes=host_per_gpu,
        host_link_bw=host_link, cost_per_gpu_hour=0.0, efficiency=eff, sources=src, unified=m.unified,
        machine=m)


def preset_names(path: Path = HARDWARE_JSON) -> list[str]:
    """The preset and machine names in ``hardware.json``, in its order (unvalidated: for help texts)."""
    try:
        data = json.loads(Path(path).read_text())
        return [*data.get("presets", {}), *data.get("machines", {})]
    except (OSError, ValueError, AttributeError):
        return []


def is_machine_file(name: str, names: list[str] | None = None) -> bool:
    """Whether ``--hardware name`` names a machine file rather than a preset: a path with a folder or a
    ``.json`` ending, or an existing file that no preset is called."""
    names = preset_names() if names is None else names
    if name in names:
        return False
    return "/" in name or "\\" in name or name.lower().endswith(".json") or Path(name).is_file()


def hardware_name(name: str, names: list[str] | None = None) -> str:
    """The preset ``name`` means: itself, the same name in another case (``H200``), or the one preset it
    begins (``gb300`` -> ``gb300-nvl72``); a machine file is returned as given; an unknown name or a prefix
    of several is refused, listing them."""
    names = preset_names() if names is None else names
    if name in names or is_machine_file(name, names):
        return name
    key = name.strip().lower()
    exact = [n for n in names if n.lower() == key]
    if exact:
        return exact[0]
    begun = [n for n in names if key and n.lower().startswith(key)]
    if len(begun) == 1:
        return begun[0]
    if begun:
        raise PlanError("--hardware", f"{name!r} could be any of {', '.join(begun)}; name one")
    raise PlanError("--hardware", f"unknown hardware {name!r}; known: {', '.join(names)}, or a machine JSON file")


def get_hardware(name: str, path: Path = HARDWARE_JSON, overrides: dict[str, float] | None = None) -> Hardware:
    """One preset by name (any case, or a unique prefix: :func:`hardware_name`; the error lists the known
    ones) or a machine file, with the machine flags (``--gpu-memory`` ...) written in; a datacenter preset
    takes none of them."""
    data = _read(path)
    profiles = data.get("efficiency", {})
    names = [*data.get("presets", {}), *data.get("machines", {})]
    if is_machine_file(name, names):
        return machine_hardware(read_machine_file(name, overrides), profiles)
    name = hardware_name(name, names)
    if name in data.get("machines", {}):
        return machine_hardware(catalog_machine(data["machines"][name], name, overrides), profiles)
    if overrides:
        flag = "--" + sorted(overrides)[0].replace("_", "-")
        raise PlanError(flag, f"describes a machine (a machine preset or a JSON file given to --hardware), not "
                        f"the datacenter preset {name}")
    return load_catalog(path)[name]
