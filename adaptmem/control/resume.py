"""A manager's state for resuming a run (what it learned, decided and counted), and its summary.

The manager's `state_dict()` / `load_state_dict()` call these; a resumed run
plans from the same costs and cached plans, and its log continues the saved
run's. `summary()` reads the counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from adaptmem.control.events import SCHEMA_VERSION
from adaptmem.control.headcosts import HeadChoice
from adaptmem.modes import Mode


def manager_state(mgr: Any) -> dict[str, Any]:
    return {
        "version": SCHEMA_VERSION,
        "run": mgr.events.run_id,
        "blocks": [h.name for h in mgr.handles],
        "costs": mgr.costs.state_dict(),
        "decider": mgr.decider.state_dict(),
        "plans": mgr.plans.state_dict(),
        "current": [m.label for m in mgr._current],
        "current_head": mgr._current_head.label if mgr._current_head is not None else None,
        "budget": mgr.budget,
        "lengths": mgr.lengths.state_dict(),
        "counters": {
            "steps": mgr.steps,
            "ooms": mgr.ooms,
            "ooms_recovered": mgr.ooms_recovered,
            "plan_changes": mgr.plan_changes,
            "peak_bytes": mgr.peak_bytes,
        },
    }


def load_manager_state(mgr: Any, state: dict[str, Any]) -> None:
    """Load `state` into a running manager (`load_state_dict`), then log a `resume` record."""
    started_as = restore_manager_state(mgr, state)
    announce_resume(mgr, started_as)


def restore_manager_state(mgr: Any, state: dict[str, Any]) -> str:
    """Put `state` into the manager's collaborators and take its run id; returns the run id the
    manager had before. Logs nothing: a manager built with `state=` restores before its `start`
    record, so that record, like all that follow, is under the saved run id."""
    names = [h.name for h in mgr.handles]
    if state.get("blocks") != names:
        raise ValueError(
            f"manager state is for blocks {state.get('blocks', [])[:3]}... ({len(state.get('blocks', []))}), "
            f"this model has {names[:3]}... ({len(names)}); resume with the same model and block selection"
        )
    with mgr._lock:
        mgr.costs.load_state_dict(state["costs"])
        mgr.decider.load_state_dict(state["decider"])
        mgr.plans.load_state_dict(state["plans"])
        mgr.budgets.current = min(mgr.user_budget, int(state["budget"]))
        counters = state["counters"]
        mgr.steps, mgr.ooms = counters["steps"], counters["ooms"]
        mgr.ooms_recovered, mgr.plan_changes = counters["ooms_recovered"], counters["plan_changes"]
        mgr.peak_bytes = counters["peak_bytes"]
        mgr.lengths.load_state_dict(state["lengths"])
        current = tuple(Mode.parse(m) for m in state["current"])
        for handle, mode in zip(mgr.handles, current):
            handle.mode = mode
        mgr._current = current
        head = state.get("current_head")
        if head is not None and mgr.head is not None:
            mgr._current_head = choice = HeadChoice.parse(head)
            mgr.head.planned(choice.mode, choice.chunk)
        started_as = mgr.events.run_id
        mgr.events.run_id = state.get("run") or started_as
    return started_as


def announce_resume(mgr: Any, started_as: str) -> None:
    """The `resume` record: the plan the saved run continues with, and the run id the manager
    had before it took the saved one (the saved one itself for a manager built with `state=`)."""
    mgr.events.emit("resume", step=mgr.steps, started_as=started_as, plan={h.name: h.mode.label for h in mgr.handles})


def manager_summary(mgr: Any) -> dict[str, Any]:
    errors = mgr.errors
    return {
        "steps": mgr.steps,
        "peak_bytes": mgr.peak_bytes,
        "budget_bytes": mgr.budget,
        "user_budget_bytes": mgr.user_budget,
        "ooms": mgr.ooms,
        "ooms_recovered": mgr.ooms_recovered,
        "plan_changes": mgr.plan_changes,
        "prediction_error_mean": sum(abs(e) for e in errors) / len(errors) if errors else None,
        "prediction_error_max": max((abs(e) for e in errors), default=None),
        "prediction_error_last": errors[-1] if errors else None,
        "decisions": dict(mgr.decisions),
        "pressure_events": mgr.pressure_events,
        "headroom": mgr.decider.headroom,
        "plan_counts": dict(Counter(m.label for m in mgr._current)),
        "policy": mgr.policy.name,
        "device": mgr.probe.name,
        "run": mgr.events.run_id,
        "compiles": mgr._compiles.count,
    }
