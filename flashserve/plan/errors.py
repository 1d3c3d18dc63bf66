"""The planner's single error type: a bad input, named by the field it came from."""

from __future__ import annotations


class PlanError(ValueError):
    """An input the planner cannot use. ``field`` names the flag, key or file field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
