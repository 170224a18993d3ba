"""Choosing a plan for a batch: the cache per shape bucket, and the plans of retries.

`PlanBook` turns (batch, input elements per sample, what is allocated now,
budget) into one mode per block. A plan is made by the planner from the cost
model, aimed at `headroom x budget`, and kept for its shape bucket (input sizes
grouped geometrically; a micro-step that finds the gradients of the one before
kept, as in gradient accumulation, has buckets of its own), made for the
largest input seen in the bucket so far: a larger one is planned for again
before it runs, and a run of one shape is planned for that shape, not for the
top of its bucket (up to `bucket_ratio` larger, which would leave that much of
the budget unused). A shape the cost
model has not measured yet is planned for the bucket's top (its predictions are
inter- or extrapolated, and the top is their margin), and planned for again at
its own size once it has been measured, or once the fits cover it (two sizes
measured at its batch, it at most one bucket past the largest). Before anything
is known, every block
is checkpointed (the calibration step); static policies give their fixed plan;
a model the user instrumented first starts from the user's modes instead. After
an out-of-memory error, a retry's plan is no looser anywhere than the one that
failed, never one that already failed in this step, and, once the cost model
predicts, predicted lower than every plan that failed in this step by at least
`RETRY_STEP` of the lowest one's bytes: retries climb by predicted peak, not by a mode's
rank, and where no plan is lower the record says so (`exhausted`) and the step
is given up at once rather than run again at the same peak. Where every plan
that failed had been predicted to fit, the figures were wrong (or memory was
taken for a moment), not the batch too large: with nothing predicted lower,
the retries go on up the ladder, `max_retries` at most.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from adaptmem.config.policy import Policy
from adaptmem.config.units import format_bytes
from adaptmem.control.costs import CostModel
from adaptmem.control.coverage import TRIED, covers, guessed, guessed_in, known, measured_kinds
from adaptmem.control.decisions import Decider
from adaptmem.control.headcosts import HeadChoice
from adaptmem.control.planner import Option, picked, predicted_peak
from adaptmem.control.planner import plan as solve
from adaptmem.control.retry import plan_text
from adaptmem.modes import HeadMode, Mode, ladder, ladder_ranks, step_up

log = logging.getLogger("adaptmem")

Key = tuple[int, int, bool]  # (batch, bucketed elements per sample of the main input, gradients kept)
Shape = tuple[int, int]  # (batch, elements per sample) a plan is made for

#: Plans kept, one per shape bucket; past it the least recently used is dropped.
MAX_CACHED_PLANS = 64
#: A retry's plan is predicted lower than every plan that failed by at least this fraction of the
#: lowest one's predicted bytes above the step's start.
RETRY_STEP = 0.01
#: A plan that ran a shape this share shorter is evidence for this one, its peak grown as the square
#: of the length: a Gemma 3 with eager attention trained 2 x 1,321 tokens under 4 x OFFLOAD, and at
#: 2 x 1,322 ran a recomputing plan its figures priced low, then retries among recomputing plans
#: only, each out of memory in backward, and was given up.
RAN_NEAR = 0.01
#: Shapes whose tightest plan that ran to its end is kept (`PlanBook.ran`); past it the least
#: recently run is dropped.
MAX_RAN = 64


@dataclass(frozen=True)
class PlanRecord:
    modes: tuple[Mode, ...]
    key: Key
    extent: int  # the input elements per sample planned for: `seen`, or the bucket's top beyond what was measured
    start: int  # bytes allocated when the plan was made (it is redone if that grows)
    predicted: float | None  # absolute predicted peak at the bucket's shape
    reason: str
    feasible: bool = True
    shortfall: float = 0.0
    learned: int = 0  # the cost model's steps learned when the plan was made (or last checked)
    seen: int = 0  # the largest input elements per sample seen in the bucket
    head: HeadChoice | None = None  # the loss head's mode and chunk (None: the model has no managed head)
    exhausted: bool = False  # a retry with no plan predicted lower than one that failed: give the step up
    free: bool = False  # every block (and the head) in its fastest option: a higher aim makes it again
    trial: Mode | None = None  # a mode tried on one block (`PlanBook._trial`): measured, then the plan made again
    guessed: bool = False  # the planner chose a mode no block has been measured in: the step is measured


class PlanBook:
    """Plans per shape bucket, for one model's blocks.

    `start_plan`: the modes to run before anything is learned (default: every
    block CHECKPOINT, the calibration plan). `one_memory`: device and host are the
    same memory (managing the host itself), so OFFLOAD and its combinations,
    which would move bytes to where they already are, are never planned.
    """

    def __init__(
        self,
        n_blocks: int,
        policy: Policy,
        costs: CostModel,
        decider: Decider,
        probe: Any,
        start_plan: tuple[Mode, ...] | None = None,
        one_memory: bool = False,
    ) -> None:
        self.n = n_blocks
        self.policy = policy
        self.costs = costs
        self.decider = decider
        self.probe = probe
        self.start_plan = start_plan
        # the policy's modes, less the offloading ones where the device shares the host's memory
        self.allowed: tuple[Mode, ...] = (
            tuple(m for m in policy.allowed if not (one_memory and Mode.OFFLOAD in m)) or policy.allowed
        )
        self.pinned: dict[int, Mode] = {}  # blocks whose mode is not the planner's to choose
        self.cache: OrderedDict[Key, PlanRecord] = OrderedDict()
        self.failed: tuple[Mode, ...] | None = None  # the plan that just ran out of memory
        self.width = 0  # a token model's elements per position (`InputShape.width`): sizes told in tokens
        self.failed_head: HeadChoice | None = None  # and its head
        # (plan, head) pairs that ran out of memory in this step
        self.tried: set[tuple[tuple[Mode, ...], HeadChoice | None]] = set()
        self.failed_shape: Shape | None = None  # the (batch, extent) they failed on
        self.failed_unforeseen = False  # every plan that failed was predicted to fit: the figures were wrong
        # after an attempt ran out in the loss head: its head, the most a retry's blocks may hold as it
        # runs, and what the head's allocation lacked there
        self.head_short: tuple[HeadChoice | None, float, float] | None = None
        self.attempt = 0  # the retry in hand (0: the batch's first run); `start_attempt` sets it
        # predicted peaks above the start, per (modes, batch, extent), while the cost model and the
        # policy stay as they were: steady-state steps ask for the same plan's prediction each step
        self._predicted: dict[tuple, float] = {}
        self._predicted_for: tuple[int, Policy] | None = None
        # (bucket, its size measured, within the budget, on a guess) warned of
        self._warned: set[tuple[Shape, bool, bool, bool]] = set()
        self._planned: set[Key] = set()  # buckets planned for before (their plans may have been dropped since)
        self.fresh = True  # the last `choose` made its plan (False: it was the bucket's cached one)
        self.trials: set[tuple[Mode, str]] = set()  # modes tried on a block (`_trial`): once per kind of block
        # "how long can I go?" was asked while a mode was still a guess: plans try one on a block where
        # every block is in its fastest mode too, so that the next answer counts what it showed
        self.trials_asked = False
        self.unfit: tuple | None = None  # the last plan's shortfall warning, until `announce_unfit`
        # the user's budget, under which others' memory may hold the one in force (the warnings tell which)
        self.user_budget: Callable[[], int] | None = None
        self.head_can_chunk = True  # the loss head ran chunked where planned so, in the last step (`head_chunks`)
        self.head_kept_for: str | None = None  # why the head is kept for good (`keep_head`), None while it may chunk
        # per (batch, extent, gradients resident): the plan (and head) of the lowest peak that ran a step
        # of that shape to its end, and that peak above the first block's start (`ran`)
        self.ran_at: OrderedDict[tuple[int, int, bool], tuple[tuple[Mode, ...], HeadChoice | None, float]] = (
            OrderedDict()
        )
        # every plan that ran a step to its end, by (batch, extent, gradients resident, modes, head): its
        # last peak above the first block's start (`ran`, `_ran_over`)
        self.peaks: OrderedDict[tuple, float] = OrderedDict()

    def bucket(self, batch: int, extent: int) -> Key:
        """The shape bucket, and whether the step starts with the weights' gradients kept from the
        step before (accumulating): such a step starts higher and peaks otherwise, so each kind
        keeps a plan of its own. Held as one, the plan made for the higher start ran the other
        micro-steps with a third of the budget unused."""
        r = self.policy.bucket_ratio
        top = math.ceil(r ** math.ceil(math.log(max(extent, 1), r) - 1e-9) - 1e-9)
        return batch, max(extent, top), self.costs.grads_resident

    def choose(self, batch: int, extent: int, start: int, budget: int) -> PlanRecord:
        """The plan for a forward starting now: the bucket's, unless stale or retrying."""
        key = self.bucket(batch, extent)
        record = self.cache.get(key)
        self.unfit = None  # a plan made before and never run (a retry given up) is not announced now
        self.fresh = True  # made in this call (False: the bucket's cached plan, applied again)
        # a bucket whose largest input seen no plan fits: an input under it is planned for its own size
        # (a MiniMax answered 1,382 tokens, planned at its bucket's 1,536, was warned to be shortened)
        shorter = record is not None and not record.feasible and extent < record.seen
        if record is None or extent > record.seen or shorter:
            seen = extent if record is None or shorter else max(extent, record.seen)
            reason = (
                "shorter input"
                if shorter
                else "larger input"
                if record is not None
                else "replan"
                if key in self._planned
                else "new shape"
            )
            record = self.make(key, start, budget, fixed={}, reason=reason, extent=seen)
            self.cache[key] = record
            if len(self._planned) >= 4 * MAX_CACHED_PLANS:
                self._planned.clear()
            self._planned.add(key)
        elif (
            start > record.start + 0.01 * budget
            or self.failed is not None
            or (self.trials_asked and record.free)  # made with no mode tried: a mode may be tried now
            or self._outlearned(record, start, budget)
        ):
            record = self.make(key, start, budget, fixed={}, reason="replan", extent=record.seen)
            self.cache[key] = record
        else:
            self.fresh = False
        self.cache.move_to_end(key)
        while len(self.cache) > MAX_CACHED_PLANS:
            self.cache.popitem(last=False)
        return record

    def unmeasured(self) -> list[Mode]:
        """The modes allowed that some block the planner chooses for (not `pinned`: a block its model
        checkpoints itself runs NONE) has not run, on its kind: counted by a guess made to err high."""
        free = {kind for i, kind in enumerate(self.costs.kinds) if i not in self.pinned}
        return [m for m in self.allowed if m in TRIED and free - measured_kinds(self.costs, m)]

    def _outlearned(self, record: PlanRecord, start: int, budget: int) -> bool:
        """The cost model has learned since the cached plan was made, and either has now measured
        the shape the plan kept a margin for, or predicts the plan over the decider's fill of the
        budget (it would not fit). Checked once per step learned."""
        if record.learned == self.costs.steps_learned or self.policy.static_plan != "none":
            return False
        if record.trial is not None:  # it ran and was measured: the plan is made from what it showed
            return True
        if record.extent > record.seen and known(self.costs, record.key[0], record.seen):
            return True
        if not record.feasible:
            # nothing was predicted to fit: what the step taught may make a plan fit (a head chunked
            # finer, priced from another size, was not the tightest; measured, it peaked at 71% of
            # the tightest's peak, where the plan held ran out of memory at the next step)
            return True
        # without the plan's head: with a managed head that leaves the head's bytes out (its own cost
        # model learns them). Counted in, the kept head's prediction at 70% of the benchmark's budget
        # rose past the fill and had the head chunked where keeping it (0.975 of the budget) was faster
        predicted = self.predict(record.modes, record.key[0], record.extent, start)
        if predicted is not None and predicted > self.decider.fill * budget:
            return True
        self.cache[record.key] = replace(record, learned=self.costs.steps_learned)
        return False

    def rebiased(self, budget: int) -> None:
        """The decider's bias moved: drop the cached plans it may change. A plan with every block (and
        the head) in its fastest option, predicted under the new aim, is the one the planner would
        make again (on a step far under its budget the bias moves with noise, and each replan of
        24 blocks took a step's host time)."""
        for key, record in list(self.cache.items()):
            kept = record.free and record.predicted is not None
            if not (kept and record.predicted - record.start <= self._aim(record.start, budget)):
                del self.cache[key]

    def _aim(self, start: int, budget: int) -> float:
        """The most a plan's peak may rise above `start`: the decider's headroom of the budget, aimed
        higher by the predictions' bias, never past its fill of the budget."""
        target = self.decider.headroom * budget
        return min((target - start) / self.decider.bias, self.decider.fill * budget - start)

    def forget(self, key: Key | None = None) -> None:
        """Drop the plan cached for `key`, or every cached plan: they are made again when next asked for."""
        if key is None:
            self.cache.clear()
        else:
            self.cache.pop(key, None)

    def start_attempt(self, attempt: int) -> None:
        """The batch runs for the `attempt`-th time (0: its first run; retries name their plans by it)."""
        self.attempt = attempt

    def ran(self, shape: Shape, resident: bool, modes: tuple[Mode, ...], head: HeadChoice | None, above: float) -> None:
        """A step of `shape` ran `modes` (and `head`) to its end, peaking `above` bytes over its first
        block's start. The plan of the lowest peak at each shape is kept (the same plan again updates
        its peak): where the figures predict no plan to fit that shape, or a plan fails on it, a plan
        that ran there is what the evidence says fits (`_ran_here`)."""
        key = (*shape, resident)
        kept = self.ran_at.pop(key, None)
        if kept is None or above <= kept[2] or (modes, head) == kept[:2]:
            kept = (modes, head, above)
        self.ran_at[key] = kept
        while len(self.ran_at) > MAX_RAN:
            self.ran_at.popitem(last=False)
        self.peaks.pop((*key, modes, head), None)
        self.peaks[(*key, modes, head)] = above
        while len(self.peaks) > 4 * MAX_RAN:
            self.peaks.popitem(last=False)

    def _ran_over(
        self, shape: Shape, modes: tuple[Mode, ...], head: HeadChoice | None, start: int, aim: float
    ) -> tuple[tuple[Mode, ...], HeadChoice | None, float] | None:
        """Where `modes` (and `head`) ran this very shape to its end before and peaked over the aim (in
        bytes above the first block's start, `_aim`'s), whatever its figures say now, the fastest plan
        that ran the shape under it, as (modes, head, its peak from `start`); None where `modes` did
        not, or no plan ran under it. A SigLIP's plan keeping its vision tower's last layer ran over
        its prediction, each time chosen again on the same figures: the vision head's backward, on
        top of that layer's activations, was read as part of a text layer's backward, and a plan
        borrowing that layer's figures from its sibling left it out."""
        batch, extent = shape
        resident = self.costs.grads_resident
        seen = self.peaks.get((batch, extent, resident, modes, head))
        if seen is None or seen <= aim:
            return None
        rows, best = None, None
        for (b, e, r, ran, ran_head), above in self.peaks.items():
            if (b, e, r) != (batch, extent, resident) or above > aim or not self.head_runs(ran_head):
                continue
            if any(ran[i] is not m for i, m in self.pinned.items()):
                continue
            rows = rows or self.costs.options(batch, extent, self.allowed, {})
            seconds = sum(o.seconds for o in picked(rows, ran))
            if best is None or seconds < best[0]:
                best = (seconds, ran, ran_head, start + above)
        return best[1:] if best is not None else None

    def _ran_here(self, shape: Shape) -> tuple[tuple[Mode, ...], HeadChoice | None, float] | None:
        """Of the plans kept by `ran` for this shape or one as large in both batch and elements (a plan
        that ran a larger shape peaks no higher on this one), in the gradients' state planned, the one
        of the lowest peak; not one that failed in this batch, nor one whose head would chunk a head the
        failed attempt kept (a retry keeps the order of summation of lossless modes), nor one that runs
        blocks pinned since otherwise. None where there is none, or where it would offload more than
        the host's share the policy allows."""
        batch, extent = shape
        resident, failed = self.costs.grads_resident, self.failed_head
        best = None
        for (b, e, r), entry in self.ran_at.items():
            if r is not resident or b < batch or e < extent * (1 - RAN_NEAR) or (entry[0], entry[1]) in self.tried:
                continue
            if e < extent:  # a hair shorter: its peak grown as the square of the length, to err high
                entry = (entry[0], entry[1], entry[2] * (extent / e) ** 2)
            modes, head, above = entry
            if any(modes[i] is not m for i, m in self.pinned.items()):
                continue
            if not self.head_runs(head):
                continue
            if (
                failed is not None
                and failed.mode is HeadMode.KEPT
                and head is not None
                and head.mode is not HeadMode.KEPT
            ):
                continue
            if best is None or above < best[2]:
                best = entry
        if best is not None:  # and offloads no more than the host may hold now
            rows = self.costs.options(batch, extent, self.allowed, {})
            if sum(o.host for o in picked(rows, best[0])) > self._host_limit():
                return None
        return best

    def snapshot(self) -> tuple:
        """The cached plans, the shortfalls warned of, the modes tried and the plans that ran, to put
        back with `restore`."""
        return self.cache.copy(), set(self._warned), set(self.trials), self.ran_at.copy(), self.peaks.copy()

    def restore(self, snapshot: tuple, *, costs_changed: bool) -> None:
        """Put back a `snapshot`. `costs_changed`: the cost model went back too, so the predictions
        kept for its last state are dropped."""
        cache, warned, trials, ran, peaks = snapshot
        self.cache, self._warned, self.trials, self.ran_at = cache.copy(), set(warned), set(trials), ran.copy()
        self.peaks = peaks.copy()
        if costs_changed:
            self._predicted_for = None

    def pin(self, pinned: dict[int, Mode]) -> None:
        """Blocks that keep the given modes whatever the plan (cached plans are dropped)."""
        self.pinned = dict(pinned)
        self.cache.clear()

    def make(
        self, key: Key, start: int, budget: int, *, fixed: dict[int, Mode], reason: str, extent: int | None = None
    ) -> PlanRecord:
        """A plan for bucket `key`, for inputs of up to `extent` elements per sample (default: the
        bucket's top), made for the bucket's top while that shape has not been measured."""
        p = self.policy
        seen = key[1] if extent is None else extent
        extent = seen if known(self.costs, key[0], seen) else max(seen, key[1])
        shape = (key[0], extent)
        replanning = bool(fixed)  # a forward under way, or a second one: not a plan to try a mode in
        fixed = {**self.pinned, **fixed}
        predicted, feasible, shortfall, head, bound, free = None, True, 0.0, None, False, False
        warn, trial, unmeasured = False, None, False
        if p.static_plan != "none":
            modes, reason = self._static(), "static"
        elif not self.costs.known and self.start_plan is not None:
            modes, reason = self.start_plan, "user"
        elif not self.costs.known:
            top = ladder(self.allowed)[-1]
            modes = tuple(Mode.CHECKPOINT if Mode.CHECKPOINT in self.allowed else top for _ in range(self.n))
            reason = "calibrate"
        else:
            modes, head, predicted, feasible, shortfall, bound, free = self._solve(shape, start, budget, fixed)
            warn = extent <= seen
            if not feasible and extent > seen:  # no plan fits the bucket's top: plan for the input itself
                extent, shape, warn = seen, (key[0], seen), True
                modes, head, predicted, feasible, shortfall, bound, free = self._solve(shape, start, budget, fixed)
            own = not replanning and self.failed is None  # the planner's own plan, not a replan's or a retry's
            over = self._ran_over(shape, modes, head, start, self._aim(start, budget)) if own and feasible else None
            tried = None
            if over is not None:  # it ran here over the aim: what ran under it runs, nothing tried in it
                modes, head, predicted = over
                reason = f"{reason}, ran here before"
            elif own and feasible and (not free or self.trials_asked) and p.try_modes:
                tried = self._trial(modes, head, shape, start, budget, fixed)
            elif own and not feasible and not bound and predicted > budget and self.costs.measured(*shape):
                # no plan is predicted to fit the budget at a size measured, and a mode still counted by a
                # guess, which errs high, may: tried where the device has room for the guess (a CLIP's
                # 3 x CHECKPOINT ran at 112% of its budget, step after step, where OFFLOAD ran at 101%)
                room = self.decider.headroom * self._capacity() - start
                if room < math.inf and p.try_modes:
                    tried = self._trial(modes, head, shape, start, budget, fixed, aim=room)
            if tried is not None:
                modes, trial, predicted = tried
                reason = f"{reason}, trial {trial.label}"
            ran = self._ran_here(shape) if own and not feasible and trial is None else None
            if ran is not None and start + ran[2] < predicted:
                # no plan is predicted to fit, and one ran this shape lower than the tightest predicted:
                # what ran beats what is extrapolated (a Gemma 2 whose batch trained under 4 x OFFLOAD
                # was planned 4 x CHECKPOINT+OFFLOAD, predicted tighter, and given up after its retries)
                modes, head, predicted = ran[0], ran[1], start + ran[2]
                shortfall = max(0.0, predicted - start - self._aim(start, budget))
                reason = f"{reason}, ran here before"
            unmeasured = trial is None and p.try_modes and bool(guessed_in(self.costs, modes))
        if head is None and self.costs.head_costs is not None:
            head = self._head_alone(shape, start, budget)
        exhausted = False
        if self.failed is not None:
            ran = self._ran_here(shape)
            modes, head, exhausted = self._retry(modes, head, shape, ran)
            reason = "nothing lower" if exhausted else f"retry {self.attempt}"
            if self.costs.known:  # the retry's own plan, not the planner's it replaced
                predicted = self.predict(modes, *shape, start, head)
                if ran is not None and ran[:2] == (modes, head):  # no higher than where it ran
                    predicted = min(predicted, start + ran[2])
        for i, mode in fixed.items():
            modes = modes[:i] + (mode,) + modes[i + 1 :]
        self.unfit = (key, shape, start, budget, modes, head, bound) if warn and not feasible else None
        return PlanRecord(
            modes,
            key,
            extent,
            start,
            predicted,
            reason,
            feasible,
            shortfall,
            self.costs.steps_learned,
            seen,
            head,
            exhausted,
            free and not exhausted and self.failed is None and not fixed,
            trial,
            unmeasured,
        )

    def predict(
        self, modes: tuple[Mode, ...], batch: int, extent: int, start: int, head: HeadChoice | None = None
    ) -> float | None:
        """Predicted absolute peak of `modes` (and the head's `head`) for this shape, or None
        before calibration."""
        if not self.costs.known:
            return None
        state = (self.costs.steps_learned, self.costs.policy)
        if (
            self._predicted_for is None
            or self._predicted_for[0] != state[0]
            or self._predicted_for[1] is not state[1]
            or len(self._predicted) >= 4 * MAX_CACHED_PLANS
        ):
            self._predicted, self._predicted_for = {}, state
        key = (modes, batch, extent, self.costs.grads_resident, head)
        above = self._predicted.get(key)
        if above is None:
            rows = self.costs.options(batch, extent, self.allowed, fixed=dict(enumerate(modes)))
            chosen = [row[0] for row in rows]
            final = self.costs.head_bytes(batch, extent, head)
            above = max(predicted_peak(chosen, final, self.costs.order), self.costs.tail_bytes(batch, extent))
            self._predicted[key] = above
        return start + above

    def _host_limit(self) -> float:
        """The host bytes a plan may offload: the policy's share of what the host has available."""
        return self.policy.host_fraction * self.probe.host_available()

    def failure(
        self,
        executed: tuple[Mode, ...],
        head: HeadChoice | None = None,
        shape: Shape | None = None,
        foreseen: bool = True,
        in_head: tuple[float, float] | None = None,
    ) -> None:
        """`executed` (with `head`) ran out of memory on `shape`: retries must be predicted lower.
        `foreseen`: it ran although no plan was predicted to fit (it was the tightest). `in_head`: it
        ran out in the loss head, (what its blocks held there, what the allocation lacked)."""
        self.failed_unforeseen = (not self.tried or self.failed_unforeseen) and not foreseen
        if in_head is not None and shape is not None:
            most = in_head[0] - in_head[1]
            if self.head_short is None or self.head_short[0] != head or most < self.head_short[1]:
                self.head_short = (head, most, in_head[1])
        self.failed, self.failed_head = executed, head
        if shape is not None:  # a plan that ran this shape, or a larger one, and failed here is no evidence
            resident = self.costs.grads_resident
            for key, entry in list(self.ran_at.items()):
                b, e, r = key
                if r is resident and b >= shape[0] and e >= shape[1] and entry[:2] == (executed, head):
                    del self.ran_at[key]
            for b, e, r, modes, ran_head in list(self.peaks):
                if r is resident and b >= shape[0] and e >= shape[1] and (modes, ran_head) == (executed, head):
                    del self.peaks[(b, e, r, modes, ran_head)]
        self.tried.add((executed, head))
        self.cache.clear()
        if shape is not None and shape[0] * shape[1] > 0:
            self.failed_shape = shape

    def succeeded(self) -> None:
        self.failed = self.failed_head = self.failed_shape = self.head_short = None
        self.failed_unforeseen = False
        self.tried.clear()

    # ------------------------------------------------------------------ inner
    def _solve(self, shape: Shape, start: int, budget: int, fixed: dict[int, Mode]):
        """The planner's plan for `shape`: (modes, head, predicted peak, feasible, shortfall, whether
        the peak after the blocks' backward is what no plan brings under the aim, and whether every
        row took its fastest option)."""
        batch, extent = shape
        p = self.policy
        options = self.costs.options(batch, extent, self.allowed, fixed)
        head_row = self.head_row(shape)
        final = 0.0 if head_row else self.costs.head_bytes(batch, extent)
        host_limit = self._host_limit()
        aim = self._aim(start, budget)
        # after the blocks' backward the step peaks whatever the plan (the weights' gradients all
        # there): where that is over the aim, no block need be held under it, as it cuts no byte of
        # the step's peak (a layer-heavy model on a tight device checkpointed a block for nothing).
        # Only where the fits cover the shape: extrapolated from one size, the tail grows with the
        # tokens, and an aim raised to it would let the blocks run out of memory
        measured = self.costs.measured(batch, extent)
        tail = self.costs.tail_bytes(batch, extent) if measured or covers(self.costs, batch, extent) else 0.0
        for _ in range(len(options) + 1):  # keep offloaded bytes under the host ceiling
            result = solve(
                options + ([head_row] if head_row else []), max(aim, tail), final, p.planner_bins, self.costs.order
            )
            chosen = picked(options, result.modes)
            if sum(o.host for o in chosen) <= host_limit:
                break
            worst = max(range(len(chosen)), key=lambda i: chosen[i].host)
            options[worst] = [o for o in options[worst] if o.host == 0] or options[worst]
        bound = tail > aim
        if bound:
            if not measured:  # the tail is extrapolated too: where nothing fits, the tightest plan runs
                result = solve(options + ([head_row] if head_row else []), 0.0, final, p.planner_bins, self.costs.order)
                bound = tail > result.peak
            peak = max(result.peak, tail)
            result = replace(result, peak=peak, feasible=False, shortfall=peak - aim)
        elif head_row and not result.feasible and self.failed is None:
            # nothing fits: the head in its smallest chunks too. The tightest peak can be the blocks'
            # (extrapolated, with margins), and the cheapest head under it took chunks whose logits,
            # 64 MiB at 3,200 tokens, ran out of memory where the blocks would have fitted. (A retry's
            # head is the retry's to choose: a kept head is chunked only once the blocks have nothing
            # tighter, as chunking it changes the order of summation.)
            tightest = min(head_row, key=lambda o: (o.need, o.seconds))
            chosen = picked(options, result.modes[:-1]) + [tightest]
            peak = predicted_peak(chosen, final, self.costs.order)
            result = replace(
                result, modes=result.modes[:-1] + (tightest.mode,), peak=peak, shortfall=max(0.0, peak - aim)
            )
        rows = options + ([head_row] if head_row else [])
        free = not bound and all(m is min(row, key=lambda o: o.seconds).mode for row, m in zip(rows, result.modes))
        modes, head = (result.modes[:-1], result.modes[-1]) if head_row else (result.modes, None)
        return modes, head, start + result.peak, result.feasible, result.shortfall, bound, free

    def _trial(
        self,
        modes: tuple[Mode, ...],
        head: HeadChoice | None,
        shape: Shape,
        start: int,
        budget: int,
        fixed: dict[int, Mode],
        aim: float | None = None,
    ) -> tuple[tuple[Mode, ...], Mode, float] | None:
        """`modes` with one block in an allowed mode whose figures are a guess (`coverage.TRIED`) and
        that no block of its kind has been measured in, where the plan is still predicted under the aim
        (`aim`, bytes above `start`; default `_aim`'s): of the
        blocks where it fits, the first of those whose mode is the tightest (a recomputing block
        gives its recompute up for the mode tried; the blocks' guessed times differ by noise alone,
        and two runs of one plan had tried it on different blocks). Returns the plan's modes, the
        mode tried and its predicted peak, or None.

        The budget shapes this plan, so the planner chose among its modes by their figures; a mode
        known only by its prior is judged by a guess made to err high (an offload's backward is
        assumed to bring back all its tensors at once, where it brings them back one by one), and
        so may never be chosen, nor ever measured: in the demo with OFFLOAD never picked on its
        guess, the longest length was predicted at 8,964 tokens without a trial and 15,206 with one
        (`python -m stress.reach_trials`). Each mode is tried once per run and kind of block (a
        hybrid's Mamba layers and its attention layers), on the one step the plan runs, which is
        measured block by block; the next step's plan is made from what it showed."""
        costs, kinds = self.costs, self.costs.kinds
        pending = [
            m
            for m in self.allowed
            if any(guessed(costs, m, i) and (m, kinds[i]) not in self.trials for i in range(self.n))
        ]
        self.trials_asked = self.trials_asked and bool(pending)
        # where the plan runs it on a block of a kind it is a guess for, the step is measured anyway
        in_plan = guessed_in(costs, modes)
        untried = [m for m in pending if m not in in_plan]
        if not untried:
            return None
        batch, extent = shape
        aim = self._aim(start, budget) if aim is None else aim
        host_limit = self._host_limit()
        # the plan's peak with one block swapped, as `predict` has it, from the rows made once
        rows = self.costs.options(batch, extent, self.allowed, fixed)
        final, tail = self.costs.head_bytes(batch, extent, head), self.costs.tail_bytes(batch, extent)
        chosen = picked(rows, modes)
        rank = ladder_ranks(self.allowed)
        best: tuple[tuple[int, int], int, Mode, float] | None = None
        for mode in untried:
            for i, row in enumerate(rows):
                option = next((o for o in row if o.mode is mode), None)
                if i in fixed or option is None or option.host > host_limit:
                    continue
                if (mode, kinds[i]) in self.trials or not guessed(costs, mode, i):
                    continue
                peak = max(predicted_peak(chosen[:i] + [option] + chosen[i + 1 :], final, costs.order), tail)
                order = (-rank.get(modes[i], 0), i)
                if peak <= aim and (best is None or order < best[0]):
                    best = (order, i, mode, peak)
        if best is None:
            self.trials_asked = False  # none fits the aim now: tried again when asked again
            return None
        _, i, mode, peak = best
        self.trials.add((mode, kinds[i]))
        return modes[:i] + (mode,) + modes[i + 1 :], mode, start + peak

    def announce_unfit(self, forwards: int = 1) -> None:
        """Warn that the plan just made is predicted not to fit, once it is known to run: a retry's
        plan given up before it ran was announced as running ("Running a retry's plan, ...").
        `forwards`: the forwards before one backward it was made for (its batch counts them all)."""
        pending, self.unfit = self.unfit, None
        if pending is not None:
            self._warn_unfit(*pending, forwards)

    def _warn_unfit(
        self,
        key: Key,
        shape: Shape,
        start: int,
        budget: int,
        modes: tuple[Mode, ...],
        head: HeadChoice | None,
        bound: bool,
        forwards: int,
    ) -> None:
        """Once per shape bucket (whatever the gradient state; a size first extrapolated warns again once
        measured): no plan is predicted to fit, and the plan that runs, as it runs (a retry's included)."""
        batch, extent = shape
        measured = self.costs.measured(batch, extent)
        predicted = self.predict(modes, batch, extent, start, head)
        target = self.decider.headroom * budget
        if predicted <= target:  # a plan that ran this shape before, predicted within the aim: nothing to warn of
            return
        within = predicted <= budget  # over the aim only: an out-of-memory error lowers the aim for a while
        # once each way: a shape warned of as within the budget that comes to run over it (the
        # optimizer's state, allocated after the first steps, raised every later micro-batch 10% over
        # it) is warned of again, and so is one warned of on a guess, once measured
        guesses = sorted(m.label for m in guessed_in(self.costs, modes))
        if (key[:2], measured, within, bool(guesses)) in self._warned:
            return
        self._warned.add((key[:2], measured, within, bool(guesses)))
        width = self.width
        size = f"{extent // width:,} tokens" if width and extent % width == 0 else f"{extent:,} input elements"
        if guesses:  # its figures err high: no advice to shrink what may well fit
            advice = (
                f"{' and '.join(guesses)} {'has' if len(guesses) == 1 else 'have'} not run on these blocks yet, so "
                "the prediction is a guess made to err high; the step is measured, and the plans after it count "
                "what it shows."
            )
        elif not measured:
            advice = (
                "this size has not run yet, so its figures are extrapolated from other sizes (with a margin); "
                "if it runs out of memory, run_step retries it tighter."
            )
        elif within:
            advice = "it is within the budget; plans aim higher again as steps run calm."
        elif predicted > self._capacity():  # a larger budget would not make room on the device
            advice = "lower the batch or input size, or make room on the device."
        elif self.user_budget is not None and budget < (user := self.user_budget()):
            advice = (
                f"lower the batch or input size; the budget in force is held under yours ({format_bytes(user)}) "
                f"while others take memory, and comes back once they have let go for {self.policy.calm_steps} steps."
            )
        else:
            advice = "lower the batch or input size, or raise the budget (the device has room for this plan)."
        untried = sorted(m.label for m in self.unmeasured())
        if untried and not guesses and not bound:  # the tightest by the figures, among which a guess errs high
            advice += (
                f" ({' and '.join(untried)} not run on these blocks yet: counted by a guess made to err high, "
                f"{'it' if len(untried) == 1 else 'each'} may fit where this plan does not"
                + (
                    ", and is tried where the device has room for its guess.)"
                    if self.policy.try_modes
                    else "; the policy's try_modes is off, so no step tries it.)"
                )
            )
        forwards = forwards if forwards > 1 and batch % forwards == 0 else 1
        counted = f"{batch} ({batch // forwards} in each of {forwards} forwards before one backward)"
        log.warning(
            "adaptmem: no plan is predicted to fit %s (%.0f%% of the budget %s) for batch %s x up to "
            "%s each. Running %s%s, predicted at %s (%s over that%s)%s; %s",
            format_bytes(target),
            100 * self.decider.headroom,
            format_bytes(budget),
            counted if forwards > 1 else batch,
            size,
            "a retry's plan, " if self.failed is not None else "" if bound and measured else "the tightest plan, ",
            plan_text(modes, head),
            format_bytes(predicted),
            format_bytes(max(0.0, predicted - target)),
            "" if within else f", {format_bytes(predicted - budget)} over the budget",
            ": the peak after the blocks' backward, which no plan lowers" if bound else "",
            advice,
        )

    def _capacity(self) -> float:
        """The device's size, or infinity where the probe knows none."""
        try:
            return float(self.probe.capacity())
        except (ValueError, RuntimeError, AttributeError):
            return math.inf

    def head_chunks(self, can: bool) -> None:
        """Whether the loss head can run chunked in the steps as they run now: False after a step in
        which it was not called to make a loss (a model called without `labels=`) or, planned chunked,
        ran kept. The plans keep it then (the cached ones, made otherwise, are dropped)."""
        if can != self.head_can_chunk:
            self.head_can_chunk = can
            self.forget()

    def keep_head(self, why: str) -> None:
        """The loss head is kept from now on: a step used its chunked logits beyond what a chunk replays
        (`why`, the error's first line), in the model's code (BART's bias before it was replayed) or the
        caller's."""
        if self.head_kept_for is None:
            self.head_kept_for = why
            self.forget()

    def head_runs(self, head: HeadChoice | None) -> bool:
        """A plan's head choice can run as the steps run now: not a chunked head once the head is
        kept (`keep_head`, `head_chunks`), as a plan that ran before may have had it."""
        return head is None or head.mode is HeadMode.KEPT or self._head_allowed() != "kept"

    def _head_allowed(self) -> str:
        return self.policy.head if self.head_can_chunk and self.head_kept_for is None else "kept"

    def head_row(self, shape: Shape) -> list[Option]:
        """The loss head as the plan's last row: its bytes stand above every block's saved bytes."""
        costs = self.costs.head_costs
        if costs is None:
            return []
        choices = costs.choices(*shape, self._head_allowed())
        return [Option(choice, 0.0, need, seconds) for choice, need, seconds in choices]

    def _head_alone(self, shape: Shape, start: int, budget: int) -> HeadChoice:
        """The head's choice where the blocks' plan is not the planner's (calibration, static or the
        user's plan): the cheapest predicted to fit what is left, else the tightest."""
        row = self.head_row(shape)
        room = self.decider.headroom * budget - start
        fitting = [o for o in row if o.need <= room]
        return min(fitting, key=lambda o: o.seconds).mode if fitting else min(row, key=lambda o: o.need).mode

    def _retry(
        self,
        modes: tuple[Mode, ...],
        head: HeadChoice | None,
        shape: Shape,
        ran: tuple[tuple[Mode, ...], HeadChoice | None, float] | None,
    ) -> tuple[tuple[Mode, ...], HeadChoice | None, bool]:
        """A retry's plan: `ran`, a plan that ran this shape (or a larger one) to its end before, where
        there is one not tried (`_ran_here`); else the first candidate not tried and predicted lower than
        what failed (the planner's own plan made no looser than the failed one, each block a rung up,
        uniform plans by predicted peak), with the head no looser than the failed one's, then with the
        head in its smallest chunks. True third when none is lower (the tightest is returned, to be
        given up)."""
        if ran is not None and not self._holds_what_failed(ran[0]):
            return ran[0], ran[1], False  # a plan that ran this shape to its end before: tried first
        blocks = self._tighter_than_failed(modes, shape)
        head = self._tighter_head(head)
        guess = self._guessed_uniform(head)
        if guess is not None and self._frees_the_head(guess, head, shape):
            return guess, head, False
        smallest = None
        costs = self.costs.head_costs
        if head is not None and costs is not None and self._head_allowed() != "kept":
            # chunking a kept head changes the order of summation, where a retry of lossless modes is
            # exact: it is done once the blocks have nothing tighter, or a chunked head failed twice
            smallest = HeadChoice(HeadMode.CHUNKED, costs.chunks(costs.tokens(*shape))[0])
            chunked_failed = self.failed_head is not None and self.failed_head.mode is HeadMode.CHUNKED
            tried = {b for b, _ in self.tried}
            first = next((b for b in blocks if b not in tried), blocks[-1])
            if (self.attempt >= 2 and chunked_failed) or (first, head) in self.tried:
                head = smallest
        candidates = list(dict.fromkeys([(b, head) for b in blocks] + [(b, smallest or head) for b in blocks]))
        untried = [c for c in candidates if c not in self.tried] or candidates[-1:]
        at = self.failed_shape

        def peak(plan: tuple[tuple[Mode, ...], HeadChoice | None]) -> float | None:
            return self.predict(plan[0], *at, 0, plan[1])

        if self.head_short is not None and self.costs.known:
            untried = [c for c in untried if self._frees_the_head(*c, shape)]
            if not untried:  # none leaves the head what it lacked: running one would fail there again
                return (*min(candidates, key=peak), True)

        failed = [peak(c) for c in self.tried] if at is not None else [None]
        if None in failed or min(failed) <= 0:  # nothing predicted (a calibration step failed): by rank alone
            return (*untried[0], False)
        bar = min(failed) * (1 - RETRY_STEP)
        for c in untried:
            if peak(c) < bar:
                return (*c, False)
        # nothing predicted lower, but a size not run yet is predicted from others with margins, which
        # may rank the plans wrongly (a mixed plan under the uniform ones): a plan no looser in any block
        # than every plan that failed, and tighter in some, holds less whatever the figures say
        rank = ladder_ranks(self.allowed)
        for b, h in untried:
            if all(b != f and all(rank.get(m, 0) >= rank.get(g, 0) for m, g in zip(b, f)) for f, _ in self.tried):
                # unless a uniform plan not tried is predicted lower than it: the ladder's top need
                # not hold the least (CHECKPOINT+OFFLOAD recomputes a block whole in backward). Not
                # one looser than every block of a plan that failed: it holds more in each, whatever
                # figures that, for a size never run, are extrapolated (an Arcee's 4 x SELECTIVE,
                # predicted at 948 MiB, ran after 4 x OFFLOAD had failed, and ran out too)
                floors = [min(rank.get(g, 0) for g in f) for f, _ in self.tried]
                uniform = min(
                    (c for c in untried if len(set(c[0])) == 1 and all(rank.get(c[0][0], 0) >= r for r in floors)),
                    key=peak,
                    default=None,
                )
                if uniform is not None and peak(uniform) < peak((b, h)) * (1 - RETRY_STEP):
                    return (*uniform, False)
                return b, h, False
        if self.failed_unforeseen:
            # predicted to fit and failed: the figures, not the batch, are wrong (another process took
            # memory for a while, say), and the plan that failed runs again. A looser plan would hold
            # more whatever the figures say: on a Phi-3 whose loss was made outside its head, four
            # blocks in SELECTIVE ran after OFFLOAD and CHECKPOINT+OFFLOAD had failed
            return self.failed, self.failed_head, False
        return (*min(candidates, key=peak), True)

    def _frees_the_head(self, modes: tuple[Mode, ...], head: HeadChoice | None, shape: Shape) -> bool:
        """After an attempt ran out of memory in the loss head, a plan with that head holds, as the
        head runs, no more than that attempt's blocks did less what the head's allocation lacked (the
        error says both): no block's mode changes what the head itself needs. An OLMoE's batch past its
        longest, its head kept, ran three plans that each ran out there, short of the same 17 MiB."""
        if self.head_short is None or head != self.head_short[0] or not self.costs.known:
            return True
        rows = self.costs.options(*shape, self.allowed, fixed=dict(enumerate(modes)))
        return sum(row[0].saved for row in rows) <= self.head_short[1]

    def _guessed_uniform(self, head: HeadChoice | None) -> tuple[Mode, ...] | None:
        """Every block in a lossless mode whose figures are still a guess (no block has run it: a guess
        made to err high, which ranks its plans last), where that plan has not failed yet and may hold
        less than the plan that failed: it is no looser on the ladder than any block of that plan, or it
        offloads (keeps none of a block's saved tensors on the device) and that plan ran a block looser
        than it. A retry tries it before the plans the figures rank. On a mixture of experts OFFLOAD,
        never run, peaked at 90.2 MiB where CHECKPOINT+OFFLOAD, the ladder's top, peaked as CHECKPOINT
        did (118.7: it recomputes a block whole in backward); its retries climbed to the top and a batch
        that 4 x OFFLOAD fitted at 78% of the budget was given up, also after a first plan of three
        CHECKPOINT+OFFLOAD blocks and one NONE (its guess put OFFLOAD's bytes at three times theirs)."""
        if not self.policy.try_modes or self.failed is None:
            return None
        rank = ladder_ranks(self.allowed)
        ranks = [rank.get(m, 0) for m in self.failed]
        for mode in reversed(ladder(self.allowed)):
            plan = tuple(mode for _ in range(self.n))
            if not guessed(self.costs, mode) or (plan, head) in self.tried:
                continue
            if rank[mode] >= max(ranks) or (mode.offloads and rank[mode] > min(ranks)):
                return plan
        return None

    def _tighter_head(self, head: HeadChoice | None) -> HeadChoice | None:
        """After an OOM in a step whose head ran chunked, a retry's head is chunked too, its chunk no
        larger than the smallest that failed (a Llava's retries went from chunks of 64 tokens to the
        head kept, predicted no lower, then to chunks of 4,096). Where only a kept head failed it stays
        the planner's choice: chunking it changes the order of summation, so it is done where the
        figures call for it, not on every retry (the blocks tighten first)."""
        chunked = [h for _, h in self.tried if h is not None and h.mode is HeadMode.CHUNKED]
        if head is None or not chunked or self._head_allowed() == "kept":
            return head
        smallest = min(chunked, key=lambda h: h.chunk or 0)
        if head.mode is HeadMode.KEPT or (head.chunk or 0) > (smallest.chunk or 0):
            return smallest
        return head

    def _static(self) -> tuple[Mode, ...]:
        k = self.policy.every_k if self.policy.static_plan == "every-k" else max(1, round(math.sqrt(self.n)))
        return tuple(Mode.CHECKPOINT if (i + 1) % k == 0 else Mode.NONE for i in range(self.n))

    def _tighter_than_failed(self, modes: tuple[Mode, ...], shape: Shape) -> list[tuple[Mode, ...]]:
        """Plans no looser anywhere than the failed one, in the order a retry tries them: the
        planner's own made no looser, each block one rung up the ladder, then uniform plans,
        tightest predicted first (those tried already stay in: the head may differ)."""
        allowed = self.allowed
        rank = ladder_ranks(allowed)
        failed = self.failed
        merged = tuple(m if rank.get(m, 0) >= rank.get(f, 0) else f for m, f in zip(modes, failed))
        candidates = [merged, tuple(step_up(f, allowed) for f in failed)]
        candidates += [tuple(m for _ in failed) for m in self._uniform_by_peak(shape)]
        unique = list(dict.fromkeys(candidates))
        return [c for c in unique if not self._holds_what_failed(c)] or unique

    def _holds_what_failed(self, modes: tuple[Mode, ...]) -> bool:
        """`modes` differs from a plan that failed in this step only by blocks in NONE, which keeps all
        a block saves, more than any mode: it holds at least what that plan held. A T5 whose figures
        were for another length (its source's) retried 4 x NONE, which had run a longer source, after
        3 x NONE and 1 x OFFLOAD ran out of memory."""
        return any(
            modes != f and all(m == g or m is Mode.NONE for m, g in zip(modes, f)) for f in {b for b, _ in self.tried}
        )

    def _uniform_by_peak(self, shape: Shape) -> list[Mode]:
        rungs = list(reversed(ladder(self.allowed)))
        if not self.costs.known:
            return rungs
        start = self.probe.allocated()
        return sorted(rungs, key=lambda m: self.predict(tuple(m for _ in range(self.n)), *shape, start) or 0.0)

    # ----------------------------------------------------------------- resume
    def ran_state(self) -> list:
        """`ran_at` for a saved state: [batch, extent, resident, modes, head, bytes above the start]."""
        return [
            [b, e, r, [m.label for m in modes], head.label if head is not None else None, above]
            for (b, e, r), (modes, head, above) in self.ran_at.items()
        ]

    def load_ran_state(self, state: list) -> None:
        self.ran_at = OrderedDict(
            (
                (int(b), int(e), bool(r)),
                (tuple(Mode.parse(m) for m in modes), HeadChoice.parse(h) if h else None, above),
            )
            for b, e, r, modes, h, above in state
        )

    def state_dict(self) -> list:
        return [
            [
                list(k),
                [m.label for m in r.modes],
                r.start,
                r.predicted,
                r.extent,
                r.seen,
                r.learned,
                r.head.label if r.head is not None else None,
            ]
            for k, r in self.cache.items()
        ]

    def load_state_dict(self, state: list) -> None:
        self.cache = OrderedDict()
        self._planned = {tuple(k) for k, *_ in state}
        self._predicted_for = None  # the cost model was loaded beside it
        for k, modes, start, pred, extent, seen, learned, head in state:
            k = tuple(k)
            head = HeadChoice.parse(head) if head else None
            self.cache[k] = PlanRecord(
                tuple(Mode.parse(m) for m in modes),
                k,
                extent,
                start,
                pred,
                "resume",
                learned=learned,
                seen=seen,
                head=head,
            )
