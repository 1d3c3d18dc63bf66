"""The planner's inputs, checked: every refusal names the flag it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config.sizes import parse_size
from .dtypes import HEAD_DTYPES, KV_DTYPES, WEIGHT_BYTES
from .errors import PlanError
from .machine import OVERRIDE_FIELDS, flag_of
from .tiers import ENGRAM_TABLES, EXPERT_CACHE, HOST_COMPUTE, TIER_OVERLAP


@dataclass(frozen=True)
class PlanInputs:
    """One deployment and workload. ``None`` means "derive a default" (see :meth:`resolved`)."""

    model: str = "deepseek-v41-flash"
    hardware: str = "gb300-nvl72"
    gpus: int = 8  # decode GPUs (the whole deployment when prefill is co-located)
    tp: int = 1  # attention tensor parallelism
    ep: int | None = None  # expert parallelism (default: all decode GPUs)
    attention_dp: int | None = None  # attention data-parallel ranks (default: gpus / tp)
    prefill_gpus: int = 0  # disaggregated prefill pool; 0 = prefill shares the decode GPUs
    prefill_tp: int | None = None  # the pool's attention TP (default 1, as --tp); needs prefill_gpus > 0
    prefill_ep: int | None = None  # the pool's expert parallelism (default: all prefill GPUs)
    prefill_attention_dp: int | None = None  # the pool's attention DP ranks (default: prefill_gpus / prefill_tp)
    weight_dtype: str = "fp4"  # routed experts; dense weights FP8 unless bf16/fp32 is asked
    kv_dtype: str | None = None  # default: the model's native cache format
    concurrency: int = 1  # sequences decoding at once across the decode GPUs
    context: int | None = None  # mean KV length while decoding (default prompt + output/2)
    prompt_len: int = 1024
    output_len: int = 1024
    accept_length: float = 1.0  # mean tokens accepted per verification step, bonus token included
    draft_tokens: int | None = None  # drafted tokens verified per step (default from the drafter)
    prefix_hit_rate: float = 0.0  # fraction of prompt tokens served from the prefix cache
    cost_per_gpu_hour: float | None = None  # default: the hardware preset's price
    overrides: dict[str, float] = field(default_factory=dict)  # efficiency terms to replace
    stack: str | None = None  # serving-stack profile over the hardware's; None: the default, "none": off
    # machine fields set by flags (gpu_memory, gpu_bandwidth, host_memory, host_bandwidth, disk_bandwidth:
    # GiB and GB/s, see machine.OVERRIDE_FIELDS); only a machine preset or file takes them
    hardware_overrides: dict[str, float] = field(default_factory=dict)
    # routed experts per MoE layer by tier on a machine (flashserve.plan.tiers); None, None: all on the device
    resident_experts: int | None = None  # in the memory of the device that computes
    host_experts: int | None = None  # in host memory beside a discrete GPU
    host_expert_compute: str | None = None  # "cpu" (default: CPU expert kernels) or "gpu" (over the link)
    expert_hit_rate: float | None = None  # measured share of selected experts found resident (None: uniform)
    tier_overlap: str | None = None  # "summed" (default) or "overlapped": how the tiers' times combine
    expert_cache: str | None = None  # "static" (default: a fixed set), "lru" or "lfu" (resident = a cache)
    # the engine's own placement options (flashserve serve --gpu-experts / --weight-memory), instead of the counts
    gpu_experts: int | None = None  # routed experts per layer on the GPU of a discrete-GPU machine, the rest on the CPU
    weight_memory: str | int | None = None  # resident budget for the weights of a machine without a discrete GPU
    routing_skew: float | None = None  # Zipf exponent of expert popularity (None: the model's; 0: uniform)
    prefill_chunk: int = 512  # prompt tokens per prefill step where experts are off the device (llama.cpp -ub)
    engram_tables: str | None = None  # "memory" (default: host or unified memory) or "disk" (rows read from disk)
    memory_bound_only: bool = False  # a device without published FLOP/s: time the step without its compute
    head_dtype: str | None = None  # the LM head and embeddings' storage (None: the dense weights' dtype)

    def resolved_context(self) -> float:
        return float(self.context) if self.context is not None else self.prompt_len + self.output_len / 2

    def resolved_ep(self) -> int:
        return self.ep if self.ep is not None else self.gpus

    def resolved_dp(self) -> int:
        return self.attention_dp if self.attention_dp is not None else self.gpus // self.tp

    def resolved_prefill_tp(self) -> int:
        return self.prefill_tp if self.prefill_tp is not None else 1

    def resolved_prefill_ep(self) -> int:
        return self.prefill_ep if self.prefill_ep is not None else self.prefill_gpus

    def resolved_prefill_dp(self) -> int:
        if self.prefill_attention_dp is not None:
            return self.prefill_attention_dp
        return self.prefill_gpus // self.resolved_prefill_tp()

    def resolved_draft_tokens(self, block: int) -> int:
        if self.draft_tokens is not None:
            return self.draft_tokens
        if self.accept_length <= 1.0:
            return 0
        return max(block, math.ceil(self.accept_length - 1.0 - 1e-9))


def _positive_int(value: object, flag: str, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanError(flag, f"must be an integer >= {minimum}, got {value!r}")


def _number(value: object, flag: str, low: float, high: float = math.inf) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low <= value <= high) or math.isnan(value):
        bound = f"between {low} and {high}" if high != math.inf else f">= {low}"
        raise PlanError(flag, f"must be a number {bound}, got {value!r}")


def _validate_prefill_layout(inp: PlanInputs) -> None:
    """The separate prefill pool's layout, checked as the decode one is against --gpus."""
    given = [(flag, v) for flag, v in (("--prefill-tp", inp.prefill_tp), ("--prefill-ep", inp.prefill_ep),
                                       ("--prefill-attention-dp", inp.prefill_attention_dp)) if v is not None]
    if not inp.prefill_gpus:
        if given:
            raise PlanError(given[0][0], "needs --prefill-gpus > 0 (with 0, prefill shares the decode GPUs "
                            "and their layout)")
        return
    n, tp = inp.prefill_gpus, inp.resolved_prefill_tp()
    _positive_int(tp, "--prefill-tp")
    if n % tp:
        raise PlanError("--prefill-tp", f"TP {tp} does not divide --prefill-gpus {n}")
    if inp.prefill_ep is not None:
        _positive_int(inp.prefill_ep, "--prefill-ep")
        if n % inp.prefill_ep:
            raise PlanError("--prefill-ep", f"EP {inp.prefill_ep} does not divide --prefill-gpus {n}")
    if inp.prefill_attention_dp is not None:
        _positive_int(inp.prefill_attention_dp, "--prefill-attention-dp")
        if inp.prefill_attention_dp * tp != n:
            raise PlanError("--prefill-attention-dp", f"attention DP {inp.prefill_attention_dp} × TP {tp} must "
                            f"equal --prefill-gpus {n}")


