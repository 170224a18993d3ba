"""A controller's state for resuming a run (what it learned, decided and counted), and its summary.

The manager's `state_dict()` / `load_state_dict()` call these; a resumed run
plans from the same costs and cached plans, and its log continues the saved
run's. `summary()` reads the counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from adaptmem.control.controller import Controller
from adaptmem.control.events import SCHEMA_VERSION
from adaptmem.control.headcosts import HeadChoice
from adaptmem.modes import Mode


def controller_state(ctl: Controller) -> dict[str, Any]:
    blocks = ctl.blocks
    return {
        "version": SCHEMA_VERSION,
        "run": ctl.events.run_id,
        "blocks": blocks.names,
        "costs": ctl.costs.state_dict(),
        "decider": ctl.decider.state_dict(),
        "plans": ctl.plans.state_dict(),
        "current": [m.label for m in blocks.modes],
        "current_head": blocks.head_choice.label if blocks.head_choice is not None else None,
        "budget": ctl.budget,
        "user_budget": ctl.budgets.user,
        "lengths": ctl.lengths.state_dict(),
        "counters": ctl.stats.counters(),
        "forwards": ctl.forwards,
        "head_can_chunk": ctl.plans.head_can_chunk,
        "head_kept_for": ctl.plans.head_kept_for,
        "ran": ctl.plans.ran_state(),
        "measuring": ctl.measuring.state_dict(),
        "loop_owners": [[name, list(orders)] for name, orders in ctl.loop_owners],
    }


def restore_controller_state(ctl: Controller, state: dict[str, Any]) -> str:
    """Put `state` into the controller's collaborators and take its run id; returns the run id it
    had before. Logs nothing: a manager built with `state=` restores before its `start` record,
    so that record, like all that follow, is under the saved run id."""
    names = ctl.blocks.names
    saved = state.get("blocks")
    if saved != names and (calls := calls_named(saved or [], ctl.blocks.handles)) is not None:
        ctl.call_per_block(calls, announce=False)  # the saved run found blocks called more than once
        ctl.count_loops([(name, list(orders)) for name, orders in state.get("loop_owners", [])])
        names = ctl.blocks.names
    if saved != names:
        raise ValueError(
            f"manager state is for blocks {state.get('blocks', [])[:3]}... ({len(state.get('blocks', []))}), "
            f"this model has {names[:3]}... ({len(names)}); resume with the same model and block selection"
        )
    with ctl.lock:
        ctl.costs.load_state_dict(state["costs"])
        ctl.decider.load_state_dict(state["decider"])
        ctl.plans.load_state_dict(state["plans"])
        ctl.budgets.resume(state["budget"], state.get("user_budget"))
        ctl.stats.load_counters(state["counters"])
        ctl.lengths.load_state_dict(state["lengths"])
        ctl.lesson = None  # what a batch given up taught this run, not the saved one's figures
        ctl.forwards = int(state.get("forwards", 1))  # (states saved before these were kept)
        ctl.plans.head_can_chunk = bool(state.get("head_can_chunk", True))
        ctl.plans.head_kept_for = state.get("head_kept_for")
        ctl.plans.load_ran_state(state.get("ran", []))
        if "measuring" in state:  # (states saved before it was kept measure each bucket's next step)
            ctl.measuring.load_state_dict(state["measuring"])
        head = state.get("current_head")
        ctl.blocks.apply(
            tuple(Mode.parse(m) for m in state["current"]),
            HeadChoice.parse(head) if head is not None and ctl.blocks.head is not None else None,
        )
        return ctl.events.continue_run(state.get("run"))


def calls_named(saved: list[str], handles: list) -> list[int] | None:
    """The calls of one forward, by block, that a saved run's block names (`<block>#2`, ... for a
    block's calls after its first) describe for these blocks; None where they name others."""
    order = {h.name: h.order for h in handles if h.call == 0}
    calls = []
    for name in saved:
        base, _, nth = name.rpartition("#")
        if name in order:
            calls.append(order[name])
        elif base in order and nth.isdigit():
            calls.append(order[base])
        else:
            return None
    return calls if len(calls) > len(set(calls)) else None


def announce_resume(ctl: Controller, started_as: str) -> None:
    """The `resume` record: the plan the saved run continues with, and the run id the manager
    had before it took the saved one (the saved one itself for a manager built with `state=`)."""
    plan = dict(zip(ctl.blocks.names, (m.label for m in ctl.blocks.running())))
    ctl.events.emit("resume", step=ctl.stats.steps, started_as=started_as, plan=plan)


def summary(ctl: Controller, compiles: int) -> dict[str, Any]:
    stats = ctl.stats
    return {
        "steps": stats.steps,
        "peak_bytes": stats.peak_bytes,
        "budget_bytes": ctl.budget,
        "user_budget_bytes": ctl.budgets.user,
        "ooms": stats.ooms,
        "ooms_recovered": stats.ooms_recovered,
        "since_resumed": stats.since_resumed(),
        "plan_changes": stats.plan_changes,
        **stats.prediction_errors(),
        "decisions": dict(stats.decisions),
        "pressure_events": stats.pressure_events,
        "steps_over_budget": stats.over_budget,
        "headroom": ctl.decider.headroom,
        "plan_counts": dict(Counter(m.label for m in ctl.blocks.modes)),
        "head": ctl.blocks.head_choice.label if ctl.blocks.head_choice is not None else None,
        "policy": ctl.policy.name,
        "device": ctl.probe.name,
        "run": ctl.events.run_id,
        "compiles": compiles,
    }
