"""MemoryManager: plans per batch for the memory actually free, and survives OOMs.

Per step: at the first managed block's forward, the live input's shape picks a
plan (cached per shape bucket, made by the planner from the cost model); the
blocks run; at the step's end the recorder's measurements teach the cost model
and the watermark controller decides to hold, escalate or relax. A background
thread watches for memory taken by others: the budget shrinks at once and the
blocks not yet run in the current forward get a tighter plan. `run_step` runs a
step and retries it under a tighter plan after an out-of-memory error, with the
gradients restored exactly.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from adaptmem.blocks import BlockSelection
from adaptmem.budget import resolve_budget
from adaptmem.costs import CostModel
from adaptmem.daemon import Sampler
from adaptmem.decisions import ESCALATE, HOLD, Decider
from adaptmem.events import SCHEMA_VERSION, EventLog
from adaptmem.modes import Mode
from adaptmem.observe import StepRecorder, StepSample, shape_of
from adaptmem.plans import PlanBook, PlanRecord
from adaptmem.policy import Policy, load_policy
from adaptmem.probes import CudaProbe, make_probe
from adaptmem.retry import StepGuard, StepOutOfMemoryError, oom_report
from adaptmem.strategies.compress import CompressOptions
from adaptmem.wrap import BlockHandle, get_instrumentation, instrument, restore

log = logging.getLogger("adaptmem")


class MemoryManager:
    """Adaptive activation memory for one model; see `adaptmem.manage`."""

    def __init__(self, model: nn.Module, *, policy: str | Policy | None = "balanced", budget: int | str | None = None,
                 device: Any = None, blocks: BlockSelection = "auto", log: str | None = None) -> None:
        self.policy = load_policy(policy)
        self.probe = make_probe(device)
        existing = get_instrumentation(model)
        if existing is not None and existing.runtime.observer is not None:
            raise RuntimeError("this model is already managed by another adaptmem.manage(); close that one first")
        self._owns_instrumentation = existing is None
        p = self.policy
        self.user_budget = resolve_budget(budget, p, self.probe)  # before touching the model: errors lose nothing
        self.budget = self.user_budget
        self.handles: list[BlockHandle] = instrument(
            model, blocks, compress=CompressOptions(codec=p.compress_codec, group_size=p.compress_group_size)
        )
        self.model = model
        try:
            self.capacity: int | None = self.probe.capacity()
        except ValueError:
            self.capacity = None
        self.recorder = StepRecorder(self.probe)
        self.costs = CostModel([type(h.module).__name__ for h in self.handles], p,
                               cuda=isinstance(self.probe, CudaProbe))
        self.decider = Decider(p)
        self.events = EventLog(log)
        self._lock = threading.RLock()
        self.plans = PlanBook(len(self.handles), p, self.costs, self.decider, self.probe)
        self._current: tuple[Mode, ...] = tuple(h.mode for h in self.handles)
        self._in_step = False
        self._step_key: tuple[int, int] | None = None
        self._step_pred: float | None = None
        self._relief_calm = 0
        self.steps = 0
        self.ooms = 0
        self.ooms_recovered = 0
        self.plan_changes = 0
        self.pressure_events = 0
        self.peak_bytes = 0
        self.errors: list[float] = []
        self.decisions: Counter = Counter()
        self._last_failure: dict = {}
        self._mutable_buffers: set[int] | None = None  # buffers a step changes; None: not known yet
        self._alloc_retries: int | None = None  # the CUDA allocator's retry count after the last step
        self._runtime = get_instrumentation(model).runtime
        self._runtime.observer = self
        self.events.emit("start", step=0, schema=SCHEMA_VERSION, policy=p.name, device=self.probe.name,
                         budget_bytes=self.budget, capacity_bytes=self.capacity,
                         blocks=[h.name for h in self.handles])
        self._sampler = Sampler(self._tick, self.events.flush, p.sample_interval_s)
        self._sampler.start()

    # ------------------------------------------------------------ public
    @property
    def plan(self) -> dict[str, Mode]:
        """The mode each block runs in now: {block name: Mode}."""
        return {h.name: h.mode for h in self.handles}

    @property
    def budget_bytes(self) -> int:
        return self.budget

    @contextlib.contextmanager
    def step(self) -> Iterator["MemoryManager"]:
        """Mark one forward + backward. An OOM inside is recorded (the next step plans
        tighter) and re-raised; use `run_step` to have it retried."""
        if self._in_step:
            raise RuntimeError("mem.step() is already open: steps do not nest")
        self._begin_step()
        try:
            yield self
        except torch.OutOfMemoryError as err:
            self._end_step(oom=err)
            raise
        except BaseException:
            self._end_step(aborted=True)
            raise
        else:
            self._end_step()

    def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a forward and backward, no optimizer step) as one
        step; after an out-of-memory error, free, tighten the plan and run it again."""
        guard = StepGuard(self.model, self.policy.accumulation_snapshot, mutable=self._mutable_buffers)
        attempts: list[dict] = []
        try:
            for attempt in range(self.policy.max_retries + 1):
                self.plans.attempt = attempt
                try:
                    with self.step():
                        result = fn(*args, **kwargs)
                except torch.OutOfMemoryError:
                    attempts.append(dict(self._last_failure))
                else:
                    if attempts:
                        self.ooms_recovered += len(attempts)
                    self._mutable_buffers = (self._mutable_buffers or set()) | guard.changed_buffers()
                    return result
                guard.restore()
                self._free_after_oom()
            raise StepOutOfMemoryError(oom_report(attempts, self.policy.max_retries), attempts)
        finally:
            self.plans.attempt = 0
            self.plans.succeeded()
            guard.close()

    def summary(self) -> dict[str, Any]:
        errors = self.errors
        return {
            "steps": self.steps,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget,
            "user_budget_bytes": self.user_budget,
            "ooms": self.ooms,
            "ooms_recovered": self.ooms_recovered,
            "plan_changes": self.plan_changes,
            "prediction_error_mean": sum(abs(e) for e in errors) / len(errors) if errors else None,
            "prediction_error_max": max((abs(e) for e in errors), default=None),
            "prediction_error_last": errors[-1] if errors else None,
            "decisions": dict(self.decisions),
            "pressure_events": self.pressure_events,
            "headroom": self.decider.headroom,
            "plan_counts": dict(Counter(m.label for m in self._current)),
            "policy": self.policy.name,
            "device": self.probe.name,
        }

    def close(self) -> None:
        """Stop the background thread, write the log, and give the model back as it was."""
        self._sampler.stop()
        self._runtime.observer = None
        self.events.emit("end", step=self.steps, summary=self.summary())
        self.events.close()
        if self._owns_instrumentation:
            restore(self.model)

    # ------------------------------------------------------- observer API
    def block_start(self, handle: BlockHandle, args: tuple, kwargs: dict) -> None:
        if (self._in_step and not self.recorder.forward_started) or (not self._in_step and handle.index == 0):
            batch, seq = shape_of(args, kwargs)
            self._plan_forward(batch, seq)
        self.recorder.block_start(handle, args, kwargs)

    def block_end(self, handle: BlockHandle, call: Any, output: Any) -> None:
        self.recorder.block_end(handle, call, output)

    def recompute(self, handle: BlockHandle, begin: bool) -> None:
        self.recorder.recompute(handle, begin)

    # ----------------------------------------------------------- planning
    def _plan_forward(self, batch: int, seq: int) -> None:
        with self._lock:
            start = self.probe.allocated()
            record = self.plans.choose(batch, seq, start, self.budget)
            self._apply(record)
            if self._in_step:
                self._step_key = record.key
                self._step_pred = self.plans.predict(record.modes, batch, seq, start)

    def _apply(self, record: PlanRecord) -> None:
        for handle, mode in zip(self.handles, record.modes):
            handle.mode = mode
        if record.modes != self._current:
            self.plan_changes += 1
            self._current = record.modes
            self.events.emit(
                "plan", step=self.steps + 1, reason=record.reason, batch=record.key[0], bucket_seq=record.key[1],
                budget_bytes=self.budget, headroom=round(self.decider.headroom, 4),
                predicted_peak_bytes=record.predicted, feasible=record.feasible,
                shortfall_bytes=record.shortfall, plan={h.name: m.label for h, m in zip(self.handles, record.modes)},
            )

    # -------------------------------------------------------------- steps
    def _begin_step(self) -> None:
        self._in_step = True
        self._step_key = None
        self._step_pred = None
        self.recorder.begin()

    def _end_step(self, *, oom: BaseException | None = None, aborted: bool = False) -> None:
        sample = self.recorder.end()
        with self._lock:
            self._in_step = False
            if sample is not None and sample.blocks:
                self.costs.learn(sample)
            if oom is not None:
                self._record_oom(oom, sample)
            elif not aborted and sample is not None:
                self._after_step(sample)

    def _after_step(self, sample: StepSample) -> None:
        calibrating = self.costs.steps_learned <= 1
        observed = sample.peak
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, observed)
        retries = self.probe.signals().get("alloc_retries")  # also logs the fragmentation hint, once
        retried = retries is not None and self._alloc_retries is not None and retries > self._alloc_retries
        self._alloc_retries = retries
        if self.policy.static_plan != "none":
            decision = HOLD
        else:
            decision = self.decider.update(observed, self.budget)
            if retried and decision != ESCALATE:
                decision = self.decider.escalate()  # the allocator had to free and retry: close to an OOM
        self.decisions[decision] += 1
        pred, error = self._step_pred, None
        if pred is not None and observed > 0:
            error = (pred - observed) / observed
            self.errors.append(error)
        if decision != HOLD or calibrating:
            self.plans.cache.clear()
        elif pred is not None and abs(pred - observed) > self.policy.replan_tolerance * self.budget:
            self.plans.cache.pop(self._step_key, None)
        self.plans.succeeded()
        self._budget_relief()
        self.events.emit(
            "step", step=self.steps, attempt=self.plans.attempt, batch=sample.batch, seq=sample.seq, tokens=sample.tokens,
            predicted_peak_bytes=pred, observed_peak_bytes=observed, budget_bytes=self.budget,
            prediction_error=error, decision=decision, headroom=round(self.decider.headroom, 4),
            alloc_retries=retries,
            plan_counts=dict(Counter(m.label for m in sample.plan.values())), seconds=round(sample.seconds, 6),
        )

    def _record_oom(self, err: BaseException, sample: StepSample | None) -> None:
        self.ooms += 1
        self.decider.after_oom()
        self._tick()  # the device may have less free than we thought: read it now, not at the next sample
        self.plans.cache.clear()
        ran = sample is not None and bool(sample.blocks)
        if ran:  # a plan was running: the retry must not run it again
            executed = tuple(sample.plan.get(i, h.mode) for i, h in enumerate(self.handles))
            self.plans.failure(executed)
        backward = ran and any(b.bwd_start is not None for b in sample.blocks)
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self._last_failure = {
            "phase": "backward" if backward else "forward" if ran else "before the first managed block",
            "message": message[:300],
            "plan_counts": dict(Counter(m.label for m in executed)) if ran else {},
            "predicted_peak_bytes": self._step_pred or 0,
            "budget_bytes": self.budget,
            "headroom": self.decider.headroom,
        }
        self.events.emit("oom", step=self.steps + 1, attempt=self.plans.attempt, **self._last_failure)

    def _free_after_oom(self) -> None:
        gc.collect()
        if isinstance(self.probe, CudaProbe) and self.policy.empty_cache_on_oom:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ pressure
    def _available(self) -> int | None:
        if self.capacity is None:
            return None
        self.capacity = self.probe.capacity()  # a partition can shrink (MIG, a stand-in's set_capacity)
        return int(self.capacity * (1 - self.policy.emergency_margin)) - self.probe.external()

    def _tick(self) -> None:
        """Background thread: shrink the budget at once when others take memory."""
        available = self._available()
        if available is None:
            return
        with self._lock:
            if available >= self.budget:
                return
            before, self.budget = self.budget, max(1, available)
            self.plans.cache.clear()
            self._relief_calm = 0
            replanned = self._replan_running_forward()
            self.events.emit("pressure", step=self.steps + 1, external_bytes=self.probe.external(),
                             budget_bytes_before=before, budget_bytes=self.budget, replanned_blocks=replanned)
            self.pressure_events += 1  # last: whoever waits on it sees the whole reaction

    def _replan_running_forward(self) -> int:
        """Blocks not yet run in the current forward get a plan for the new budget."""
        state = self.recorder.forward_state()
        if state is None or not self.costs.known or self.policy.static_plan != "none":
            return 0
        batch, seq, start, done = state
        if len(done) >= len(self.handles):
            return 0
        record = self.plans.make(self.plans.bucket(batch, seq), start, self.budget, fixed=done, reason="pressure")
        changed = sum(1 for i, h in enumerate(self.handles) if i not in done and h.mode is not record.modes[i])
        self._apply(record)
        return changed

    def _budget_relief(self) -> None:
        """Give the budget back, after calm steps, once the others have let go."""
        available = self._available()
        if available is None or self.budget >= self.user_budget:
            return
        if available >= self.budget * 1.02:
            self._relief_calm += 1
            if self._relief_calm >= self.policy.calm_steps:
                before, self.budget = self.budget, min(self.user_budget, available)
                self._relief_calm = 0
                self.plans.cache.clear()
                self.events.emit("relief", step=self.steps, budget_bytes_before=before, budget_bytes=self.budget)
        else:
            self._relief_calm = 0

    # ------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": SCHEMA_VERSION,
                "blocks": [h.name for h in self.handles],
                "costs": self.costs.state_dict(),
                "decider": self.decider.state_dict(),
                "plans": self.plans.state_dict(),
                "current": [m.label for m in self._current],
                "budget": self.budget,
                "counters": {"steps": self.steps, "ooms": self.ooms, "ooms_recovered": self.ooms_recovered,
                             "plan_changes": self.plan_changes, "peak_bytes": self.peak_bytes},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [h.name for h in self.handles]
        if state.get("blocks") != names:
            raise ValueError(
                f"manager state is for blocks {state.get('blocks', [])[:3]}... ({len(state.get('blocks', []))}), "
                f"this model has {names[:3]}... ({len(names)}); resume with the same model and block selection"
            )
        with self._lock:
            self.costs.load_state_dict(state["costs"])
            self.decider.load_state_dict(state["decider"])
            self.plans.load_state_dict(state["plans"])
            self.budget = min(self.user_budget, int(state["budget"]))
            counters = state["counters"]
            self.steps, self.ooms = counters["steps"], counters["ooms"]
            self.ooms_recovered, self.plan_changes = counters["ooms_recovered"], counters["plan_changes"]
            self.peak_bytes = counters["peak_bytes"]
            current = tuple(Mode.parse(m) for m in state["current"])
            for handle, mode in zip(self.handles, current):
                handle.mode = mode
            self._current = current
        self.events.emit("resume", step=self.steps, plan={h.name: h.mode.label for h in self.handles})


@contextlib.contextmanager
def manage(model: nn.Module, policy: str | Policy | None = "balanced", budget: int | str | None = None,
           device: Any = None, blocks: BlockSelection = "auto", log: str | None = None) -> Iterator[MemoryManager]:
    """Manage `model`'s activation memory inside the block; the model is restored on exit.

    Args:
        model: the model to train.
        policy: a preset name ("balanced", "max-savings", "long-context", "every-2",
            "sqrt-n"), a path to a TOML policy, or a `Policy`. ADAPTMEM_POLICY overrides.
        budget: ceiling for the device's peak allocated bytes in a step: bytes, "12GiB",
            "80%" of capacity, or None for the policy's share of what others leave free.
            ADAPTMEM_BUDGET overrides.
        device: None (the current CUDA device, or the host), "cuda:N", or a SimulatedDevice.
        blocks: which submodules are blocks (see `adaptmem.instrument`).
        log: path of a JSONL decision log, or None.
    """
    mem = MemoryManager(model, policy=policy, budget=budget, device=device, blocks=blocks, log=log)
    try:
        yield mem
    finally:
        mem.close()
