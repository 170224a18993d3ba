"""The manager's reactions: to blocks starting, steps ending, OOMs, and outside pressure.

`Reactions` is the half of `MemoryManager` that runs inside training and the
background thread; the other half (`manager.py`) is the lifecycle and the
public API. It is a mixin over the manager's state, not a class used alone:
the split keeps each half readable.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from adaptmem.config.units import format_bytes
from adaptmem.control.decisions import ESCALATE, HOLD
from adaptmem.control.plans import RETRY_STEP, PlanRecord
from adaptmem.control.retry import StepOutOfMemoryError, failure_record
from adaptmem.control.samples import InputShape, StepSample, shape_of
from adaptmem.control.unfit import Trace, refusal, unfittable
from adaptmem.devices.cuda import CudaProbe
from adaptmem.modes import Mode
from adaptmem.wrapping import BlockHandle, checkpoints_itself

log = logging.getLogger("adaptmem")


class Reactions:
    # ------------------------------------------------------- observer API
    def block_start(self, handle: BlockHandle, args: tuple, kwargs: dict) -> None:
        if self.now.open and self.recorder.ran(handle.index):
            self._second_forward()
        if self.now.open and not self.recorder.forward_started:
            self._plan_forward(shape_of(args, kwargs))
        elif not self.now.open and handle.index == 0:
            self._warn_unmarked()
            self._plan_forward(shape_of(args, kwargs))
        elif self.now.open and self.now.overlapping and handle.index == 0:
            self._plan_second_forward(shape_of(args, kwargs))
        self.recorder.block_start(handle, args, kwargs)

    def _second_forward(self) -> None:
        """A block runs a second time in one step. After the first forward's backward, it is
        a second micro-batch: the step is closed and another opened with the same label.
        Before it (two forwards, then one backward), the second forward is planned for the
        memory the first leaves free, and the step teaches only its peak."""
        if self.recorder.backward_done:
            label = self.now.label
            self.end_step()
            self.begin_step(label)
            return
        if not self.now.overlapping:
            self.now.overlapping = True
            self.recorder.overlap()
            if not self._overlap_warned:
                self._overlap_warned = True
                log.warning(
                    "adaptmem: a step ran a second forward before its backward; its second forward is "
                    "planned for the memory the first leaves, and the step teaches the cost model only "
                    "its peak. Mark each forward + backward as its own step where you can."
                )

    def block_end(self, handle: BlockHandle, call: Any, output: Any) -> None:
        self.recorder.block_end(handle, call, output)

    def recompute(self, handle: BlockHandle, begin: bool) -> None:
        self.recorder.recompute(handle, begin)

    def _no_second_backward_for(self, mode: Mode) -> None:
        """The run backwards twice through a step (retain_graph / create_graph): `mode`,
        which PyTorch cannot backward twice, is never planned again in this run."""
        if self.plans.forbid(mode):
            log.warning(
                "adaptmem: this run backwards twice through a step (retain_graph=True or "
                "create_graph=True); %s cannot, so it is not used for the rest of the run. run_step runs "
                "a step that met it again from its start under the new plan; `with mem.step():` cannot, "
                "and raises that one step's error",
                mode.label,
            )
            self.events.emit(
                "restrict",
                step=self.steps + 1,
                mode=mode.label,
                reason="double backward",
                allowed=[m.label for m in self.plans.allowed],
            )

    def _warn_unmarked(self) -> None:
        if self._unmarked_warned:
            return
        self._unmarked_warned = True
        log.warning(
            "adaptmem: the model ran a training forward outside a marked step, so nothing is "
            "learned from it and the blocks keep the %s plan. Wrap each forward + backward in "
            "`with mem.step():`, call mem.run_step(fn, batch), or drive begin_step()/end_step() "
            "from your framework's hooks (adaptmem.integrations).",
            "user's" if self._user_modes is not None else "calibration (every block checkpointed)",
        )

    def _check_device_counted(self, sample: StepSample | None) -> None:
        """A `SimulatedDevice` counts only while entered: a step run outside it reads a peak of
        what was there before, and every plan would be made on figures of nothing."""
        device = getattr(self.probe, "device", None)
        if (
            self._idle_warned
            or sample is None
            or not sample.blocks
            or not hasattr(device, "active")
            or device.active
            or sample.peak > sample.start
        ):
            return
        self._idle_warned = True
        log.warning(
            "adaptmem: the SimulatedDevice given to the manager was not entered during step %d, so it "
            "counted none of its tensors (peak %s, what was there before) and the plans rest on "
            "figures of nothing. Run the steps inside `with device:` (around the training loop, "
            "trainer.fit() or trainer.train()).",
            self.steps + 1,
            format_bytes(sample.peak),
        )

    # ----------------------------------------------------------- planning
    def _plan_forward(self, shape: InputShape) -> None:
        with self._lock:
            if (
                self.now.open
                and self.plans.failed is not None
                and self.plans.failed_shape is not None
                and self.plans.failed_shape != (shape.batch, shape.extent)
            ):
                # a batch that ran out of memory under `step()` was given up, not retried: this is the
                # next one. What the failure taught stays; its retry rules are for that batch only
                self.plans.succeeded()
                self._trace, self._attempts = Trace.take(self), []
            batch, extent, start, budget = shape.batch, shape.extent, self.recorder.probe.allocated(), self.budget
            agree = self._agree is not None and self.now.open
            if agree:  # every rank plans for the largest shape and allocation, the smallest budget
                batch, extent, start, budget = self._agree.figures(batch, extent, start, budget)
                self.now.plan_point_passed = True
            record = self.plans.choose(batch, extent, start, budget)
            if agree:  # and runs rank 0's plan
                record = replace(record, modes=self._agree.plan(record.modes))
            if self.now.open:
                self._refuse_unfittable(record, shape, start)
            self._apply(record)
            if self.now.open:
                self.recorder.detail = self.measuring.worth(record)
                self.now.key = record.key
                self.now.predicted = self.plans.predict(record.modes, batch, extent, start, record.head)
                self.now.feasible = record.feasible
                self.now.start = start

    def _refuse_unfittable(self, record: PlanRecord, shape: InputShape, start: int) -> None:
        """Give the step up before a block runs when no plan can fit it (see `adaptmem.control.unfit`).
        With other ranks, only a retry's verdict counts, and all give up when one does. A plan predicted
        to fit, and not a retry's, is let through before reading the device (every step comes here)."""
        if self._agree is not None:
            if self.plans.failed is None:
                return
        elif record.feasible and not record.exhausted:
            return
        available = self._reading(self.budgets.available, None)
        then = self._attempts[-1].get("available_bytes") if self._attempts else None
        # others have freed memory since the last attempt failed: the tightest plan is worth running again
        lifted = available is not None and then is not None and available > then + RETRY_STEP * self.budget
        if self._agree is not None:
            if not self._agree.any(record.exhausted and not lifted):
                return
        elif not (
            (record.exhausted and not lifted)
            or unfittable(record, start, available, self.costs.measured(shape.batch, shape.extent))
        ):
            return
        message = refusal(
            self, record, shape.batch, shape.extent, shape.seq if shape.width else 0, start, self._attempts
        )
        self.now.refused = True
        self.events.emit(
            "refused",
            step=self.steps + 1,
            label=self.now.label,
            batch=shape.batch,
            seq=shape.seq,
            sample_elements=shape.extent,
            predicted_peak_bytes=record.predicted,
            floor_bytes=start,
            budget_bytes=self.budget,
            exhausted=record.exhausted,
            attempts=len(self._attempts),
        )
        raise StepOutOfMemoryError(message, list(self._attempts))

    def _agree_on_failure(self, error: BaseException | None) -> BaseException | None:
        """Across ranks: when any rank ran out of memory in this step, every rank records it."""
        if self._agree is None:
            return error
        oom = isinstance(error, torch.OutOfMemoryError)
        if oom and not self.now.plan_point_passed:
            self._join_plan_point()
        if self._agree.any(oom) and not oom and error is None:
            return torch.OutOfMemoryError("another rank ran out of memory in this step")
        return error

    def _no_sync(self) -> Any:
        """Under DDP with other ranks: no gradient reduction inside the step (a rank that fails
        in backward would leave DDP's reducer waiting); `_average_gradients` does it after."""
        if self._agree is not None and self._ddp is not None and self._ddp.require_backward_grad_sync:
            self._syncing = True
            return self._ddp.no_sync()
        self._syncing = False
        return contextlib.nullcontext()

    def _average_gradients(self) -> None:
        if self._agree is not None and self._syncing:
            self._agree.average_gradients(p for p in self.model.parameters() if p.requires_grad)

    def _join_plan_point(self) -> None:
        """A rank that failed before its first block still takes part in the plan collectives."""
        self._agree.figures(0, 0, 0, 2**62)
        self._agree.plan(tuple(h.mode for h in self.handles))
        self.now.plan_point_passed = True

    def _plan_second_forward(self, shape: InputShape) -> None:
        """Plan a forward for what the step's first forward leaves free (not cached: a lone
        forward of this shape starts with more room)."""
        with self._lock:
            start = self.probe.allocated()
            bucket = self.plans.bucket(shape.batch, shape.extent)
            self._apply(
                self.plans.make(bucket, start, self.budget, fixed={}, reason="second forward", extent=shape.extent)
            )

    def _check_own_checkpointing(self) -> None:
        """The model's own gradient checkpointing (Hugging Face's `gradient_checkpointing`),
        switched on or off since the last step: it decides for its blocks, which run in NONE."""
        own = frozenset(h.index for h in self.handles if checkpoints_itself(h.module))
        if own == self._own_checkpointing:
            return
        with self._lock:
            added = own - self._own_checkpointing
            self._own_checkpointing = own
            self.plans.pin({i: Mode.NONE for i in own})
            names = [self.handles[i].name for i in sorted(own)]
            self.events.emit("own_checkpointing", step=self.steps + 1, blocks=names)
        if added:
            log.warning(
                "adaptmem: %d block(s) (%s) now checkpoint themselves: the model's own gradient checkpointing "
                "(gradient_checkpointing_enable() or activation_checkpointing_enable()) decides for them, "
                "recomputing them whatever adaptmem plans, so adaptmem runs them in NONE (its own recompute would"
                " run them once more) and plans the others. Switch it off "
                "(model.activation_checkpointing_disable(), or model.gradient_checkpointing_disable() in "
                "transformers without it) to let adaptmem decide for every block.",
                len(own),
                ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
            )
        else:
            log.warning(
                "adaptmem: the model's own gradient checkpointing is off again for %d block(s); "
                "adaptmem decides for every block",
                len(self.handles) - len(own),
            )

    def _apply(self, record: PlanRecord) -> None:
        for handle, mode in zip(self.handles, record.modes):
            handle.mode = mode
        head = self.head
        if head is not None and record.head is not None:
            head.planned(record.head.mode, record.head.chunk)
            if self.now.open and self.recorder.sample is not None:
                self.recorder.sample.head = record.head
        if record.modes != self._current or record.head != self._current_head:
            self.plan_changes += 1
            self._current, self._current_head = record.modes, record.head
            self.events.emit(
                "plan",
                step=self.steps + 1,
                reason=record.reason,
                batch=record.key[0],
                bucket=record.key[1],
                budget_bytes=self.budget,
                headroom=round(self.decider.headroom, 4),
                predicted_peak_bytes=record.predicted,
                feasible=record.feasible,
                shortfall_bytes=record.shortfall,
                plan={h.name: m.label for h, m in zip(self.handles, record.modes)},
                head=record.head.label if record.head is not None else None,
            )

    def _replan_running_forward(self) -> int:
        """Blocks not yet run in the current forward get a plan for the new budget (with other
        ranks, the next plan point takes it: one rank alone must not change its plan)."""
        state = self.recorder.forward_state()
        if state is None or not self.costs.known or self.policy.static_plan != "none" or self._agree is not None:
            return 0
        batch, extent, start, done = state
        if len(done) >= len(self.handles):
            return 0
        record = self.plans.make(
            self.plans.bucket(batch, extent), start, self.budget, fixed=done, reason="pressure", extent=extent
        )
        changed = sum(1 for i, h in enumerate(self.handles) if i not in done and h.mode is not record.modes[i])
        self._apply(record)
        return changed

    # -------------------------------------------------------------- steps
    def _after_step(self, sample: StepSample) -> dict:
        calibrating = self.costs.steps_learned <= 1
        observed = sample.peak
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, observed)
        retries = self._reading(self.probe.signals, {}).get("alloc_retries")  # also logs the fragmentation hint
        retried = retries is not None and self._alloc_retries is not None and retries > self._alloc_retries
        self._alloc_retries = retries
        if self.policy.static_plan != "none" or sample.unmeasured:  # nothing to decide on: hold
            decision = HOLD
        elif self._beyond_any_plan(observed):
            decision = HOLD
            if self.now.predicted is not None and observed > self.now.predicted:
                self.decider.bias = 1.0  # the predictions were not too high after all
        else:
            ratio = observed / self.budget if self.budget else 0.0
            if self._agree is not None:  # every decider moves alike: on the worst rank's ratio
                ratio = self._agree.worst(max(ratio, 2.0 if retried else 0.0))
            decision = self.decider.update(ratio * self.budget, self.budget)
            if retried and decision != ESCALATE and self._agree is None:
                decision = self.decider.escalate()  # the allocator had to free and retry: close to an OOM
        self.decisions[decision] += 1
        pred, error = (None, None) if sample.overlapped else (self.now.predicted, None)
        if pred is not None and observed > 0:
            error = (pred - observed) / observed
            self.errors.append(error)
        rebias = False
        if (
            pred is not None
            and decision == HOLD
            and not (calibrating or sample.unmeasured)
            and observed > self.now.start
        ):
            # aim again with the predictions' bias taken out
            rebias = self.decider.learn_bias(pred - self.now.start, observed - self.now.start)
        missed = pred is not None and abs(pred - observed) > self.policy.replan_tolerance * self.budget
        if decision == ESCALATE:  # the next step has something to teach: measure it block by block
            self.measuring.again()
        elif missed:
            self.measuring.missed(self.now.key)
        # a first offload's time is cold (it allocated its host memory): a replan that is not for
        # memory waits one step, so the plan runs again and is remade from the warm reading
        if (
            self.costs.provisional
            and decision != ESCALATE
            and not calibrating
            and (decision != HOLD or missed or rebias)
        ):
            self._replan_when_warm = True
        elif decision != HOLD or calibrating or rebias or self._replan_when_warm:
            self.plans.cache.clear()
            self._replan_when_warm = False
        elif missed:
            self.plans.cache.pop(self.now.key, None)
        self.plans.succeeded()
        self._attempts = []
        relief = self.budgets.relieve(self._reading(self.budgets.available, None))
        if relief is not None:
            self.plans.cache.clear()
            self.events.emit("relief", step=self.steps, budget_bytes_before=relief[0], budget_bytes=relief[1])
        return self.events.emit(
            "step",
            step=self.steps,
            label=self.now.label,
            rank=self._rank,
            attempt=self.plans.attempt,
            batch=sample.batch,
            seq=sample.seq,
            tokens=sample.tokens,
            sample_elements=sample.extent,
            predicted_peak_bytes=pred,
            observed_peak_bytes=observed,
            budget_bytes=self.budget,
            capacity_bytes=self.budgets.capacity,
            external_bytes=self._reading(self.probe.external, None),
            host_bytes=sum(b.host for b in sample.blocks),
            prediction_error=error,
            decision=decision,
            headroom=round(self.decider.headroom, 4),
            alloc_retries=retries,
            plan=[sample.plan.get(i, h.mode).label for i, h in enumerate(self.handles)],
            head=sample.head.label if sample.head is not None else None,
            plan_counts=dict(Counter(m.label for m in sample.plan.values())),
            seconds=round(sample.seconds, 6),
            measured="blocks" if sample.detailed else "peak",
        )

    def _beyond_any_plan(self, observed: float) -> bool:
        """The step ran the tightest plan there is, as none was predicted to fit, and its peak
        was not calm: the decider leaves it out. No headroom makes this input fit (it was warned
        of), and lowering it for this step's overshoot would only leave the budget unused at the
        sizes that do fit, and, with such inputs coming back, never relax again (the calm
        steps between them would start over at each). A wrong prediction is learned from by
        measuring (a new size is measured; a missed prediction is measured again). Alone, not
        with other ranks, whose deciders must move alike."""
        return not self.now.feasible and self._agree is None and observed >= self.policy.low_watermark * self.budget

    def _record_oom(self, err: BaseException, sample: StepSample | None) -> dict:
        self.ooms += 1
        self.measuring.again()
        self.decider.after_oom()
        self._reading(self._tick, None)  # the device may have less free than we thought: read it now
        self.plans.cache.clear()
        ran = sample is not None and bool(sample.blocks)
        executed = tuple(sample.plan.get(i, h.mode) for i, h in enumerate(self.handles)) if ran else ()
        if ran:  # a plan was running: the retry must not run it again
            self.plans.failure(executed, sample.head, (sample.batch, sample.extent), foreseen=not self.now.feasible)
        self._last_failure = failure_record(
            err,
            sample,
            executed,
            self.now.predicted or 0,
            self.budget,
            self.decider.headroom,
            self._reading(self.budgets.available, None),
        )
        self._attempts.append(dict(self._last_failure))
        return self.events.emit(
            "oom", step=self.steps + 1, label=self.now.label, attempt=self.plans.attempt, **self._last_failure
        )

    def _free_after_oom(self) -> None:
        gc.collect()
        if isinstance(self.probe, CudaProbe) and self.policy.empty_cache_on_oom:
            torch.cuda.empty_cache()

    def _reading(self, read: Any, default: Any) -> Any:
        """`read()`, or `default` when the probe behind it fails (counted and logged with the recorder's)."""
        return self.recorder.probe.read(read.__name__, read, default)

    # ------------------------------------------------------------ pressure
    def _tick(self) -> None:
        """Background thread: shrink the budget at once when others take memory."""
        available = self.budgets.available()
        if available is not None and available < self.budgets.current:  # confirmed by a second reading
            available = max(available, self.budgets.available())
        with self._lock:
            squeezed = self.budgets.squeeze(available)
            if squeezed is None:
                return
            self.plans.cache.clear()
            replanned = self._replan_running_forward()
            others = getattr(self.probe, "processes", None)  # who took the memory (NVML, on CUDA)
            self.events.emit(
                "pressure",
                step=self.steps + 1,
                external_bytes=self.probe.external(),
                budget_bytes_before=squeezed[0],
                budget_bytes=squeezed[1],
                replanned_blocks=replanned,
                processes=others() if others is not None else None,
            )
            self.pressure_events += 1  # last: whoever waits on it sees the whole reaction
