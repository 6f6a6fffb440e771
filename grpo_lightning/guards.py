"""Counting learning steps skipped for a NaN or inf loss or gradient, and stopping after too many in a row."""

from __future__ import annotations

from .config import GRPOError


class NonFiniteError(GRPOError):
    """Too many learning steps in a row had a non-finite loss or gradient."""


class NonFiniteSteps:
    """Skipped steps: ``total`` over the run, ``in_a_row`` since the last good one. ``limit`` in a row raise
    NonFiniteError (a run whose every step is NaN only burns time, and hides the fault)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.in_a_row = 0

    def passed(self) -> None:
        self.in_a_row = 0

    def skipped(self, what: str, where: str) -> None:
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.in_a_row} learning steps in a row had a NaN or inf {what} (the last at {where}); the run "
                "stopped, its last checkpoint intact: lower lr, check the reward's scale, or train in 32-true "
                "(max_nonfinite_steps sets how many are skipped before stopping)"
            )

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total = int(state.get("total", 0))
        self.in_a_row = int(state.get("in_a_row", 0))
