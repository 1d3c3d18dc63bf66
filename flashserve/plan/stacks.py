"""Serving-stack profiles: efficiency terms measured for one model family on one software generation.

A hardware profile is fitted on whatever stack produced its published points (mostly DeepSeek-R1 on
TensorRT-LLM or SGLang). ``--stack NAME`` lays a stack's terms over it, for the model families the stack was
measured on; explicit ``--<term>`` overrides still win. A stack listing a family and a hardware preset in
``families`` / ``default_on`` is used by default for that pair; ``--stack none`` turns it off. Stacks live in
``hardware.json`` under ``stacks``, every number with its source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError
from .hardware import HARDWARE_JSON

NO_STACK = "none"
STACK_TERMS = ("layer_overhead_us", "pass_overhead_us", "spec_step_overhead_us", "eta_mem", "eta_flop", "eta_comm")


@dataclass(frozen=True)
class Stack:
    """Efficiency terms of one serving stack, and the model families they were measured on."""

    name: str
    description: str
    families: tuple[str, ...]
    terms: dict[str, float]
    sources: dict[str, str]
    fitted_on: tuple[str, ...]
    held_out: tuple[str, ...]
    default_on: tuple[str, ...] = ()  # hardware presets where it is the default for its families
    default_note: str = ""


def _stack(name: str, raw: dict[str, Any]) -> Stack:
    terms, sources = {}, {}
    for key in STACK_TERMS:
        if key not in raw:
            continue
        entry = raw[key]
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)) or not entry.get("source"):
            raise PlanError(f"stacks.{name}.{key}", "must be an object with a numeric 'value' and a 'source'")
        terms[key], sources[key] = float(entry["value"]), str(entry["source"])
    families = tuple(raw.get("families") or ())
    if not terms or not families:
        raise PlanError(f"stacks.{name}", "needs at least one term and its model 'families'")
    return Stack(name, str(raw.get("description", "")), families, terms, sources,
                 tuple(raw.get("fitted_on", ())), tuple(raw.get("held_out", ())),
                 tuple(raw.get("default_on", ())), str(raw.get("default_note", "")))


def load_stacks(path: Path = HARDWARE_JSON) -> dict[str, Stack]:
    """Every stack in ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError("hardware.json", f"cannot read {path}: {exc}") from None
    return {name: _stack(name, raw) for name, raw in data.get("stacks", {}).items()}


def default_stack(family: str, hardware: str) -> Stack | None:
    """The stack used when ``--stack`` is not given: the one measured on ``family`` and marked default on
    ``hardware``, or None."""
    found = [s for s in load_stacks().values() if family in s.families and hardware in s.default_on]
    if len(found) > 1:
        raise PlanError("hardware.json", f"stacks {', '.join(s.name for s in found)} are all default for "
                                         f"{family} on {hardware}")
    return found[0] if found else None


def resolve_stack(name: str | None, family: str, hardware: str) -> Stack | None:
    """The stack a plan uses: ``name``; the default for ``family`` on ``hardware`` when None; none for 'none'."""
    if name == NO_STACK:
        return None
    if name is None:
        return default_stack(family, hardware)
    return get_stack(name, family)


def get_stack(name: str, family: str) -> Stack:
    """The stack ``name``, refused when unknown or measured on other model families."""
    stacks = load_stacks()
    if name not in stacks:
        known = ", ".join([*sorted(stacks), NO_STACK])
        raise PlanError("--stack", f"unknown stack {name!r}; known: {known}")
    stack = stacks[name]
    if family not in stack.families:
        raise PlanError("--stack", f"{name} was measured on {', '.join(stack.families)}, not {family}")
    return stack
