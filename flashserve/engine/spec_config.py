"""``SpeculativeConfig``: speculative decoding's options, named as vLLM's ``speculative_config`` names them.

Torch-free (the CLI parses ``--speculative-config`` before anything heavy is imported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..config import PRESET_JSON, ConfigError, load_config

METHODS = ("ngram", "mtp", "dspark")
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")  # vLLM's names
AUTO, OFF = "auto", "off"  # the default: a checkpoint's own drafter when it ships one; no speculation
MTP_DEFAULT_TOKENS = 1  # V4's MTP block, chained: one draft a step unless asked for more (vLLM's default)

# Above this many decoding sequences a step verifies no drafts. Measured on the embedded model (1 CPU thread,
# python -m flashserve.bench.spec, 16 held-out prompts, docs/speculative.md; self-distilled drafter): DSpark's
# per-agent speed-up (= its throughput gain at a fixed batch) is 2.08x at 1 sequence, 1.54x at 4, 1.02x at 8,
# 1.03x at 16, 1.25x at 32, 1.11x at 48 and 64: it never lost up to the engine's default max_num_seqs, so it
# stays on to 64 and turns off past what was measured.
DEFAULT_DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup, no model), "mtp" (V4's MTP block, chained) or "dspark" (V4.1's
    DSpark stages, one block per step); ``num_speculative_tokens``: drafts verified per step (k)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up in the sequence's earlier tokens
    prompt_lookup_min: int = 1  # ngram: shortest
    # no drafts while more sequences than this decode together (vLLM's name); None: the measured default
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    confidence_threshold: float = 0.0  # dspark: stop the block at the first draft the confidence head rates lower
    # dspark and mtp, for sampled requests: "probabilistic" draws each draft from the drafter's distribution under the
    # request's sampling options and verifies against it; "greedy" drafts the argmax (vLLM's default). Measured on
    # the embedded model at temperature 1 (DSpark, batch 1): 2.08x no speculation against 0.84x, mean acceptance
    # length 3.20 against 1.20 (docs/speculative.md).
    draft_sample_method: str = "probabilistic"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None,
              model: str | None = None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (``--speculative-config '{"method": "ngram", ...}'``); None or "off":
        off; "auto": the drafter ``model``'s checkpoint ships, if any (:func:`shipped_drafter`)."""
        if value is None or isinstance(value, cls) or value == OFF:
            return None if value == OFF else value
        if value == AUTO:
            return shipped_drafter(model)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: expected a JSON object such as "
                              '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        for need in ("method", "num_speculative_tokens"):
            if need not in value:
                raise ConfigError(f"speculative_config: {need!r} is required")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"speculative_config.num_speculative_tokens: {k!r} must be an integer in [1, 16]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ConfigError(f"speculative_config: need 1 <= prompt_lookup_min ({lo!r}) <= prompt_lookup_max "
                              f"({hi!r}) <= 64")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(f"speculative_config.disable_by_batch_size: {d!r} must be a positive integer")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(f"speculative_config.draft_sample_method: {self.draft_sample_method!r} is not one of "
                              f"{', '.join(DRAFT_SAMPLE_METHODS)}")
        c = self.confidence_threshold
        if not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:
            raise ConfigError(f"speculative_config.confidence_threshold: {c!r} must be in [0, 1)")


def _tensor_names(folder: Path) -> list[str]:
    """The tensor names a checkpoint folder stores: its safetensors index, else each file's header."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as handle:  # the header only
            names += list(handle.keys())
    return names


def shipped_drafter(model: str | None) -> SpeculativeConfig | None:
    """What ``speculative_config="auto"`` (the default) runs: a checkpoint folder that stores its drafter
    (V4.1's DSpark stages, V4's MTP block: tensors under ``mtp.``) decodes with it, DSpark a whole block a step,
    MTP one token; presets (seeded random weights) and checkpoints without one do not speculate. Drafts stop
    above ``disable_by_batch_size`` sequences."""
    if model is None or str(model) in PRESET_JSON or not Path(model).is_dir():
        return None
    cfg = load_config(model)
    if not cfg.num_nextn_predict_layers:
        return None
    if not any(n.startswith("mtp.") or ".mtp." in n for n in _tensor_names(Path(model))):
        return None
    return default_for(cfg)


def default_for(cfg) -> SpeculativeConfig:
    """The drafter a model of ``cfg`` carries, at its default depth."""
    if cfg.is_v41:
        return SpeculativeConfig("dspark", cfg.dspark_block_size)
    return SpeculativeConfig("mtp", MTP_DEFAULT_TOKENS)


def describe(spec: SpeculativeConfig | None, value: Any) -> str:
    """One log line saying what speculation an engine runs, and why."""
    if spec is None:
        why = "the checkpoint ships no drafter" if value == AUTO else "off"
        return f"speculative decoding: none ({why})"
    origin = "the checkpoint's own drafter; --speculative-config off turns it off" if value == AUTO else "as asked"
    drawn = f", sampled requests' drafts {spec.draft_sample_method}" if spec.method in ("dspark", "mtp") else ""
    return (f"speculative decoding: {spec.method}, {spec.num_speculative_tokens} tokens a step{drawn}, off above "
            f"{spec.disable_by_batch_size} sequences ({origin})")
