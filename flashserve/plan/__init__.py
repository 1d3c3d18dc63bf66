"""``flashserve plan``: a performance, capacity and cost model for DeepSeek-V3/V4/V4.1 deployments.

Pure Python (no torch). Entry points: :func:`plan` for one deployment, :func:`sweep` for a concurrency curve,
:func:`calibrate` to fit a hardware entry's efficiency terms, ``cli.register`` / ``cli.main`` for the command.
"""

from __future__ import annotations

from .calibrate import calibrate
from .errors import PlanError
from .hardware import Hardware, get_hardware, load_catalog
from .inputs import PlanInputs
from .model_terms import ModelTerms, expected_distinct_experts
from .models import resolve_model
from .planner import PlanResult, cost_per_million, plan
from .sweep import sweep

__all__ = [
    "Hardware", "ModelTerms", "PlanError", "PlanInputs", "PlanResult", "calibrate", "cost_per_million",
    "expected_distinct_experts", "get_hardware", "load_catalog", "plan", "resolve_model", "sweep",
]
