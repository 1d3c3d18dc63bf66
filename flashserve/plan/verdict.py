"""Check the seed's aggregate claims: "over 1M tokens/s per GPU" and "$0.002 per million tokens".

The planner answers three questions for each: what the hardware could do at 100% of peak, what the
fitted model predicts at its best operating point, and what would have to be true to reach the claim
(counting prompt tokens served from the prefix cache, or counting per rack instead of per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .dtypes import PEAK_ORDER
from .hardware import Hardware, get_hardware
from .inputs import PlanInputs
from .model_terms import ModelTerms
from .models import resolve_model
from .planner import PlanResult, plan

CLAIM_TOKENS_PER_S = 1e6
CLAIM_DOLLARS_PER_M = 0.002
RACK_GPUS = 72

# Throughput operating point: attention DP over the whole rack, EP72, no drafting (it costs FLOPs at scale).
THROUGHPUT_BASE = PlanInputs(model="deepseek-v41-flash", hardware="gb300-nvl72", gpus=72, tp=1, ep=72,
                             weight_dtype="fp4", concurrency=1, context=8192, prompt_len=8192, output_len=1024)
# An agent turn: a long context re-sent every turn, short output.
AGENT_PROMPT, AGENT_OUTPUT = 100_000, 1_000
CONCURRENCY_LEVELS = (1152, 2304, 4608, 9216, 18432, 36864, 73728)
HIT_RATES = (0.9, 0.99, 0.999)
MIN_AGENT_SPEED = 20.0  # tokens/s per agent: slower operating points are not counted as usable


@dataclass(frozen=True)
class Verdict:
    """Numbers behind the verdict (tokens/s are per GPU)."""

    peak_output_tokens_per_s: float  # FLOP ceiling for output tokens at 100% of dense peak
    best: PlanResult  # best predicted decode operating point
    required_for_price: float  # counted tokens/s per GPU that $0.002/M needs at the preset price
    agent_turns: dict[float, PlanResult]  # prefix-hit rate → best agent-turn operating point
    hit_rate_for_tokens: float  # least prefix-hit rate at which agent turns reach 1M counted tokens/s per GPU
    hit_rate_for_price: float  # least prefix-hit rate at which counted tokens cost ≤ $0.002 per million

    @property
    def best_output_tokens_per_s(self) -> float:
        return self.best.decode_tokens_per_s_per_gpu

    def lines(self) -> list[str]:
        """A plain-language verdict."""
        best = self.best
        price = best.price_per_gpu_hour
        out = [
            f"Claim 1: over {CLAIM_TOKENS_PER_S:,.0f} tokens/s per GPU ({best.deployment.model.name}, {best.deployment.hw.name}).",
            f"  FLOP ceiling for output tokens at 100% of dense peak: {self.peak_output_tokens_per_s:,.0f}/s per GPU "
            f"({CLAIM_TOKENS_PER_S / self.peak_output_tokens_per_s:.1f}x short of the claim).",
            f"  Best predicted decode at >= {MIN_AGENT_SPEED:.0f} tokens/s per agent: {self.best_output_tokens_per_s:,.0f} "
            f"output tokens/s per GPU at concurrency {best.inputs.concurrency:,} "
            f"({best.tokens_per_s_per_agent:.0f} tokens/s per agent, {best.step.bound}-bound).",
            f"  Per rack instead of per GPU: {CLAIM_TOKENS_PER_S / RACK_GPUS:,.0f} per GPU needed - "
            + ("reachable." if self.best_output_tokens_per_s * RACK_GPUS >= CLAIM_TOKENS_PER_S else "not reached."),
            f"  Counting prompt tokens served from cache (agent turns of {AGENT_PROMPT:,} context + {AGENT_OUTPUT:,} output):",
        ]
        for hit, r in self.agent_turns.items():
            out.append(f"    hit rate {hit:.3f}: {r.total_tokens_per_s_per_gpu:,.0f} tokens/s per GPU counted, "
                       f"{r.output_tokens_per_s_per_gpu:,.0f} output, ${r.cost_per_million_total_tokens:.4f} per M counted tokens")
        out.append(f"    1M counted tokens/s per GPU needs a prefix-hit rate >= {self.hit_rate_for_tokens:.3f}")
        out += [
            f"Claim 2: ${CLAIM_DOLLARS_PER_M} per million tokens at ${price:.2f}/GPU-hour needs "
            f"{self.required_for_price:,.0f} tokens/s per GPU.",
            f"  Output tokens alone at the best point cost ${best.cost_per_million_output_tokens:.3f} per M "
            f"({best.cost_per_million_output_tokens / CLAIM_DOLLARS_PER_M:.0f}x the claim); counted agent-turn tokens "
            f"reach ${CLAIM_DOLLARS_PER_M} per M at a prefix-hit rate >= {self.hit_rate_for_price:.3f}.",
            "  Both claims hold only when cached prompt tokens are counted as served tokens and nearly all of an",
            "  agent's re-sent context hits the prefix cache (V4.1 keeps 890 B/token, so 100k-token prefixes stay",
            "  resident: the cost of a hit is a cache lookup, not a forward pass).",
        ]
        return out


def output_flop_ceiling(base: PlanInputs = THROUGHPUT_BASE) -> float:
    """Output tokens/s per GPU if every FLOP of a decode token ran at 100% of its dtype's dense peak."""
    model = resolve_model(base.model, base.kv_dtype)
    hw = get_hardware(base.hardware)
    dense = 2.0 * model.dense_params_decode / hw.peak("fp8", PEAK_ORDER["fp8"])
    experts = 2.0 * model.n_moe_layers * model.top_k * model.expert_params / hw.peak(base.weight_dtype, PEAK_ORDER[base.weight_dtype])
    attn = model.attention_flops(base.resolved_context()) / hw.peak("fp8", PEAK_ORDER["fp8"])
    return 1.0 / (dense + experts + attn)


