"""How long can I go? The longest sequence, or the largest batch, that fits under the best plan.

After calibration the cost model predicts every block's bytes in every mode,
and the loss head's, for any shape (`adaptmem.control.costs`). A shape fits
when some plan (the blocks' modes and the head's, out of the policy's) is
predicted to peak within the limit: the device's usable size by default (what
others leave of it, less the policy's emergency margin), since the budget is
where plans aim, not where a step runs out of memory. The predicted peak is a
monotone function of the length and of the batch, so the longest length is
found by doubling past the longest measured one and bisecting back, one
feasibility check of the planner per length: a few milliseconds each.

The prediction is the cost model's: within the lengths a run has measured it is
as close as its step predictions (`prediction_error` in the log); beyond them
it is extrapolated from the fits (linear in the tokens, plus a quadratic term
where attention scores are held), and `Reach.extrapolated` says so. The
optimizer's own step (outside the forward and backward a manager manages) is not
counted: at long lengths it is far below the step's peak.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from adaptmem.config.units import format_bytes
from adaptmem.control.fits import Fit
from adaptmem.control.planner import Option, feasible, picked, predicted_peak
from adaptmem.control.planner import plan as solve
from adaptmem.control.samples import InputShape
from adaptmem.modes import Mode
from adaptmem.registrations import parameters_of

log = logging.getLogger("adaptmem")

#: Byte steps of the feasibility check: finer than the planner's own (each block's figure is
#: rounded up to a step, so the check errs short by at most blocks / BINS of the limit).
BINS = 8192
#: No length is searched past this (tokens per sample).
MAX_LENGTH = 1 << 24
#: Once a batch is given up (no plan fitted it, or every retry ran out of memory), no answer names
#: this share of its length or more at as many samples or more: the predictions near it proved wrong.
GIVEN_UP_BACKOFF = 0.9


@dataclass
class GivenUp:
    """A batch given up (no plan fitted it, or every retry ran out of memory): no answer names its
    shape, nor, from `GIVEN_UP_BACKOFF` of its length on, a length longer than a step of as many
    samples or more has trained at (`trained`: before it, then since)."""

    batch: int
    length: int  # tokens a sample
    room: int | None  # the device's usable bytes then: the answers under no more room are bound by it
    trained: int = 0
    free: int | None = None  # the room then above what the step held as its first block started

    def rules_out(self, batch: int, length: int) -> bool:
        if batch < self.batch:
            return False
        return length >= self.length or (length >= self.length * GIVEN_UP_BACKOFF and length > self.trained)

    def covers(self, shape: InputShape) -> bool:
        """`shape`, a sequence's, has as many samples or more, each as long or longer."""
        return bool(shape.width) and shape.batch >= self.batch and shape.seq >= self.length

    def ran(self, batch: int, length: int) -> bool:
        """A step of this shape ran to its end; True where it was this large or larger (it fits after all)."""
        if batch >= self.batch:
            self.trained = max(self.trained, length)
        return batch >= self.batch and length >= self.length


