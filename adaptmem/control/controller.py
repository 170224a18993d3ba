"""The controller: per step, read the device, plan, apply, record, learn and decide.

One step's data flow, from `begin_step` to `end_step`:

  begin     `begin_step`: the step's record opens (`StepState`), the recorder starts
            reading, and a new batch's `Trace` is taken (what a batch given up puts back)
  read      `block_start` of the first managed block: the live input's shape and what
            is allocated now (`_plan_forward`)
  plan      the plan book's plan for that shape under the budget in force (cached per
            shape bucket; made by the planner from the cost model)
  apply     every block's mode, and the loss head's, set before the block runs
  record    the blocks run; the recorder reads the probe at their boundaries
  end       `end_step`: the cost model learns from the step (if it was measured block by
            block), the decider holds, escalates or relaxes on its peak, and the step's
            record goes to the log (`_after_step`); an OOM is recorded instead (`_record_oom`)

`run` wraps that in the retry loop `run_step` gives users. The background thread
calls `tick`: when others take memory the budget shrinks at once and the blocks
not yet run get a tighter plan.

Every collaborator keeps its own state and is changed only through its methods:
the budget keeper (`budgets`), the event log (`events`), the managed blocks and
the plan in force (`blocks`), the recorder, the cost model (`costs`), the decider,
the plan book (`plans`), the lengths seen (`lengths`), the measuring schedule
(`measuring`), the ranks (`ranks`), the retry guard (`retries`), the run's
statistics (`stats`) and the warnings given once (`notices`).
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from adaptmem.config.policy import Policy
from adaptmem.control.agreement import Ranks
from adaptmem.control.blocks import ManagedBlocks
from adaptmem.control.budgeting import BudgetKeeper
from adaptmem.control.costs import CostModel
from adaptmem.control.coverage import guessed_in, measured_kinds
from adaptmem.control.decisions import ESCALATE, HOLD, Decider
from adaptmem.control.events import EventLog
from adaptmem.control.headcosts import KEPT, HeadCosts
from adaptmem.control.loops import LoopFinder, longer_calls
from adaptmem.control.notices import Notices, own_checkpointing
from adaptmem.control.plans import RETRY_STEP, PlanBook, PlanRecord
from adaptmem.control.priors import priors_for
from adaptmem.control.reach import GivenUp, LengthsSeen, Reach, Reacher, gradient_bytes
from adaptmem.control.recorder import StepRecorder
from adaptmem.control.retry import (
    HEAD,
    RetryGuard,
    StepOutOfMemoryError,
    failure_phase,
    failure_record,
    lacked,
    rng_state,
    set_rng_state,
)
from adaptmem.control.samples import InputShape, StepSample, StepState, shape_of
from adaptmem.control.schedule import MeasureSchedule
from adaptmem.control.stats import RunStats
from adaptmem.control.unfit import Lesson, Trace, below_floor, refusal, unfittable
from adaptmem.devices.cuda import CudaProbe
from adaptmem.devices.engine import release_failed_backward
from adaptmem.devices.host import HostProbe
from adaptmem.modes import HeadMode, Mode
from adaptmem.registrations import parameters_of
from adaptmem.strategies.head import LogitsNotMaterializedError
from adaptmem.wrapping import BlockHandle, HeadHandle, loop_owner, repeat_calls, unwrap
from adaptmem.wrapping.selection import block_kind, class_name


class Controller:
    """Decides, step by step, the mode each managed block runs in; the observer of its blocks.

    `user_modes`: the modes the user set before managing (the plan before anything is learned),
    or None (calibrate: every block checkpointed). `ddp`: the model's DDP wrapper, if any.
    """

    def __init__(
        self,
        model: nn.Module,
        handles: list[BlockHandle],
        head: HeadHandle | None,
        *,
        policy: Policy,
        probe: Any,
        budgets: BudgetKeeper,
        events: EventLog,
        in_flight: Callable[[], int],
        user_modes: tuple[Mode, ...] | None,
        ddp: nn.parallel.DistributedDataParallel | None,
    ) -> None:
        self.model, self.policy, self.probe = model, policy, probe
        self.budgets, self.events = budgets, events
        self._in_flight = in_flight
        self._runtime = handles[0].runtime if handles else None
        self._offload = self._runtime.offload if self._runtime is not None else None
        self._take_blocks(handles, head, user_modes)
        # until a step completes: blocks the model calls more than once a forward (`_call_per_block`)
        self.loops: LoopFinder | None = LoopFinder(model, handles) if handles else None
        # the modules whose forward runs blocks in a loop (by name), with those blocks (`loop_owner`)
        self.loop_owners: list[tuple[str, list[int]]] = []
        self._undo_owners: list[Callable[[], None]] = []
        self.ranks = Ranks(ddp)  # with other ranks: one plan for all, retries taken together
        self.retries = RetryGuard()
        self.stats = RunStats()
        self.notices = Notices()
        self.now = StepState()  # the step in hand, from begin_step to end_step
        self._run_rng: tuple | None = None  # the RNG states `run` took as its batch began
        self._batch_traced = False  # inside `run`: its batch's trace is taken (`begin_step`)
        self.lock = threading.RLock()
        self._replan_when_warm = False  # a replan waits for the warm reading of a first offload
        self.forwards = 1  # forwards the last step ran before its backward (kept in the state)
        self._alloc_retries: int | None = None  # the CUDA allocator's retry count after the last step

    def _take_blocks(self, handles: list[BlockHandle], head: HeadHandle | None, user_modes: tuple | None) -> None:
        """The collaborators that know the blocks, made for `handles`: what they learned of others is
        not theirs (a model whose calls became blocks of their own calibrates them from the start)."""
        p, probe = self.policy, self.probe
        self.blocks = ManagedBlocks(handles, head)
        orders = [h.order for h in handles]
        self.recorder = StepRecorder(probe, self._in_flight, len(handles) - 1, self._runtime, orders)
        cuda = isinstance(probe, CudaProbe)
        self.costs = CostModel(
            [class_name(h.module) for h in handles],
            p,
            cuda=cuda,
            priors=priors_for(probe, cuda, [h.offload_options for h in handles]),
            weight_grad_bytes=weight_grad_bytes(handles),
            head_costs=HeadCosts(head.vocab, head.hidden, head.weight_bytes, cuda=cuda) if head is not None else None,
            calls=orders,
            kinds=[block_kind(h.module) for h in handles],
        )
        self.decider = Decider(p)
        self.plans = PlanBook(
            len(handles),
            p,
            self.costs,
            self.decider,
            probe,
            start_plan=user_modes,
            one_memory=isinstance(probe, HostProbe),
        )
        self.plans.user_budget = lambda: self.budgets.user  # its warnings tell pressure's budget from the user's
        self.user_modes = user_modes
        self.lengths = LengthsSeen()  # what `longest_sequence` extrapolates from
        self.measuring = MeasureSchedule(p, self.costs)  # which steps are measured block by block
        self.lesson: Lesson | None = None  # what the last batch given up after running out of memory taught
        self.given_up: list[GivenUp] = []  # batches given up: answers are bound by them

    # ------------------------------------------------------------ the step
    def begin_step(self, label: Any = None, *, by_a_block: bool = False) -> None:
        """begin: open the step's record and start reading. `by_a_block`: opened as a block's call
        began a second micro-batch, whose calls count from that one."""
        self._check_own_checkpointing()
        with self.lock:
            if self._runtime is not None:
                if not by_a_block:
                    self._runtime.epoch += 1  # a module called more than once a forward counts its calls anew
                self._runtime.longer.clear()
                self._runtime.past = None
            if self.loops is not None:
                self.loops.begin()
            # a new batch: not a retry of one that ran out of memory, nor (inside `run_step`) an attempt or
            # micro-step after its first (an attempt that ran out before its blocks records no failed plan)
            if self.plans.failed is None and not self._batch_traced:
                self.retries.new_batch(self.trace())
                self._batch_traced = self._run_rng is not None
            # inside `run_step` its guard's (every generator, taken as the batch began: each attempt and
            # micro-step of it starts from there, or is put back there), else torch's own, taken now
            self.now = StepState(open=True, label=label, rng=self._run_rng or rng_state())
            if (head := self.blocks.head) is not None:
                self.now.head_calls = (head.calls, head.chunked_calls, head.armings)
            self.ranks.begin_attempt(self.model, self.blocks.handles, self.policy)
            if self.ranks.sharded is not None:
                self.costs.pin_seen_bytes()  # its blocks' bytes hold their gathered parameters
            resident = any(w.grad is not None for w in parameters_of(self.blocks.handles[-1].module))
            self.costs.expect_gradients(resident)  # planned for as it is
            self.recorder.begin(grads_resident=resident)

    def end_step(self, error: BaseException | None = None) -> dict | None:
        """end: learn from the step and decide (`_after_step`), or record its OOM (`_record_oom`)."""
        sample = self.recorder.end()
        self.notices.device_idle(self.probe, sample, self.stats.steps + 1)
        if isinstance(error, LogitsNotMaterializedError) and self.blocks.head is not None:
            if self.plans.head_kept_for is None:
                self.plans.keep_head(str(error).split(". ")[0])
                self.notices.head_kept(self.plans.head_kept_for)
                # the step runs again under run_step, as the same attempt: the record says it did
                self.events.emit(
                    "head_kept", step=self.stats.steps + 1, label=self.now.label, why=self.plans.head_kept_for
                )
        if sample is not None and sample.detailed:
            self.notices.lengths_apart(sample, self.blocks.names)
        refused, self.now.refused = self.now.refused, False
        error = self.ranks.failure(
            error, self.now.plan_point_passed, self.blocks.running, self.plans.failed is not None, refused
        )
        with self.lock:
            self.now.open = False
            if not refused and sample is not None and sample.blocks:
                self.forwards = self.now.forwards
            if refused:  # given up before a block ran: the batch leaves no trace
                self.rewind(self.retries.trace)
                set_rng_state(self.now.rng)
                return None
            if sample is not None and sample.blocks and (error is None or isinstance(error, torch.OutOfMemoryError)):
                self._head_ran(sample, error is None)
            if sample is not None and sample.blocks and sample.detailed and not sample.unmeasured:
                if self.now.alike and 1 < self.now.forwards == self.now.planned_forwards:
                    sample.forwards = self.now.forwards  # its head is learned from them all
                if isinstance(error, torch.OutOfMemoryError):
                    self.retries.trace.before_learning(self.costs, self.lengths)
                self.costs.learn(sample)
                self.lengths.learn(sample, completed=error is None)
            if isinstance(error, torch.OutOfMemoryError):
                return self._record_oom(error, sample)
            if error is None and sample is not None:
                self.lengths.started(sample)
                if self.lesson is not None and self.lesson.passed(sample.batch, sample.seq):
                    self.lesson = None
                self.given_up = [g for g in self.given_up if not g.ran(sample.batch, sample.seq)]
                record = self._after_step(sample)
                if self.loops is not None and sample.blocks:
                    calls, owners = self.loops.calls(), self.loops.owners()
                    self._stop_finding_loops()
                    if calls is not None:
                        self.call_per_block(calls)
                        names = {id(m): n for n, m in unwrap(self.model).named_modules()}
                        self.count_loops([(names[id(m)], orders) for m, orders in owners if id(m) in names])
                elif self._runtime is not None and self._runtime.longer and sample.blocks:
                    self._loop_ran_longer(dict(self._runtime.longer))
                return record
            return None

    def call_per_block(self, calls: list[int], announce: bool = True) -> None:
        """The model calls some blocks more than once in a forward (`calls`: the blocks of one forward's
        calls, by their place among those selected, in the order they ran): each call becomes a block
        of its own, with its own mode, and the blocks are calibrated again from the next step.
        `announce`: say so (a resumed run's blocks are the saved run's, said when it found them); the
        log's `blocks` record names them either way."""
        with self.lock:
            self._stop_finding_loops()
            user = self.user_modes
            if user is not None:  # each call keeps the mode set for it, or for the block's first call
                user = dict(zip(((h.order, h.call) for h in self.blocks.handles), user))
            handles = repeat_calls(self.model, calls)
            if user is not None:
                user = tuple(user.get((h.order, h.call), user[h.order, 0]) for h in handles)
            self._take_blocks(handles, self.blocks.head, user)
            if announce:
                first = {h.order: h.name for h in handles if h.call == 0}
                counts = Counter(h.order for h in handles)
                self.notices.calls_per_block([(first[o], n) for o, n in counts.items() if n > 1], len(handles))
            self.events.emit("blocks", step=self.stats.steps, blocks=[h.name for h in handles])

    def count_loops(self, owners: list[tuple[str, list[int]]]) -> None:
        """Count the calls of blocks run in a loop from each call of the module whose forward runs
        them (`owners`: its name in the model, and the blocks, by order): a forward that runs the loop
        longer is told from a second forward, and its calls past the blocks become blocks too."""
        self.stop_counting_loops()
        modules = dict(unwrap(self.model).named_modules())  # named as the blocks are, without DDP's `module.`
        for name, orders in owners:
            if name in modules:
                self._undo_owners.append(loop_owner(self.model, modules[name], orders))
                self.loop_owners.append((name, list(orders)))

    def stop_counting_loops(self) -> None:
        for undo in self._undo_owners:
            undo()
        self._undo_owners, self.loop_owners = [], []

    def _loop_ran_longer(self, longer: dict[int, int]) -> None:
        """A step ran a loop more times than the blocks have calls (`longer`: the blocks whose calls ran
        past their handles, by order, with their most calls in one forward): the calls become blocks
        again, the loop's added turns with the rest, and are calibrated again."""
        calls = longer_calls([h.order for h in self.blocks.handles], longer)
        if calls is None:
            self.notices.loop_uneven([h.name for h in self.blocks.handles if h.call == 0], longer)
            return
        before = len(self.blocks.handles)
        self.call_per_block(calls, announce=False)
        self.notices.loop_longer(
            [(h.name, n) for h in self.blocks.handles if h.call == 0 and (n := longer.get(h.order))],
            before,
            len(self.blocks.handles),
        )

    def _stop_finding_loops(self) -> None:
        if self.loops is not None:
            self.loops.remove()
            self.loops = None

    def _head_ran(self, sample: StepSample, ended: bool) -> None:
        """The loss head as the step ran it: a head planned CHUNKED that made no chunked logits (a
        Hugging Face model called without `labels=`, its loss the user's own from the logits, or a
        head that cannot chunk) ran KEPT, and is recorded and learned so. While it runs so the plans
        keep it (chunking it would price a saving that never comes).

        A model given `labels=` whose head was never called made its loss from the head's weight
        elsewhere (TRL's fused LM head): that loss's bytes are the step's, learned as a kept head's,
        and no plan chunks it. An attempt that ran out of memory (`ended` False) tells so where it ran
        out after every block's forward with the head never called in any step; else it tells what
        the head ran only where the head was called."""
        head = self.blocks.head
        if head is None:
            return
        before = self.now.head_calls
        calls, chunked, armed = head.calls - before[0], head.chunked_calls - before[1], head.armings - before[2]
        foreign = armed > 0 and calls == 0
        in_head = not ended and foreign and head.calls == 0 and failure_phase(sample, len(self.blocks)) == HEAD
        if not ended and not (calls > 0 or in_head):
            return
        if foreign:
            self.notices.head_bypassed(head.name, type(head.owner).__name__)
        planned = sample.head is not None and sample.head.mode is HeadMode.CHUNKED
        if planned and not chunked:
            sample.head = KEPT
        self.plans.head_chunks(calls > 0 and (chunked > 0 or not planned))

    def abandon_step(self) -> None:
        """Closing with a step open: it ends unrecorded and unlearned."""
        if self.now.open:
            self.recorder.end()
            self.now.open = False

    def run(self, step: Callable[[], Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """`run_step`: run `fn` as one step (`step()` opens and closes it); after an out-of-memory
        error, undo what the attempt changed, free, and run it again under a tighter plan."""
        guard = self.retries.guard(self.model, self.policy.accumulation_snapshot, self.policy.buffer_snapshot_limit)
        self._run_rng = guard.rng
        self.plans.succeeded()  # a new batch: not a retry of whatever failed before
        self.ranks.deferring = True
        try:
            attempt = 0
            while attempt <= self.policy.max_retries:
                self.plans.start_attempt(attempt)
                kept = self.plans.head_kept_for is not None
                try:
                    with step(), self.ranks.no_sync():
                        result = fn(*args, **kwargs)
                except StepOutOfMemoryError as err:  # given up before a block ran: no plan can fit it
                    refused = err.with_traceback(None)  # its frames would keep the forward's tensors alive
                except torch.OutOfMemoryError:
                    refused = None
                except LogitsNotMaterializedError:
                    if kept or self.plans.head_kept_for is None or not self.ranks.alone:
                        raise  # not the chunked head's (it was kept already), or with other ranks
                    guard.restore()  # the head kept from now on (`end_step`): the same attempt again
                    self._batch_traced = False  # from the controller as it keeps the head
                    continue
                else:
                    self.stats.ooms_recovered += attempt
                    self.ranks.average_gradients(p for p in self.model.parameters() if p.requires_grad)
                    return result
                guard.restore()
                if refused is not None:
                    try:
                        raise refused
                    finally:  # else this frame, on the error's traceback, holds the error: a cycle that keeps
                        refused = None  # the error, and the caller's frames (the batch in them), until a collection
                self._free_after_oom()
                self.ranks.catch_up()  # under FSDP2: the rest of the step's collectives, once freed
                attempt += 1
                if self.retries.before_blocks_again():
                    break  # no mode saves memory there, and freeing after the first did not make room
            self._keep_lesson(self.now.shape, self.retries.attempts[-1].get("available_bytes"), self.now.start)
            self.rewind(self.retries.trace)  # every retry failed: the batch leaves no trace either
            compressing = any(m & Mode.COMPRESS for m in self.plans.allowed)
            snapshot = (self.policy.accumulation_snapshot, guard.most_copied)
            raise self.retries.report(self.policy.max_retries, compressing, snapshot, self.plans.head_kept_for)
        finally:
            self._run_rng, self._batch_traced = None, False
            self.ranks.deferring = False
            self.plans.start_attempt(0)
            self.plans.succeeded()
            guard.close()

    # ------------------------------------------------------- observer API
    def block_start(self, handle: BlockHandle, args: tuple, kwargs: dict) -> None:
        now = self.now
        past = self._runtime is not None and self._runtime.past is handle
        if past:
            self._runtime.past = None  # a call past the handles of a loop run longer (`_loop_ran_longer`)
        if (
            now.open
            and (past or (self.loops is not None and self.loops.call(handle.index)))
            and not self.recorder.backward_done
        ):
            # the model calls this block again in the same forward: the step is read for its peak, and
            # each call becomes a block of its own once it ends (`_call_per_block`)
            if not now.looping:
                now.looping = True
                self.recorder.loop(handle.index)
            self.recorder.block_start(handle, args, kwargs)
            return
        if now.open and self.recorder.ran(handle.index):
            self._second_forward(handle.index)
            now = self.now  # a second micro-batch: the step just opened for it
        shape = allocated = None
        if now.open and not self.recorder.forward_started:
            allocated = self._plan_forward(shape := shape_of(args, kwargs))
        elif not now.open and handle.index == 0:
            self.notices.unmarked(self.user_modes is not None)
            self._plan_forward(shape_of(args, kwargs))
        elif now.open and now.overlapping and handle.index == 0:
            now.forwards += 1
            self._plan_second_forward(shape_of(args, kwargs))
        self.recorder.block_start(handle, args, kwargs, shape, allocated)

    def block_end(self, handle: BlockHandle, call: Any, output: Any) -> None:
        self.recorder.block_end(handle, call, output)

    def recompute(self, handle: BlockHandle, begin: bool) -> None:
        self.recorder.recompute(handle, begin)

    # ------------------------------------------------ read, plan and apply
    def _plan_forward(self, shape: InputShape) -> int:
        """Plan the forward about to start with `shape`; returns the probe's allocation, read for it."""
        with self.lock:
            now = self.now
            if (
                now.open
                and self.plans.failed is not None
                and self.plans.failed_shape is not None
                and self.plans.failed_shape != (shape.batch, shape.extent)
            ):
                # a batch that ran out of memory under `step()` was given up, not retried: this is the
                # next one. What the failure taught stays; its retry rules are for that batch only
                self.plans.succeeded()
                self.retries.new_batch(self.trace())
            own = start = self.recorder.probe.allocated()
            batch, extent, budget = shape.batch, shape.extent, self.budget
            if now.open:
                now.shape = shape
            now.planned_forwards = self.forwards if now.open else 1
            if now.open and self.forwards > 1:
                # the step before ran its forward again before its backward (a contrastive loss, two
                # views): this first forward is planned as one of as many samples, so that the next
                # ones, planned for what it leaves, find room
                batch *= self.forwards
            agree = self.ranks.agree is not None and now.open
            if agree:  # every rank plans for the largest shape and allocation, the smallest budget
                self.ranks.plan_point()
                decider = self.decider
                batch, extent, start, budget, decider.bias, decider.agreed_fill = self.ranks.agree.figures(
                    batch, extent, start, budget, decider.bias, decider.own_fill
                )
                if now.open and start >= budget:  # every rank sees it here, and raises
                    raise ValueError(below_floor(start, budget))
                now.plan_point_passed = True
            elif now.open and start >= self.budgets.user:  # under the budget asked, not one others shrank
                self.notices.budget_below_start(start, self.budgets.user)
            self.plans.width = shape.width
            record = self.plans.choose(batch, extent, start, budget)
            if agree:  # and runs rank 0's plan
                modes, head = self.ranks.agree.plan(record.modes, record.head)
                record = replace(record, modes=modes, head=head)
            if now.open:
                self._refuse_unfittable(record, shape, start)
            self.plans.announce_unfit(now.planned_forwards)
            self.apply(record, reason=None if self.plans.fresh else "cached")
            if now.open:
                self.recorder.measure_blocks(self.measuring.worth(record))
                now.key = record.key
                # this rank's own peak under the plan every rank runs: its shape and allocation
                now.predicted = self.plans.predict(record.modes, shape.batch, shape.extent, own, record.head)
                if now.predicted is not None and not getattr(self.recorder.probe.inner, "whole_step_peaks", False):
                    # the step peaks no lower than what ran before its first block did, which no plan
                    # lowers (a teacher's forward in distillation: predicted at the student's 89 MiB
                    # where each step peaked at 111, in the teacher)
                    now.predicted = max(now.predicted, self.recorder.probe.peak())
                now.feasible = record.feasible
                now.start = own
            return own

    def apply(self, record: PlanRecord, reason: str | None = None) -> None:
        """Set the blocks' modes and the head's choice; a changed plan is counted and logged (under
        `reason`, else the record's own)."""
        if self.now.open and record.head is not None:
            self.recorder.planned_head(record.head)
        if not self.blocks.apply(record.modes, record.head):
            return
        self.stats.plan_changes += 1
        self.events.emit(
            "plan",
            step=self.stats.steps + 1,
            reason=reason or record.reason,
            batch=record.key[0],
            bucket=record.key[1],
            budget_bytes=self.budget,
            headroom=round(self.decider.headroom, 4),
            predicted_peak_bytes=record.predicted,
            feasible=record.feasible,
            shortfall_bytes=record.shortfall,
            plan=dict(zip(self.blocks.names, (m.label for m in record.modes))),
            head=record.head.label if record.head is not None else None,
        )

    def _guess_untried(self, modes: tuple[Mode, ...]) -> bool:
        """Some block of `modes` runs a mode its kind has not run, priced by a guess that errs high, no
        attempt of this step has run that mode yet, and each ran out of memory in backward: the plan
        runs once, however far over the guess reads. A Glm4Moe's recomputing plan ran out in backward,
        where its experts ran again, and OFFLOAD, guessed at 93 MiB on a 39 MiB stand-in, trained the
        batch at 34. An attempt that ran out in forward, where every mode runs the blocks alike, shows
        the batch too large for any (a mode an attempt ran that failed all the same had its chance)."""
        attempts = self.retries.attempts
        if not attempts or any(a.get("phase") != "backward" for a in attempts):
            return False
        ran = {m for plan, _ in self.plans.tried for m in plan}
        return bool(guessed_in(self.costs, modes) - ran)

    def _refuse_unfittable(self, record: PlanRecord, shape: InputShape, start: int) -> None:
        """Give the step up before a block runs when no plan can fit it (see `adaptmem.control.unfit`).
        With other ranks, only a retry's verdict counts, and all give up when one does. A plan predicted
        to fit, and not a retry's, is let through before reading the device (every step comes here),
        but where a batch no larger was given up before (`_given_up_before`)."""
        agree, attempts = self.ranks.agree, self.retries.attempts
        if agree is not None:
            if self.plans.failed is None:
                return
        elif record.feasible and not record.exhausted and not any(g.covers(shape) for g in self.given_up):
            return
        available = self.reading(self.budgets.available, None)
        then = attempts[-1].get("available_bytes") if attempts else None
        # others have freed memory since the last attempt failed: the tightest plan is worth running again
        lifted = available is not None and then is not None and available > then + RETRY_STEP * self.budget
        elsewhere = False
        before = None if attempts else self._given_up_before(shape, available, start)
        if agree is not None:
            mine = record.exhausted and not lifted
            if not agree.any(mine):
                return
            elsewhere = not mine  # another rank's verdict: every rank gives the batch up
        elif not (
            (record.exhausted and not lifted)
            or before is not None
            or unfittable(
                record,
                start,
                available,
                self.costs.measured(shape.batch, shape.extent),
                self.costs.ran_here(record.modes, shape.batch, shape.extent),
                self._guess_untried(record.modes),
            )
        ):
            return
        predicted = record.predicted
        if predicted is None:
            predicted = self.plans.predict(record.modes, shape.batch, shape.extent, start, record.head)
        self._keep_lesson(shape, available, start)
        message = refusal(
            record,
            shape.batch,
            shape.extent,
            shape.seq if shape.width else 0,
            start,
            attempts,
            predicted=predicted,
            budget=self.budget,
            limit=available,
            longest=lambda batch: self._without_this_batch(lambda reacher: reacher.longest(batch)),
            largest=(
                (lambda seq: self._without_this_batch(lambda reacher: reacher.largest_batch(seq)))
                if shape.width and self.lengths.one_length == shape.seq  # every step ran at this length
                else None
            ),
            elsewhere=elsewhere,
            before=before,
            failed_here=(record.modes, record.head) in self.plans.tried,
            head_kept_for=self.plans.head_kept_for,
            head_lacked=self.plans.head_short[2] if self.plans.head_short is not None else None,
        )
        self.now.refused = True
        self.events.emit(
            "refused",
            step=self.stats.steps + 1,
            label=self.now.label,
            batch=shape.batch,
            seq=shape.seq,
            sample_elements=shape.extent,
            predicted_peak_bytes=record.predicted,
            floor_bytes=start,
            budget_bytes=self.budget,
            exhausted=record.exhausted,
            attempts=len(attempts),
        )
        raise StepOutOfMemoryError(message, list(attempts))

    def _second_forward(self, index: int) -> None:
        """A block runs a second time in one step. After the first forward's backward, it is
        a second micro-batch: the step is closed and another opened with the same label.
        Before it (two forwards, then one backward), it is a second forward of the step
        (`_plan_second_forward`), and a step measured block by block teaches its first forward's
        blocks (and, where its forwards ran alike, its head at their samples)."""
        if self.recorder.backward_done:
            label = self.now.label
            self.end_step()
            self.begin_step(label, by_a_block=True)
            return
        if not self.now.overlapping:
            self.now.overlapping = True
            self.recorder.overlap(index)
            if self.now.planned_forwards == 1:  # not foretold by the step before (nor a resumed state)
                self.notices.overlap()

    def _plan_second_forward(self, shape: InputShape) -> None:
        """A forward after the first, before the backward. Where the first forward's plan was made
        for it too (the step before ran as many), it runs that plan, whose prediction, made again
        for both forwards' samples, is the step's. Else it is planned for what the first leaves free
        (not cached: a lone forward of this shape starts with more room), but with other ranks,
        where it runs the plan the ranks agreed on for the first: a plan of one rank's own could
        differ from the others', whose re-gathers under FSDP2 it would leave waiting."""
        with self.lock:
            now, first = self.now, self.recorder.sample
            planned = now.forwards <= now.planned_forwards  # the first forward's plan was made for this one
            same = first is not None and (first.batch, first.extent) == (shape.batch, shape.extent)
            now.alike = now.alike and planned and same
            if not planned and self.ranks.alone:
                start = self.probe.allocated()
                bucket = self.plans.bucket(shape.batch, shape.extent)
                record = self.plans.make(
                    bucket, start, self.budget, fixed={}, reason="second forward", extent=shape.extent
                )
                self.plans.announce_unfit()
                self.apply(record)
            elif planned and now.predicted is not None:
                now.predicted = self.plans.predict(
                    self.blocks.modes, shape.batch * now.forwards, shape.extent, now.start, self.blocks.head_choice
                )
            now.later_plans.append([m.label for m in self.blocks.running()])

    def _replan_running_forward(self) -> int:
        """Blocks not yet run in the current forward get a plan for the new budget (with other
        ranks, the next plan point takes it: one rank alone must not change its plan)."""
        state = self.recorder.forward_state()
        if state is None or not self.costs.known or self.policy.static_plan != "none" or not self.ranks.alone:
            return 0
        batch, extent, start, done = state
        if len(done) >= len(self.blocks):
            return 0
        record = self.plans.make(
            self.plans.bucket(batch, extent), start, self.budget, fixed=done, reason="pressure", extent=extent
        )
        self.plans.announce_unfit()
        running = self.blocks.running()
        changed = sum(1 for i, mode in enumerate(running) if i not in done and mode is not record.modes[i])
        self.apply(record)
        if changed and self.now.open:  # the step is predicted as it runs: the blocks run so far, the rest replanned
            self.now.predicted = self.plans.predict(record.modes, batch, extent, self.now.start, record.head)
        return changed

    # ------------------------------------------------ learn and decide
    def _after_step(self, sample: StepSample) -> dict:
        calibrating = self.costs.steps_learned <= 1
        observed = sample.peak
        retries = self.reading(self.probe.signals, {}).get("alloc_retries")  # also logs the fragmentation hint
        retried = retries is not None and self._alloc_retries is not None and retries > self._alloc_retries
        self._alloc_retries = retries
        decision = self._decide(sample, retried, calibrating)
        pred, error = self._step_predicted(sample), None
        if pred is not None and observed > 0:
            error = (pred - observed) / observed
        self.stats.stepped(observed, decision, error, observed > self.budget)
        self._ran(sample)
        self._learn_from(sample, decision, pred, calibrating)
        self.plans.succeeded()
        self.retries.succeeded()
        # only a budget squeezed by others has anything to give back: read what they left then alone
        relief = self.budgets.relieve(self.reading(self.budgets.available, None)) if self.budgets.squeezed else None
        if relief is not None:
            self.plans.forget()
            self.events.emit("relief", step=self.stats.steps, budget_bytes_before=relief[0], budget_bytes=relief[1])
        plan, counts = self.blocks.described(sample.plan)
        if pred is not None and pred <= self.budget < observed and not calibrating:
            self.notices.over_budget(
                self.stats.steps,
                observed,
                self.budget,
                pred,
                ", ".join(f"{m} x{n}" for m, n in counts.items()),
                self.stats.over_budget,  # this step counted
            )
        return self.events.emit(
            "step",
            step=self.stats.steps,
            label=self.now.label,
            rank=self.ranks.rank,
            attempt=self.plans.attempt,
            batch=sample.batch,
            seq=sample.seq,
            tokens=sample.tokens,
            sample_elements=sample.extent,
            predicted_peak_bytes=pred,
            observed_peak_bytes=observed,
            budget_bytes=self.budget,
            user_budget_bytes=self.budgets.user,
            capacity_bytes=self.budgets.capacity,
            external_bytes=self.budgets.external,
            host_bytes=sample.host_bytes,
            prediction_error=error,
            decision=decision,
            headroom=round(self.decider.headroom, 4),
            alloc_retries=retries,
            plan=plan,
            forward_plans=[plan, *self.now.later_plans] if self.now.later_plans else None,
            head=sample.head.label if sample.head is not None else None,
            plan_counts=counts,
            seconds=round(sample.seconds, 6),
            measured="blocks" if sample.detailed else "peak",
        )

    def _ran(self, sample: StepSample) -> None:
        """Tell the plans what ran this step's shape to its end, and its peak (`PlanBook.ran`): one
        forward, each block once, its peak read (alone: with other ranks the plan is theirs too)."""
        n, now = len(self.blocks), self.now
        if now.forwards != 1 or sample.overlapped or sample.unmeasured or len(sample.plan) != n or not self.ranks.alone:
            return
        modes = tuple(sample.plan[i] for i in range(n))
        self.plans.ran(
            (sample.batch, sample.extent), sample.grads_resident, modes, sample.head, sample.peak - now.start
        )

    def _step_predicted(self, sample: StepSample) -> float | None:
        """The step's predicted peak, where a plan made for the step as it ran predicted it: not
        where a forward ran that the first forward's plan was not made for (the first step with
        two before its backward, which planned the second for what the first left; a block run
        twice in one forward), nor in one forward planned for several (the step before ran them)."""
        now = self.now
        if now.forwards != now.planned_forwards or (sample.overlapped and now.forwards == 1):
            return None
        return now.predicted

    def _decide(self, sample: StepSample, retried: bool, calibrating: bool) -> str:
        """Hold, escalate, relax or recover, on the step's peak against the budget (noting first how
        far it landed from where the plan aimed it)."""
        observed, now = sample.peak, self.now
        if self.policy.static_plan != "none" or sample.unmeasured:  # nothing to decide on: hold
            return HOLD
        if self._step_predicted(sample) is not None and not calibrating and observed > now.start:
            if self.decider.note_miss(now.predicted - now.start, observed - now.start, self.budget):
                self.plans.forget()  # they aimed at the fill as it was
        if self._beyond_any_plan(observed):
            if now.predicted is not None and observed > now.predicted:
                self.decider.forget_bias()  # the predictions were not too high after all
            return HOLD
        ratio = observed / self.budget if self.budget else 0.0
        agree = self.ranks.agree
        if agree is not None:  # every decider moves alike: on the worst rank's ratio
            ratio = agree.worst(max(ratio, 2.0 if retried else 0.0))
        decision = self.decider.update(ratio * self.budget, self.budget)
        if retried and decision != ESCALATE and agree is None:
            decision = self.decider.escalate()  # the allocator had to free and retry: close to an OOM
        return decision

    def _learn_from(self, sample: StepSample, decision: str, pred: float | None, calibrating: bool) -> None:
        """What the step's verdict changes: the predictions' bias, which steps are measured next, and
        which cached plans are made again."""
        observed, now = sample.peak, self.now
        rebias = False
        if pred is not None and decision == HOLD and not (calibrating or sample.unmeasured) and observed > now.start:
            # aim again with the predictions' bias taken out
            rebias = self.decider.learn_bias(pred - now.start, observed - now.start)
        # a step of several forwards is predicted as one forward of all their samples, a shape no step
        # measures (each forward is measured alone): measuring it again would not teach its figures
        missed = (
            pred is not None and now.forwards == 1 and abs(pred - observed) > self.policy.replan_tolerance * self.budget
        )
        if decision == ESCALATE:  # the next step has something to teach: measure it block by block
            self.measuring.again()
        elif missed:
            self.measuring.missed(now.key)
        # a first offload's time is cold (it allocated its host memory): a replan that is not for
        # memory waits one step, so the plan runs again and is remade from the warm reading
        if (
            self.costs.provisional
            and decision != ESCALATE
            and not calibrating
            and (decision != HOLD or missed or rebias)
        ):
            self._replan_when_warm = True
        elif decision != HOLD or calibrating or self._replan_when_warm:
            self.plans.forget()
            self._replan_when_warm = False
        else:
            if rebias:
                self.plans.rebiased(self.budget)
            if missed:
                self.plans.forget(now.key)

    def _beyond_any_plan(self, observed: float) -> bool:
        """The step ran the tightest plan there is, as none was predicted to fit, and its peak
        was not calm: the decider leaves it out. No headroom makes this input fit (it was warned
        of), and lowering it for this step's overshoot would only leave the budget unused at the
        sizes that do fit, and, with such inputs coming back, never relax again (the calm
        steps between them would start over at each). A wrong prediction is learned from by
        measuring (a new size is measured; a missed prediction is measured again). Alone, not
        with other ranks, whose deciders must move alike."""
        return not self.now.feasible and self.ranks.alone and observed >= self.policy.low_watermark * self.budget

    def _record_oom(self, err: BaseException, sample: StepSample | None) -> dict:
        # before memory is read: what the failed backward left queued in autograd's engine
        release_failed_backward({p.device for p in self.model.parameters()})
        self.stats.ooms += 1
        self.measuring.again()
        self.decider.after_oom()
        self.reading(self.tick, None)  # the device may have less free than we thought: read it now
        self.plans.forget()
        ran = sample is not None and bool(sample.blocks)
        running = self.blocks.running()
        executed = tuple(sample.plan.get(i, mode) for i, mode in enumerate(running)) if ran else ()
        if ran:  # a plan was running: the retry must not run it again
            short = None
            if failure_phase(sample, len(self.blocks)) == HEAD and (need := lacked(err)) is not None:
                short = (sum(b.held for b in sample.blocks), need)  # what the blocks held as it ran out there
            self.plans.failure(
                executed, sample.head, (sample.batch, sample.extent), foreseen=not self.now.feasible, in_head=short
            )
        record = failure_record(
            err,
            sample,
            executed,
            self.now.predicted or 0,
            self.budget,
            self.decider.headroom,
            self.reading(self.budgets.available, None),
            len(self.blocks),
        )
        self.retries.failed(record)
        return self.events.emit(
            "oom", step=self.stats.steps + 1, label=self.now.label, attempt=self.plans.attempt, **record
        )

    def _free_after_oom(self) -> None:
        gc.collect()
        if self._offload is not None:  # the failed attempt's copies still in flight
            self._offload.settle()
        if isinstance(self.probe, CudaProbe) and self.policy.empty_cache_on_oom:
            torch.cuda.empty_cache()

    def _check_own_checkpointing(self) -> None:
        """The model's own gradient checkpointing (Hugging Face's `gradient_checkpointing`),
        switched on or off since the last step: it decides for its blocks, which run in NONE."""
        changed = self.blocks.own_checkpointing()
        if changed is None:
            return
        own, added = changed
        names = [self.blocks.names[i] for i in sorted(own)]
        with self.lock:
            self.plans.pin({i: Mode.NONE for i in own})
            self.events.emit("own_checkpointing", step=self.stats.steps + 1, blocks=names)
        own_checkpointing(names, bool(added), len(self.blocks) - len(own))

    # ------------------------------------------------------------ pressure
    @property
    def budget(self) -> int:
        return self.budgets.current

    def tick(self) -> None:
        """Background thread: shrink the budget at once when others take memory."""
        available = self.budgets.available()
        if available is not None and available < self.budgets.current:  # confirmed by a second reading
            available = max(available, self.budgets.available())
        with self.lock:
            squeezed = self.budgets.squeeze(available)
            if squeezed is None:
                return
            self.plans.forget()
            replanned = self._replan_running_forward()
            others = getattr(self.probe, "processes", None)  # who took the memory (NVML, on CUDA)
            self.events.emit(
                "pressure",
                step=self.stats.steps + 1,
                external_bytes=self.probe.external(),
                budget_bytes_before=squeezed[0],
                budget_bytes=squeezed[1],
                replanned_blocks=replanned,
                processes=others() if others is not None else None,
            )
            self.stats.pressure_events += 1  # last: whoever waits on it sees the whole reaction

    def set_budget(self, value: int) -> None:
        """The user's new budget, in force from the next block to run."""
        with self.lock:
            before, after = self.budgets.set_user(value, self.budgets.available())
            self.plans.forget()
            replanned = self._replan_running_forward()
            self.events.emit(
                "budget",
                step=self.stats.steps + 1,
                budget_bytes_before=before,
                budget_bytes=after,
                user_budget_bytes=value,
                replanned_blocks=replanned,
            )

    def reading(self, read: Any, default: Any) -> Any:
        """`read()`, or `default` when the probe behind it fails (counted and logged with the recorder's)."""
        return self.recorder.probe.read(read.__name__, read, default)

    # ------------------------------------------------ reach, trace and rewind
    def reacher(self, limit: int | None) -> Reacher:
        """Answers to "how long can I go?" under `limit` bytes (None: the device's usable size)."""
        fits = self.budgets.available() if limit is None else limit
        with self.lock:
            allocated = gradients = 0  # inside a step: what its start was
            if not self.now.open:  # between steps: the device as the next step finds it
                allocated = self.probe.allocated()
                gradients = gradient_bytes(self.model, "cuda" if isinstance(self.probe, CudaProbe) else "cpu")
            reacher = self.lengths.reacher(
                self.costs, self.plans, self.budgets.user if fits is None else fits, allocated, self.lock, gradients
            )
            reacher.given_up = [g for g in self.given_up if g.room is None or reacher.limit <= g.room]
            return reacher

    def trace(self) -> Trace:
        """What a batch given up puts back: the learned and deciding state as it is now."""
        return Trace(
            self.decider.state_dict(),
            self.plans.snapshot(),
            self.measuring.copy(),
            self.blocks.modes,
            self.blocks.head_choice,
            self._replan_when_warm,
        )

    def answer(self, limit: int | None, ask: Callable[[Reacher], Reach], *, asked: bool = False) -> Reach:
        """ "How long can I go?" (`ask`, of a `Reacher` under `limit`): the cost model's answer, and
        where a batch was given up after running out of memory, the smaller of it and the answer
        of the model as that batch's failed attempts left it (`Lesson`). `asked`: by the user (the
        next steps try the modes the answer counted by a guess), not for a message or the log."""
        now = ask(self.reacher(limit))
        lesson = self.lesson
        if lesson is not None:
            with self._learned_as(lesson.costs, lesson.lengths):
                then = ask(self.reacher(limit))
            now = then if then.tokens < now.tokens else now
        return self._untried(now, asked)

    def _untried(self, reach: Reach, asked: bool) -> Reach:
        """`reach`, naming the modes the answer counted by a guess (no block has run them: their figures
        are made to err high, so the answer may be short); with the policy's `try_modes`, the next plans
        try them on a block even where every block is in its fastest mode (`PlanBook.trials_asked`)."""
        modes = self.plans.unmeasured()
        if not modes:
            return reach
        trying = self.policy.try_modes
        if trying and asked:
            with self.lock:
                self.plans.trials_asked = True  # a cached plan with every block in NONE is made again
        # where blocks of one kind ran a mode and of another not (a BLIP's vision layers and its text
        # layers), the classes yet to run it are named: "not measured on this model's blocks" read wrong
        kinds, on = self.costs.kinds, set()
        for mode in modes:
            measured = measured_kinds(self.costs, mode)
            if measured:
                on |= {
                    class_name(handle.module)
                    for i, handle in enumerate(self.blocks.handles)
                    if i not in self.plans.pinned and kinds[i] not in measured
                }
        untried = tuple(m.label for m in modes)
        return replace(reach, untried=untried, trying=trying, untried_on=tuple(sorted(on)))

    @contextmanager
    def _learned_as(self, costs: tuple, lengths: dict) -> Iterator[None]:
        """The cost model and lengths as in `costs` and `lengths` for a while, then as they are now."""
        with self.lock:
            now = self.costs.snapshot(), self.lengths.state_dict()
            self.costs.restore(costs)
            self.lengths.load_state_dict(lengths)
            try:
                yield
            finally:
                self.costs.restore(now[0])
                self.lengths.load_state_dict(now[1])

    def _given_up_before(self, shape: InputShape, available: int | None, start: int) -> GivenUp | None:
        """A batch given up earlier in the run, of as many samples or fewer and as long or shorter, with
        as much room then as now or more above what its step held as its first block started: this
        one, no smaller, is given up before it runs. A MiniMax's 1 x 1,536 batch, given up once the
        user's copies of the weights and optimizer state held 5.8 MiB more than when it had trained,
        ran its four attempts out of memory again at each batch of that length after it."""
        if available is None:
            return None
        for g in self.given_up:  # `covers` holds a shape without a sequence (no width) to none
            if g.free is not None and available - start <= g.free and g.covers(shape):
                return g
        return None

    def _keep_lesson(self, shape: InputShape | None, available: int | None, start: int) -> None:
        """A batch is given up: no answer names its shape again (with no more room than `available`, the
        device's usable bytes then), nor does a step of it run again with no more room above its `start`;
        where it ran out of memory, keep what its attempts taught (`Lesson`)."""
        if shape is None or not shape.width:
            return
        # a step of as many samples or more that ran to its end before stays an answer (a Gemma 3 that had
        # trained 2 x 5,293 tokens at the limit was answered 5,239 after 2 x 5,822 was given up)
        trained = max(
            (e // shape.width for b, e, _ in self.plans.ran_at if b >= shape.batch and e < shape.extent), default=0
        )
        free = available - start if available is not None else None
        if not any(
            (g.batch, g.length, g.room, g.free) == (shape.batch, shape.seq, available, free) for g in self.given_up
        ):
            self.given_up.append(GivenUp(shape.batch, shape.seq, available, trained, free))
        trace = self.retries.trace
        if trace is None or trace.costs is None:
            return
        try:
            longest = self.reacher(None).longest(shape.batch).length
        except Exception:  # a prediction must never hide the error it comes with
            longest = 0
        self.lesson = Lesson(self.costs.snapshot(), self.lengths.state_dict(), shape.batch, shape.seq, longest)

    def _without_this_batch(self, ask: Callable[[Reacher], Reach]) -> Reach:
        """The answer to `ask` once the batch refused leaves no trace: from the cost model as it was
        before the batch first ran out of memory, and no longer than what the failed attempts taught
        allows (`answer`). (From what the failed attempt taught alone, a refusal named 1,245 tokens,
        and `longest_sequence` 2,089 right after it.)"""
        before = self.retries.trace
        if before is None or before.costs is None:
            return self.answer(None, ask)
        with self._learned_as(before.costs, before.lengths):
            return self.answer(None, ask)

    def rewind(self, trace: Trace) -> None:
        """Put back the state `trace` took (and the cost model, if the batch learned from a failure)."""
        self.decider.load_state_dict(trace.decider)
        self.plans.restore(trace.plans, costs_changed=trace.costs is not None)
        self.measuring = trace.measuring.copy()
        self._replan_when_warm = trace.replan_when_warm
        if trace.costs is not None:
            self.costs.restore(trace.costs)
            self.lengths.load_state_dict(trace.lengths)
        self.blocks.apply(trace.modes, trace.head)


def weight_grad_bytes(handles: list[BlockHandle]) -> list[int]:
    """Each block's trainable weights' gradient bytes; a module called more than once a forward
    counts them at its last call, whose backward, the first to reach it, allocates them."""
    last = {h.order: h.index for h in handles}
    return [
        sum(w.numel() * w.element_size() for w in h.module.parameters() if w.requires_grad)
        if last[h.order] == h.index
        else 0
        for h in handles
    ]
