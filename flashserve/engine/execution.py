"""The execution plan: how this engine's steps run, decided once at start-up and logged.

:func:`plan_execution` looks at the machine and the loaded model once: the device, whether decode steps are
compiled, the CPU's vector ISA, the weight format of every module, which of torch's int8 kernels pays on this
CPU (timed here, or given: ``int8_kernel``), whether each C++ weight kernel gives torch's products here
(:mod:`.kernel_check`: one that does not is refused, loudly, and torch's code runs), and it lays out again the
weights that the chosen path reads in another layout (column-major LM heads for eager one-row products, joined
int8 rows and panel copies for compiled CPU steps, block-FP8 codes in column panels for every CPU decode step).
On a CPU it builds the C++ kernels (or loads their cached build) before anything runs, so that no request waits
for a compiler. The engine logs :meth:`ExecutionPlan.describe` and keeps the plan as ``engine.plan``."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..model import cpu_kernels, modes, packed
from ..model.weight_layout import bf16_panels_for_decode, column_major_tall_weights, join_int8_rows, prepack_for_rows
from .engine_config import INT8_KERNELS
from .kernel_check import check_kernels

log = logging.getLogger("flashserve.engine")
FP8_PANELS = "FP8 codes in column panels"  # the relayout of packed.make_fp8_panels
_MODE_WORDS = {modes.EAGER: "eager", modes.COMPILED: "compiled", modes.COMPILED_CPU: "compiled (inductor's C++ kernels)"}

@dataclass
class ExecutionPlan:
    device: str  # "cpu" | "cuda"
    compiled: bool  # decode steps through torch.compile (False: eager)
    mode: modes.Mode  # the mode decode steps run in, which binds the model's per-mode implementations
    isa: str  # torch's CPU capability ("AVX512", "AVX2", ...); "" on a GPU
    formats: dict[str, int]  # weight format -> modules stored in it
    int8_aten: tuple[bool, bool]  # eager int8 products through torch's int8 kernel: at one row, at several rows
    int8_source: str  # "measured" | "given" | "no int8 weights"
    relayouts: dict[str, list[str]] = field(default_factory=dict)  # what was laid out again -> the weights
    relayout_bytes: dict[str, int] = field(default_factory=dict)  # what was laid out again -> their bytes
    kernels: list[str] = field(default_factory=list)  # C++ kernels loaded in this process and not refused
    refused: dict[str, str] = field(default_factory=dict)  # kernels that failed their check here -> how

    def finish(self) -> None:
        """Record the C++ kernels this process has loaded (call after the warm-up)."""
        self.kernels = cpu_kernels.built()

    def describe(self) -> str:
        formats = ", ".join(f"{n} {f}" for f, n in sorted(self.formats.items())) or "float"
        int8 = "torch's int8 kernel" if any(self.int8_aten) else "chunked float products"
        if self.int8_aten[0] != self.int8_aten[1]:
            int8 = f"torch's int8 kernel at {'one row' if self.int8_aten[0] else 'several rows'} only"
        lines = [f"execution plan: {self.device}{' ' + self.isa if self.isa else ''}, decode "
                 f"{_MODE_WORDS[self.mode]}; weights: {formats}"]
        if any(f.split()[0] in packed.INT8_ROWS for f in self.formats):
            lines.append(f"  eager int8 products: {int8} ({self.int8_source})")
        for what, names in self.relayouts.items():
            if names:
                lines.append(f"  {what}: {len(names)} weights, {self.relayout_bytes.get(what, 0) / 1e6:.1f} MB")
        lines.append(f"  C++ kernels: {', '.join(self.kernels) if self.kernels else 'none'}")
        if self.refused:
            lines.append(f"  C++ kernels refused (other products than torch's here; torch's code runs): "
                         f"{', '.join(self.refused)}")
        return "\n".join(lines)


def plan_execution(model, *, device: str, compiled: bool, rows: int, int8_kernel: str = "auto") -> ExecutionPlan:
    """Decide how ``model``'s steps run on ``device`` and lay out the weights that path reads; ``rows``: the most
    rows a decode step computes (sequences x verified tokens). ``int8_kernel``: "auto" times torch's int8
    kernel against chunked float products on this CPU (once a process), "aten" or "chunked" chooses."""
    if int8_kernel not in INT8_KERNELS:
        raise ValueError(f"int8_kernel must be one of {', '.join(INT8_KERNELS)}, got {int8_kernel!r}")
    formats = Counter(m.packed.fmt.name for m in model.modules() if isinstance(m, packed.PackedLinear))
    formats.update(f"{m.w1_packed.fmt.name} experts" for m in model.modules() if isinstance(m, packed.PackedExperts))
    formats.update(f"{m.fmt.name} experts (mapped)" for m in model.modules() if hasattr(m, "matrices"))
    int8_rows = any(f.split()[0] in packed.INT8_ROWS for f in formats)
    if int8_kernel == "auto":  # timed only where the model has int8 rows to multiply
        int8_aten = packed.int8pack_pays() if device == "cpu" and int8_rows else (False, False)
    else:
        int8_aten = (int8_kernel == "aten",) * 2
    packed.use_int8pack(*int8_aten)
    refused = {}
    if device == "cpu":
        cpu_kernels.build()  # logs its time; a machine without a compiler says so once and runs torch's code
        # each weight kernel against torch's products on this CPU: one that disagrees is refused (torch's code runs)
        refused = check_kernels(model) | cpu_kernels.refused()
    plan = ExecutionPlan(device=device, compiled=compiled, mode=modes.for_step(device, compiled),
                         isa=torch.backends.cpu.get_cpu_capability() if device == "cpu" else "",
                         formats=dict(formats), int8_aten=int8_aten, refused=refused,
                         kernels=cpu_kernels.built(),
                         int8_source=("given" if int8_kernel != "auto" else
                                      "measured" if int8_rows else "no int8 weights"))
    # under a weight budget (load_model(weight_memory=...)) the plan makes only the copies the budget holds
    # (loader.plan_copies): the bfloat16 panels of weights held as stored, and FP8 panels where the loader found room
    budget = getattr(model, "weight_budget", None)
    if not compiled:
        if device == "cpu":  # a bf16 head read as bf16: half the bytes of its float32 copy
            plan.relayouts["bfloat16 panels of bf16 weights"] = bf16_panels_for_decode(model,
                                                                                     held_only=budget is not None)
        # torch's one-row products over the LM head run ~2x faster column-major (not where panels serve them)
        plan.relayouts["column-major tall weights"] = column_major_tall_weights(model)
    elif device == "cpu":  # a compiled CPU step's own products want them row-major (blas)
        # a bf16 weight held as stored (loader.hold_as_stored) is read through bf16 panels at every row count
        plan.relayouts["bfloat16 panels of bf16 weights"] = bf16_panels_for_decode(model, held_only=True)
        plan.relayouts["int8 rows joined by input"] = join_int8_rows(model)
        if rows > 1 and budget is None:
            plan.relayouts["panel copies for several rows"] = prepack_for_rows(model)
    if device == "cpu":
        # block-FP8 decode rows, eager or compiled, read their codes in column panels: a copy of the codes
        plan.relayouts[FP8_PANELS] = (packed.make_fp8_panels(model) if budget is None or budget.fp8_panels
                                      else [])
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for what, names in plan.relayouts.items():  # the weights' own bytes: copied once (joins: moved, not added)
        plan.relayout_bytes[what] = sum(tensors[n].numel() * tensors[n].element_size() for n in names if n in tensors)
    return plan
