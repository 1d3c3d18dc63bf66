"""The seed article's headline, explained: DeepSeek-V4.1-Flash on GB300 NVL72, 596 → 848 tokens/s per agent
"from software alone" within one month.

Configuration (documented in docs/plan.md): one NVL72 rack, attention in TP8 groups (9 data-parallel
ranks), experts over all 72 GPUs (EP72), FP4 experts / FP8 dense / FP4 global KV, one agent per attention
group (9 agents), 64k-token contexts with 90% prefix-cache hits, DSpark drafting a 5-token block at the one
published V4.1 acceptance length (2.82, vLLM issue 56797).

"After" is the GB300 profile fitted to InferenceX (a mature DeepSeek serving stack). "Before" differs in one
software term only: the fixed per-layer time. The planner needs 97.6 µs per layer instead of 66.8 µs to
land on 596: unfused compressor / indexer / mHC kernels and no programmatic dependent launch cost 31 µs per
layer, × 43 layers (40 backbone + 3 DSpark stages) = 1.3 ms per step.
"""

from __future__ import annotations

from dataclasses import replace

from .inputs import PlanInputs
from .planner import PlanResult, plan

SEED_INPUTS = PlanInputs(
    model="deepseek-v41-flash", hardware="gb300-nvl72", gpus=72, tp=8, ep=72, weight_dtype="fp4",
    concurrency=9, context=65536, prompt_len=65536, output_len=2048, accept_length=2.82, draft_tokens=5,
    prefix_hit_rate=0.9,
)
SEED_PUBLISHED = {"before": 596.0, "after": 848.0}
# Software terms that differ between the two (all other terms are the GB300 profile's).
SEED_BEFORE_TERMS = {"layer_overhead_us": 97.6}
SEED_AFTER_TERMS: dict[str, float] = {}


def seed_scenario() -> dict[str, PlanResult]:
    """Plan the seed configuration with the launch-time ("before") and one-month ("after") software terms."""
    return {
        "before": plan(replace(SEED_INPUTS, overrides=dict(SEED_BEFORE_TERMS))),
        "after": plan(replace(SEED_INPUTS, overrides=dict(SEED_AFTER_TERMS))),
    }
