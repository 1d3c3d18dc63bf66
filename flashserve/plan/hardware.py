"""Hardware presets from ``hardware.json``: every number carries the source it came from.

A preset holds one GPU's datasheet figures plus the name of an efficiency profile: the fitted or measured
factors (fraction of peak bandwidth and FLOP/s reached, fixed per-layer and per-pass overheads) that turn
the roofline into a prediction. Each hardware type has exactly one profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import PlanError

HARDWARE_JSON = Path(__file__).with_name("hardware.json")
OPTIONAL_TERMS = ("eta_flop_prefill", "spec_step_overhead_us")  # profile terms that may be absent (see Efficiency)
FRACTIONS = ("eta_mem", "eta_flop", "eta_comm", "comm_overlap", "workspace_fraction", "eta_flop_prefill")


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
    name: str = ""
    fitted_on: tuple[str, ...] = ()

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

    def peak(self, dtype: str, order: tuple[str, ...]) -> float:
        """Dense peak for a GEMM in ``dtype``: the first of ``order`` this device has."""
        for d in order:
            if self.flops.get(d, 0.0) > 0:
                return self.flops[d]
        raise PlanError("--hardware", f"{self.name} lists no FLOP/s for {dtype}")


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


def load_catalog(path: Path = HARDWARE_JSON) -> dict[str, Hardware]:
    """Every preset in ``path``, validated."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError("hardware.json", f"cannot read {path}: {exc}") from None
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
    return out


def preset_names(path: Path = HARDWARE_JSON) -> list[str]:
    """The preset names in ``hardware.json``, in its order (unvalidated: for help texts)."""
    try:
        return list(json.loads(Path(path).read_text()).get("presets", {}))
    except (OSError, ValueError, AttributeError):
        return []


def hardware_name(name: str, names: list[str] | None = None) -> str:
    """The preset ``name`` means: itself, the same name in another case (``H200``), or the one preset it
    begins (``gb300`` -> ``gb300-nvl72``); an unknown name or a prefix of several is refused, listing them."""
    names = preset_names() if names is None else names
    if name in names:
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
    raise PlanError("--hardware", f"unknown hardware {name!r}; known: {', '.join(names)}")


def get_hardware(name: str, path: Path = HARDWARE_JSON) -> Hardware:
    """One preset by name (any case, or a unique prefix: :func:`hardware_name`); the error lists the known ones."""
    catalog = load_catalog(path)
    return catalog[hardware_name(name, list(catalog))]
