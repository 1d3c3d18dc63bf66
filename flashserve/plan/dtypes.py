"""Storage sizes of weight dtypes and which tensor-core peak a GEMM in that dtype runs at."""

from __future__ import annotations

from .errors import PlanError

# Bytes per weight, scales included: MXFP4 = 4 bits + one UE8M0 byte per 32 values; FP8 block scales
# (one byte per 32x32 block in V4.1, per 128x128 in V3) are under 0.1% and ignored.
# The 2- and 3-bit expert widths the local ports run (reference figures §7), named as their users name them:
#   q2_k    llama.cpp Q2_K: a 256-weight super-block is 64 bytes of 2-bit codes + 16 bytes of 4-bit
#           sub-block scales and mins + two fp16 (super-scale, super-min) = 84 bytes: 2.625 bits per weight
#   q3_k    llama.cpp Q3_K: 256 weights in 110 bytes (64 of low 2 bits, 32 of high bits, 12 of 6-bit scales,
#           one fp16): 3.4375 bits per weight
#   3.0bpw  a mix its report states as 3.0 bits per weight, scales included
#   iq2_xxs-q2_k  ds4's published V4.1 "Q2" file: gate and up projections in llama.cpp IQ2_XXS (256 weights in
#           66 bytes: 2.0625 bits), down in Q2_K: (2 x 2.0625 + 2.625) / 3 = 2.25 bits per weight over the three
#           equal-sized projections (142.4 GiB of V4.1-Flash's routed experts, as its model card states)
Q2_K_BPW = 84 * 8 / 256  # 2.625
Q3_K_BPW = 110 * 8 / 256  # 3.4375
IQ2_XXS_BPW = 66 * 8 / 256  # 2.0625
DS4_Q2_BPW = (2 * IQ2_XXS_BPW + Q2_K_BPW) / 3  # 2.25
WEIGHT_BYTES: dict[str, float] = {"fp4": 0.5 + 1 / 32, "fp8": 1.0, "bf16": 2.0, "fp32": 4.0,
                                  "q2_k": Q2_K_BPW / 8, "q3_k": Q3_K_BPW / 8, "3.0bpw": 3.0 / 8,
                                  "iq2_xxs-q2_k": DS4_Q2_BPW / 8}
# expert widths below one byte that the checkpoint does not ship: dense weights stay FP8 beside them
SUB_BYTE_EXPERTS = ("fp4", "q2_k", "q3_k", "3.0bpw", "iq2_xxs-q2_k")

# A GEMM with weights in dtype X runs at the peak named here; the hardware falls back to the next entry when
# it lacks the first (Hopper has no FP4 tensor cores: W4A8 runs at the FP8 rate).
PEAK_ORDER: dict[str, tuple[str, ...]] = {
    "fp4": ("fp4", "fp8", "bf16", "fp32"),
    "fp8": ("fp8", "bf16", "fp32"),
    "bf16": ("bf16", "fp32"),
    "fp32": ("fp32",),
    # 2- and 3-bit weights are widened before the multiply (llama.cpp's K-quant kernels multiply them as 8-bit
    # integers); the planner lists no int8 peak, so they run at the FP8 rate, else BF16
    "q2_k": ("fp8", "bf16", "fp32"),
    "q3_k": ("fp8", "bf16", "fp32"),
    "3.0bpw": ("fp8", "bf16", "fp32"),
    "iq2_xxs-q2_k": ("fp8", "bf16", "fp32"),
}

KV_DTYPES = ("fp4", "fp8", "bf16")
HEAD_DTYPES = ("fp8", "bf16", "fp32")  # the LM head and embeddings (released V4/V4.1: bf16)


def weight_bytes(dtype: str, field: str = "--weight-dtype") -> float:
    """Bytes per parameter stored in ``dtype``."""
    try:
        return WEIGHT_BYTES[dtype]
    except KeyError:
        raise PlanError(field, f"unknown dtype {dtype!r}; choose one of {', '.join(WEIGHT_BYTES)}") from None


def dense_dtype_for(expert_dtype: str) -> str:
    """Non-expert weights stay FP8 when experts are FP4 (the released V4/V4.1 and NVIDIA's R1-FP4 layout) or
    one of the 2- and 3-bit expert widths (quantization per part: only the routed experts are requantized)."""
    return "fp8" if expert_dtype in SUB_BYTE_EXPERTS else expert_dtype