def _best(base: PlanInputs, key: str, model: ModelTerms, hw: Hardware) -> PlanResult:
    """The operating point maximising ``key`` among those that fit in HBM and serve agents fast enough."""
    results = [plan(replace(base, concurrency=c), model=model, hw=hw) for c in CONCURRENCY_LEVELS]
    usable = [r for r in results if r.inputs.concurrency <= r.capacity.sessions_fit
              and r.tokens_per_s_per_agent >= MIN_AGENT_SPEED] or results[:1]
    return max(usable, key=lambda r: getattr(r, key))


def _agent_turn(base: PlanInputs, hit: float, model: ModelTerms, hw: Hardware) -> PlanResult:
    agent = replace(base, prompt_len=AGENT_PROMPT, output_len=AGENT_OUTPUT,
                    context=AGENT_PROMPT + AGENT_OUTPUT // 2, prefix_hit_rate=hit)
    return _best(agent, "total_tokens_per_s_per_gpu", model, hw)


def least_hit_rate(base: PlanInputs, ok: Callable[[PlanResult], bool], model: ModelTerms, hw: Hardware) -> float:
    """Smallest prefix-hit rate (bisection, to 1e-3) whose best agent-turn point satisfies ``ok``; 1.0 if none."""
    lo, hi = 0.0, 1.0
    if not ok(_agent_turn(base, hi, model, hw)):
        return 1.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(_agent_turn(base, mid, model, hw)) else (mid, hi)
    return hi


def verdict(base: PlanInputs = THROUGHPUT_BASE) -> Verdict:
    """Evaluate both claims for ``base``'s model and hardware."""
    model = resolve_model(base.model, base.kv_dtype)
    hw = get_hardware(base.hardware)
    best = _best(base, "decode_tokens_per_s_per_gpu", model, hw)
    price = best.price_per_gpu_hour
    turns = {hit: _agent_turn(base, hit, model, hw) for hit in HIT_RATES}
    return Verdict(
        peak_output_tokens_per_s=output_flop_ceiling(base), best=best,
        required_for_price=price * 1e6 / (3600.0 * CLAIM_DOLLARS_PER_M), agent_turns=turns,
        hit_rate_for_tokens=least_hit_rate(base, lambda r: r.total_tokens_per_s_per_gpu >= CLAIM_TOKENS_PER_S, model, hw),
        hit_rate_for_price=least_hit_rate(base, lambda r: r.cost_per_million_total_tokens <= CLAIM_DOLLARS_PER_M, model, hw))