@dataclass(frozen=True)
class Reach:
    """A shape that fits, with the plan predicted to fit it.

    `length` is 0 when not even one token per sample fits (`batch` 0 when not one
    sample of `length` does). `extrapolated`: the shape is beyond what the run
    has measured (longer samples, or more tokens in the batch, than a step measured
    block by block had), so the figures are extrapolated from smaller ones.
    """

    batch: int
    length: int
    peak_bytes: int  # the predicted peak of `plan` at this shape (weights and optimizer state included)
    limit_bytes: int  # what it had to fit
    start_bytes: int  # allocated as its first block starts (weights, optimizer state, embeddings), in the peak
    plan: tuple[Mode, ...]
    head: str | None  # the loss head's choice ("KEPT", "CHUNKED:<tokens>"), None without a managed head
    extrapolated: bool
    measured_length: int  # the longest length (tokens per sample) the run has measured
    measured_tokens: int = 0  # the most tokens (batch x length) one step the run measured had
    trained: bool = False  # a step this large ran to its end within the limit: `peak_bytes` is its peak, read
    untried: tuple[str, ...] = ()  # modes counted by a guess made to err high: no block has run them yet
    trying: bool = False  # the next steps try them on a block (the policy's `try_modes`)
    untried_on: tuple[str, ...] = ()  # the classes of the blocks yet to run them, where blocks of another kind have
    positions: int = 0  # the model's configured positions (`max_position_embeddings`) where the length is past them

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def __str__(self) -> str:
        return self._answer() + self._untried_note() + self._positions_note()

    def _positions_note(self) -> str:
        if not self.positions or self.length <= self.positions:
            return ""
        return (
            f". That is past the model's max_position_embeddings ({self.positions:,}): memory allows it, but a "
            "model with a table of positions fails there (a CodeGen raised IndexError at 3,000 tokens), and "
            "rotary positions run on positions the model was not configured for"
        )

    def _untried_note(self) -> str:
        if not self.untried:
            return ""
        modes = " and ".join(self.untried)
        then = (
            "; the next steps try each on one block where the budget leaves room for it (a step whose plan "
            "needs every block's saving leaves none), and an answer asked after them counts what they showed"
            if self.trying
            else " (the policy's try_modes is off)"
        )
        on = f"its {', '.join(self.untried_on)} blocks" if self.untried_on else "this model's blocks"
        return f". {modes} not measured on {on} yet: counted by a guess made to err high, so this may be short{then}"

    def _answer(self) -> str:
        if self.batch <= 0 or self.length <= 0:
            what = (
                f"one token a sample at batch {self.batch}"
                if self.length <= 0
                else f"one sample of {self.length:,} tokens"
            )
            return (
                f"nothing fits: not even {what} is predicted to fit in {format_bytes(self.limit_bytes)}, over the "
                f"{format_bytes(self.start_bytes)} allocated as the first block starts (weights, optimizer state)"
            )
        plan = ", ".join(f"{label} x{n}" for label, n in Counter(m.label for m in self.plan).items())
        head = f"; head {self.head}" if self.head else ""
        note = (
            f" (extrapolated past the steps measured block by block: at most {self.measured_length:,} tokens "
            f"a sample, {self.measured_tokens:,} a batch)"
            if self.extrapolated
            else ""
        )
        if self.trained:  # the figures predicted it over the limit: a step that ran says otherwise
            return (
                f"batch {self.batch} x {self.length:,} tokens: a step this large trained at a peak of "
                f"{format_bytes(self.peak_bytes)} of {format_bytes(self.limit_bytes)} under {plan}{head} "
                "(the figures predict it over)"
            )
        return (
            f"batch {self.batch} x {self.length:,} tokens{note}: predicted peak {format_bytes(self.peak_bytes)} "
            f"of {format_bytes(self.limit_bytes)} under {plan}{head}"
        )

    def as_record(self) -> dict:
        return {
            "batch": self.batch,
            "length": self.length,
            "peak_bytes": self.peak_bytes,
            "limit_bytes": self.limit_bytes,
            "plan": [m.label for m in self.plan],
            "head": self.head,
            "extrapolated": self.extrapolated,
            "trained": self.trained,
            "untried": list(self.untried),
            "positions": self.positions,
        }


