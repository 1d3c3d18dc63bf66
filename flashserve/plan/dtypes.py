"""Storage sizes of weight dtypes and which tensor-core peak a GEMM in that dtype runs at."""

from __future__ import annotations

from .errors import PlanError

# Bytes per weight, scales included: MXFP4 = 4 bits + one UE8M0 byte per 32 values; FP8 block scales
# (one byte per 32x32 block in V4.1, per 128x128 in V3) are under 0.1% and ignored.
WEIGHT_BYTES: dict[str, float] = {"fp4": 0.5 + 1 / 32, "fp8": 1.0, "bf16": 2.0, "fp32": 4.0}

# A GEMM with weights in dtype X runs at the peak named here; the hardware falls back to the next entry when
# it lacks the first (Hopper has no FP4 tensor cores: W4A8 runs at the FP8 rate).
PEAK_ORDER: dict[str, tuple[str, ...]] = {
    "fp4": ("fp4", "fp8", "bf16", "fp32"),
    "fp8": ("fp8", "bf16", "fp32"),
    "bf16": ("bf16", "fp32"),
    "fp32": ("fp32",),
}

KV_DTYPES = ("fp4", "fp8", "bf16")


def weight_bytes(dtype: str, field: str = "--weight-dtype") -> float:
    """Bytes per parameter stored in ``dtype``."""
    try:
        return WEIGHT_BYTES[dtype]
    except KeyError:
        raise PlanError(field, f"unknown dtype {dtype!r}; choose one of {', '.join(WEIGHT_BYTES)}") from None


def dense_dtype_for(expert_dtype: str) -> str:
    """Non-expert weights stay FP8 when experts are FP4 (the released V4/V4.1 and NVIDIA's R1-FP4 layout)."""
    return "fp8" if expert_dtype == "fp4" else expert_dtype
