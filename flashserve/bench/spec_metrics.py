"""Speculative-decoding acceptance from a server's Prometheus ``/metrics``, before and after a run.

Counters are matched by the end of their name, so vLLM's ``vllm:spec_decode_num_drafts`` and the same counter
under another prefix both count: drafts (verification steps), draft tokens proposed, accepted tokens and,
where exported, accepted tokens per draft position (label ``position``).
Acceptance rate = accepted / drafted tokens (percent, as vLLM reports it); acceptance length = 1 + accepted /
drafts (the bonus token included).
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {"spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
             "spec_decode_num_accepted_tokens": "accepted"}
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def read_counters(text: str | None) -> dict[str, object]:
    """Summed counter values (``drafts``, ``draft_tokens``, ``accepted``, ``per_position``) found in ``text``."""
    out: dict[str, object] = {}
    per_pos: dict[int, float] = defaultdict(float)
    for family in text_string_to_metric_families(text or ""):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name.endswith(_PER_POSITION) and "position" in sample.labels:
                per_pos[int(sample.labels["position"])] += sample.value
                continue
            for suffix, key in _COUNTERS.items():
                if name.endswith(suffix):
                    out[key] = float(out.get(key, 0.0)) + sample.value  # type: ignore[arg-type]
    if per_pos:
        out["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def acceptance(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """vLLM's ``spec_decode_*`` result fields from the counters' growth over the run; empty when the server
    exports no speculative counters or drafted nothing."""
    if not all(k in after for k in ("drafts", "draft_tokens", "accepted")):
        return {}
    d = {k: float(after[k]) - float(before.get(k, 0.0)) for k in ("drafts", "draft_tokens", "accepted")}  # type: ignore[arg-type]
    if d["drafts"] <= 0 or d["draft_tokens"] <= 0:
        return {}
    out: dict[str, object] = {
        "spec_decode_acceptance_rate": 100.0 * d["accepted"] / d["draft_tokens"],
        "spec_decode_acceptance_length": 1.0 + d["accepted"] / d["drafts"],
        "spec_decode_num_drafts": int(d["drafts"]), "spec_decode_draft_tokens": int(d["draft_tokens"]),
        "spec_decode_accepted_tokens": int(d["accepted"]),
    }
    pos_after, pos_before = after.get("per_position") or [], before.get("per_position") or []
    if pos_after:
        grown = [a - (pos_before[i] if i < len(pos_before) else 0.0) for i, a in enumerate(pos_after)]  # type: ignore[arg-type]
        out["spec_decode_per_position_acceptance_rates"] = [g / d["drafts"] for g in grown]
    return out