def validate(inp: PlanInputs) -> None:
    """Refuse impossible or meaningless inputs before any arithmetic."""
    _positive_int(inp.gpus, "--gpus")
    _positive_int(inp.tp, "--tp")
    if inp.gpus % inp.tp:
        raise PlanError("--tp", f"TP {inp.tp} does not divide --gpus {inp.gpus}")
    if inp.ep is not None:
        _positive_int(inp.ep, "--ep")
        if inp.gpus % inp.ep:
            raise PlanError("--ep", f"EP {inp.ep} does not divide --gpus {inp.gpus}")
    if inp.attention_dp is not None:
        _positive_int(inp.attention_dp, "--attention-dp")
        if inp.attention_dp * inp.tp != inp.gpus:
            raise PlanError("--attention-dp", f"attention DP {inp.attention_dp} × TP {inp.tp} must equal --gpus {inp.gpus}")
    _positive_int(inp.prefill_gpus, "--prefill-gpus", 0)
    _validate_prefill_layout(inp)
    if inp.weight_dtype not in WEIGHT_BYTES:
        raise PlanError("--weight-dtype", f"unknown dtype {inp.weight_dtype!r}; choose one of {', '.join(WEIGHT_BYTES)}")
    if inp.kv_dtype is not None and inp.kv_dtype not in KV_DTYPES:
        raise PlanError("--kv-dtype", f"unknown KV dtype {inp.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    _positive_int(inp.concurrency, "--concurrency")
    if inp.context is not None:
        _positive_int(inp.context, "--context")
    _positive_int(inp.prompt_len, "--prompt-len")
    _positive_int(inp.output_len, "--output-len")
    _number(inp.accept_length, "--accept-length", 1.0)
    if inp.draft_tokens is not None:
        _positive_int(inp.draft_tokens, "--draft-tokens", 0)
        if inp.accept_length > inp.draft_tokens + 1:
            raise PlanError("--accept-length", f"{inp.accept_length} exceeds draft tokens + 1 = {inp.draft_tokens + 1}")
    _number(inp.prefix_hit_rate, "--prefix-hit-rate", 0.0, 1.0)
    if inp.cost_per_gpu_hour is not None:
        _number(inp.cost_per_gpu_hour, "--cost-per-gpu-hour", 0.0)
    for flag, count in (("--resident-experts", inp.resident_experts), ("--host-experts", inp.host_experts)):
        if count is not None:
            _positive_int(count, flag, 0)
    if inp.host_expert_compute is not None and inp.host_expert_compute not in HOST_COMPUTE:
        raise PlanError("--host-expert-compute", f"unknown {inp.host_expert_compute!r}; choose one of "
                        f"{', '.join(HOST_COMPUTE)}")
    _positive_int(inp.prefill_chunk, "--prefill-chunk")
    if inp.head_dtype is not None and inp.head_dtype not in HEAD_DTYPES:
        raise PlanError("--head-dtype", f"unknown dtype {inp.head_dtype!r}; choose one of {', '.join(HEAD_DTYPES)}")
    if inp.expert_hit_rate is not None:
        _number(inp.expert_hit_rate, "--expert-hit-rate", 0.0, 1.0)
    if inp.engram_tables is not None and inp.engram_tables not in ENGRAM_TABLES:
        raise PlanError("--engram-tables", f"unknown {inp.engram_tables!r}; choose one of {', '.join(ENGRAM_TABLES)}")
    if inp.routing_skew is not None:
        _number(inp.routing_skew, "--routing-skew", 0.0, 4.0)
    if inp.gpu_experts is not None:
        _positive_int(inp.gpu_experts, "--gpu-experts")
    if inp.weight_memory is not None:
        try:
            parse_size(inp.weight_memory)
        except ValueError as e:
            raise PlanError("--weight-memory", str(e)) from None
    placing = [flag for flag, value in (("--gpu-experts", inp.gpu_experts), ("--weight-memory", inp.weight_memory),
                                        ("--resident-experts", inp.resident_experts),
                                        ("--host-experts", inp.host_experts)) if value is not None]
    if placing[:1] in (["--gpu-experts"], ["--weight-memory"]) and len(placing) > 1:  # counts combine, these do not
        raise PlanError(placing[0], f"places the experts as the engine's option does; {placing[1]} places them too: "
                        "give one of them")
    if inp.expert_cache is not None and inp.expert_cache not in EXPERT_CACHE:
        raise PlanError("--expert-cache", f"unknown {inp.expert_cache!r}; choose one of {', '.join(EXPERT_CACHE)}")
    if inp.tier_overlap is not None and inp.tier_overlap not in TIER_OVERLAP:
        raise PlanError("--tier-overlap", f"unknown {inp.tier_overlap!r}; choose one of {', '.join(TIER_OVERLAP)}")
    for key, value in inp.hardware_overrides.items():
        if key not in OVERRIDE_FIELDS:
            raise PlanError(flag_of(key), f"is not a machine field; known: {', '.join(OVERRIDE_FIELDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PlanError(flag_of(key), f"must be a positive number, got {value!r}")
    for key, value in inp.overrides.items():
        flag = f"--{key.replace('_', '-')}"
        if key.startswith("eta_"):
            _number(value, flag, 1e-6, 1.0)
        elif key == "comm_overlap":
            _number(value, flag, 0.0, 1.0)
        else:
            _number(value, flag, 0.0)
