"""The run's statistics: counts and figures the manager keeps from step to step.

`MemoryManager.stats` is this record; `summary()` and the log's `end` record
are made from it, and a saved state carries its counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: The counters a saved state carries (the prediction errors and decisions start afresh).
SAVED = ("steps", "ooms", "ooms_recovered", "plan_changes", "peak_bytes", "over_budget")


@dataclass
class RunStats:
    steps: int = 0  # steps completed
    ooms: int = 0  # out-of-memory errors met (each attempt's)
    ooms_recovered: int = 0  # of those, the ones a retry got past
    plan_changes: int = 0  # times the applied plan changed: a block's mode or the loss head's choice
    pressure_events: int = 0  # times others took memory and the budget shrank
    over_budget: int = 0  # steps whose peak passed the budget in force (with no out-of-memory error)
    peak_bytes: int = 0  # the highest step peak seen
    errors: list[float] = field(default_factory=list)  # per predicted step: (predicted - observed) / observed
    decisions: Counter = field(default_factory=Counter)  # hold / escalate / relax / recover: how many of each
    loaded: dict[str, int] = field(default_factory=dict)  # the counters a saved state brought (`load_counters`)
    peak_here: int = 0  # the highest step peak since this manager began (a resumed run's own)

    def stepped(self, peak: int, decision: str, error: float | None, over: bool = False) -> None:
        """A step completed with this peak, decision and prediction error (None: not predicted);
        `over`: its peak passed the budget."""
        self.steps += 1
        self.over_budget += over
        self.peak_bytes = max(self.peak_bytes, peak)
        self.peak_here = max(self.peak_here, peak)
        self.decisions[decision] += 1
        if error is not None:
            self.errors.append(error)

    def prediction_errors(self) -> dict[str, float | None]:
        errors = self.errors
        return {
            "prediction_error_mean": sum(abs(e) for e in errors) / len(errors) if errors else None,
            "prediction_error_max": max((abs(e) for e in errors), default=None),
            "prediction_error_last": errors[-1] if errors else None,
        }

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SAVED}

    def load_counters(self, counters: dict[str, Any]) -> None:
        # a state saved before a counter was kept (`over_budget`) carries none: it counts from 0
        self.loaded = {name: int(counters.get(name, 0)) for name in SAVED}
        for name, value in self.loaded.items():
            setattr(self, name, value)
        self.peak_here = 0

    def since_resumed(self) -> dict[str, int]:
        """Steps, out-of-memory errors met and recovered, and the highest step peak since this manager
        began: a resumed run's own, where the counters go on from the saved state's (a Trainer resumed
        from a checkpoint that read its earlier process's peak, over the budget, as its own)."""
        loaded = self.loaded
        return {
            "steps": self.steps - loaded.get("steps", 0),
            "ooms": self.ooms - loaded.get("ooms", 0),
            "ooms_recovered": self.ooms_recovered - loaded.get("ooms_recovered", 0),
            "steps_over_budget": self.over_budget - loaded.get("over_budget", 0),
            "peak_bytes": self.peak_here,
        }