def position_limit(model: torch.nn.Module) -> int:
    """The positions a Hugging Face model's config says it takes (`max_position_embeddings`, which
    GPT-2's and CodeGen's `n_positions` answer to), or 0 where it says none."""
    for candidate in (model, getattr(model, "module", None)):
        value = getattr(getattr(candidate, "config", None), "max_position_embeddings", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def gradient_bytes(model: torch.nn.Module, device_type: str) -> int:
    """The bytes of the weights' gradients `model` holds on devices of `device_type` now, each
    storage once (a sharded parameter's: this rank's part)."""
    seen, total = set(), 0
    for p in parameters_of(model):
        grad = p.grad
        if grad is None:
            continue
        grad = getattr(grad, "_local_tensor", grad)  # a DTensor: the shard this rank holds
        if grad.device.type != device_type:
            continue
        storage = grad.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class LengthsSeen:
    """What a run's steps showed of its sequences: the main input's elements per token (its
    hidden size), the longest length measured and the most tokens in one measured step, and
    the largest allocation a step started from (weights, optimizer state), without the weights'
    gradients and, where a step found them there (accumulation), with them. Those of a saved run
    hold until this manager's steps have started in that state: a resumed run, or a second fit
    with a new Trainer, starts from what it holds now (an earlier Trainer's optimizer state, held
    while the saved run ran and dropped since, is not counted against every answer after it)."""

    def __init__(self) -> None:
        self.width = 0
        self.measured_length = 0
        self.shortest = 0  # the shortest length measured (0: none, or a state saved before it was kept)
        self.measured_tokens = 0
        self.start = 0
        self.start_resident = 0  # 0: no step started with the gradients resident
        self._saved = (False, False)  # `start`, `start_resident` are a saved run's, no step here since
        # a step started without the gradients after one had started with them (accumulation, where
        # each step's first micro-batch does): without, only the run's first steps did (a loop that
        # zeroes them inside its step, as Lightning's closure does), and the steps to come will not
        self.fresh_again = False
        # allocated from the step's start to its first block's (embeddings, position tables, masks):
        # it grows with the batch and the length, where the start does not
        self.before = Fit("act")

    def learn(self, sample, completed: bool = True) -> None:
        """A step measured block by block: tokens are dimension 1 of a (batch, tokens, hidden) input.
        One that ran out of memory (`completed` False) measured some blocks, not the step: its length
        is no length measured (a Falcon-H1's batch of 2 x 16,384 given up in forward, at 2 x 832 measured,
        had the answer after it called 4,222 tokens no extrapolation)."""
        if sample.width > 0 and completed:
            if sample.width != self.width:  # another kind of input: its lengths start over
                self.width, self.measured_length, self.measured_tokens, self.shortest = sample.width, 0, 0, 0
            self.measured_length = max(self.measured_length, sample.seq)
            self.shortest = min(self.shortest, sample.seq) if self.shortest else sample.seq
            self.measured_tokens = max(self.measured_tokens, sample.batch * sample.seq)
        if sample.blocks and sample.batch * sample.extent > 0:
            self.before.add(sample.batch, sample.extent, max(0, sample.blocks[0].start - sample.start))

    @property
    def one_length(self) -> int | None:
        """The one length every step measured ran at (a vision tower's patches on images of one size,
        text padded to one length), or None."""
        return self.measured_length if self.shortest and self.shortest == self.measured_length else None

    def started(self, sample) -> None:
        """A step that ran to its end, measured block by block or not: what it started from. (An
        optimizer's state appears at its first step, after the run's first micro-batches, and the
        steps after that may all be light ones.)"""
        fresh, resident = self._saved
        if sample.grads_resident:
            self.start_resident = sample.start if resident else max(self.start_resident, sample.start)
            self._saved = (fresh, False)
        else:
            self.start = sample.start if fresh else max(self.start, sample.start)
            self.fresh_again = self.fresh_again or self.start_resident > 0
            self._saved = (False, resident)

    def reacher(self, costs, plans, limit: int, allocated: int, lock=None, gradients: int = 0) -> Reacher:
        """`allocated`: the device's allocation now, between steps (0 inside one); `gradients`: the
        bytes of the weights' gradients in it, which a step that starts without them does not start
        with (a loop that zeroes them inside its step, as Lightning's closure does, keeps the last
        step's until then)."""
        if not costs.known:
            raise RuntimeError(
                "nothing is measured yet: run a training step or more under this manager first "
                "(the first is its calibration), then ask; the figures are for the model as "
                "those steps ran it"
            )
        if not self.width:
            raise RuntimeError(
                "the blocks' main input has no sequence dimension (it is not batch x tokens x "
                "hidden, nor a stack of them, n x batch x tokens x hidden), so there is no sequence "
                "length to predict"
            )
        starts = []  # the states the run's steps start in, each with its start
        if not self.start_resident or self.fresh_again:  # steps without the gradients come again
            starts.append((False, max(self.start, allocated - gradients)))
        if self.start_resident:
            starts.append((True, max(self.start_resident, allocated)))
        return Reacher(
            costs,
            plans,
            width=self.width,
            starts=starts,
            limit=limit,
            measured=(self.measured_length, self.measured_tokens),
            lock=lock,
            before=self.before.predict,
        )

    def state_dict(self) -> dict:
        return {
            "width": self.width,
            "measured_length": self.measured_length,
            "shortest": self.shortest,
            "measured_tokens": self.measured_tokens,
            "start": self.start,
            "start_resident": self.start_resident,
            "fresh_again": self.fresh_again,
            "before": self.before.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.width, self.measured_length = state.get("width", 0), state.get("measured_length", 0)
        self.measured_tokens = state.get("measured_tokens", self.measured_length)  # a state saved before it
        self.shortest = state.get("shortest", 0)
        self.start = state.get("start", 0)
        self.start_resident = state.get("start_resident", 0)  # a state saved before it: none
        self._saved = (True, True)
        self.fresh_again = state.get("fresh_again", True)  # a state saved before it: both states asked
        self.before = Fit.from_state(state["before"]) if "before" in state else Fit("act")


def end_record(ctl) -> dict | None:
    """For a log's end record (`adaptmem report`): the longest sequence at the last step's batch."""
    last = ctl.events.last("step")
    if ctl.events.path is None or last is None or not ctl.costs.known or not ctl.lengths.width:
        return None
    try:
        batch = max(1, int(last.get("batch") or 1))
        return ctl.answer(None, lambda reacher: reacher.longest(batch)).as_record()
    except Exception as err:  # a prediction must never stop a run from closing
        log.warning("adaptmem: the longest sequence could not be predicted for the log: %s", err)
        return None


class Reacher:
    """Answers for one manager's cost model and plans; `width` is the main input's elements
    per token (its hidden size).

    `starts`: (whether the weights' gradients are resident, the allocation a step starts from) for
    each state the run's steps started in. A run that accumulates gradients runs steps of both, and
    a shape fits where it fits in each: the first micro-batch allocates the gradients in its
    backward, the others start with them."""

    def __init__(
        self,
        costs,
        plans,
        *,
        width: int,
        starts: list,
        limit: int,
        measured: tuple[int, int],
        lock=None,
        before=None,
    ) -> None:
        self.costs, self.plans = costs, plans
        # the bytes from a step's start to its first block's, at (batch, elements a sample)
        self.before = before if before is not None else (lambda batch, extent: 0.0)
        # held while the cost model is asked in a state other than the one it plans (the manager's)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.width, self.starts, self.limit = width, starts, limit
        self.given_up: list[GivenUp] = []  # batches given up, that bound the answers
        self.measured_length, self.measured_tokens = measured  # the longest sample, the most tokens a step

    @property
    def start(self) -> int:
        return max(start for _, start in self.starts)

    def rows(self, batch: int, length: int) -> tuple[list[list[Option]], float]:
        """The planner's rows for this shape (the head's last, where it is managed) and the bytes
        after the blocks that no choice changes, in the gradients' state the cost model expects."""
        extent = length * self.width
        rows = self.costs.options(batch, extent, self.plans.allowed, dict(self.plans.pinned))
        head = self.plans.head_row((batch, extent))
        return (rows + [head], 0.0) if head else (rows, self.costs.head_bytes(batch, extent))

    def _states(self, batch: int, length: int) -> Iterator[tuple[bool, int]]:
        """Each state the run's steps start in, with the cost model asked in it: (whether the
        gradients are resident, the allocation as the first block starts at this shape)."""
        before = int(self.before(batch, length * self.width))
        for resident, start in self.starts:
            with self.lock, self.costs.expecting(resident):
                yield resident, start + before

    def trained(self, batch: int, length: int, resident: bool) -> tuple | None:
        """Of the plans that ran a step this large or larger to its end (as many samples or more, as
        many elements a sample or more) in this gradients' state (`PlanBook.ran`, light steps too) with
        a head that can still run so, the one of the lowest peak: (modes, head, bytes above its first
        block's start), or None."""
        extent, best = length * self.width, None
        for (b, e, r), entry in self.plans.ran_at.items():
            if r is not resident or b < batch or e < extent or not self.plans.head_runs(entry[1]):
                continue
            if best is None or entry[2] < best[2]:
                best = entry
        return best

    def fits(self, batch: int, length: int) -> bool:
        """Some plan is predicted to fit this shape in each state the run's steps start in, or a step
        as large trained there within the room: what ran is evidence the figures must not overrule (a
        Nemotron that trained 2 x 6,953 tokens at 76% of the usable memory was answered 6,319)."""
        near = [g for g in self.given_up if g.rules_out(batch, length)]
        if any(batch >= g.batch and length >= g.length for g in near):
            return False  # a batch given up, or a larger one
        # a step this large trained within the room in every state: it fits, also near a batch given up
        trained = True
        for resident, start in self._states(batch, length):
            room = self.limit - start
            if room <= 0:
                return False
            ran = self.trained(batch, length, resident)
            if ran is not None and ran[2] <= room:
                continue
            trained = False
            if self.costs.tail_bytes(batch, length * self.width) > room:
                return False
            rows, final = self.rows(batch, length)
            if not feasible(rows, room, final, BINS, self.costs.order):
                return False
        return trained or not near  # near a batch given up, the figures' word alone is not taken

    def longest(self, batch: int) -> Reach:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        length = _largest(lambda n: self.fits(batch, n), max(1, self.measured_length))
        return self.reach(batch, length)

    def largest_batch(self, length: int) -> Reach:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be a positive int (tokens per sample), got {length!r}")
        batch = _largest(lambda b: self.fits(b, length), 1)
        return self.reach(batch, length)

    def reach(self, batch: int, length: int) -> Reach:
        """The plan predicted to fit this shape, as adaptmem would choose it (the cheapest that fits),
        in the gradients' state whose peak is the higher."""
        if batch <= 0 or length <= 0:
            return Reach(batch, length, self.start, self.limit, self.start, (), None, False, *self.measured_figures)
        highest, seen = None, True
        for resident, start in self._states(batch, length):
            rows, final = self.rows(batch, length)
            result = solve(rows, self.limit - start, final, BINS, self.costs.order)
            chosen = picked(rows, result.modes)
            order = self.costs.order
            peak = start + max(predicted_peak(chosen, final, order), self.costs.tail_bytes(batch, length * self.width))
            modes, head = result.modes, None
            if self.costs.head_costs is not None:
                modes, head = modes[:-1], modes[-1]
            ran = self.trained(batch, length, resident)
            if not result.feasible and ran is not None and start + ran[2] <= self.limit:
                peak, (modes, head) = start + ran[2], ran[:2]  # predicted over, but a step as large trained
            else:
                seen = False
            if highest is None or peak > highest[0]:
                highest = (peak, start, tuple(modes), head.label if head is not None else None)
        peak, start, modes, head = highest
        extrapolated = (
            not seen
            and not self.costs.measured(batch, length * self.width)
            and (length > self.measured_length or batch * length > self.measured_tokens)
        )
        return Reach(
            batch,
            length,
            int(peak),
            self.limit,
            start,
            modes,
            head,
            extrapolated,
            *self.measured_figures,
            trained=seen,
        )

    @property
    def measured_figures(self) -> tuple[int, int]:
        return self.measured_length, self.measured_tokens


def _largest(fits, hint: int) -> int:
    """The largest n >= 1 with fits(n) (fits is monotone: true up to some n, false after), or 0."""
    if not fits(1):
        return 0
    low = 1
    high = max(2, hint)
    while fits(high):  # double past the hint until it no longer fits
        low, high = high, high * 2
        if high > MAX_LENGTH:
            return low
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low
