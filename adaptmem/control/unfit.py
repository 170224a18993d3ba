"""A batch no plan can fit: given up at once, and leaving no trace.

A step is refused with `StepOutOfMemoryError` at its plan point (the first
managed block's forward, before that block runs) when

  - it is a retry and no plan is predicted lower, by `RETRY_STEP` of its bytes,
    than every plan that already ran out of memory in the step, nor tighter in
    every block than each of them (`PlanRecord.exhausted`): the tightest plan was
    seen not to fit, and running another at the same predicted peak would only
    fail again; or
  - its very shape has been measured, no plan is predicted to fit, and the
    tightest plan is predicted over the device's usable memory even with
    `REFUSE_MARGIN` of its bytes above the step's start taken off (predictions of
    plans run at measured shapes stay well within that), or `UNRUN_REFUSE_MARGIN`
    where some block never ran its mode at this shape (its figures borrowed from a
    block alike or carried from other sizes: a Phi model's four blocks offloaded,
    after two had run offloaded, were predicted 44% over their bytes above the
    start, and the batch, refused, would have fitted).

A shape not measured yet runs once under the tightest plan: beyond the lengths
measured the figures are extrapolated, and one attempt settles it. The error
names the batch's size, the tightest plan's predicted peak, the floor (what is
allocated before the step: weights, optimizer state), the budget and the
device's usable memory, and the longest length predicted to fit.

No trace: what the controller learns and decides from (the cost model, the
lengths seen, the decider, the cached plans and which shapes were measured) is
put back as it was before the batch, so a run that catches the error and goes on
makes the plans it would have made without that batch. Only "how long can I
go?" remembers it (`reach.GivenUp`, and `Lesson` where it ran out of memory
first), so as not to name its length again. The small parts are
copied at each step's start (a few dicts); the cost model only when the step
first runs out of memory, before it learns from the failed attempt (retries use
what that attempt measured).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptmem.config.units import format_bytes
from adaptmem.control.plans import PlanRecord
from adaptmem.control.retry import ROOM, attempt_text, counts_text, kept_head_text, phase_text

#: A measured shape is refused without running when even this share of its predicted bytes above
#: the step's start, taken off, leaves the tightest plan over the device's usable memory.
REFUSE_MARGIN = 0.25
#: The same where some block of that plan never ran its mode at this shape.
UNRUN_REFUSE_MARGIN = 0.5

__all__ = ["REFUSE_MARGIN", "UNRUN_REFUSE_MARGIN", "Lesson", "Trace", "refusal", "unfittable"]


@dataclass
class Trace:
    """The controller's learned and deciding state before a batch, put back if the batch is given up.
    The controller takes it (`Controller.trace`) and puts it back (`Controller.rewind`)."""

    decider: dict
    plans: tuple  # PlanBook.snapshot()
    measuring: Any  # a copy of the MeasureSchedule
    modes: tuple  # the plan in force
    head: Any
    replan_when_warm: bool
    costs: tuple | None = None  # CostModel.snapshot(), taken when the batch first ran out of memory
    lengths: dict | None = None

    def before_learning(self, costs: Any, lengths: Any) -> None:
        """The batch ran out of memory and is about to learn from it: keep the cost model as it was."""
        if self.costs is None:
            self.costs, self.lengths = costs.snapshot(), lengths.state_dict()


@dataclass
class Lesson:
    """What a batch given up after running out of memory taught, kept apart from what plans are
    made from: the cost model and lengths as its failed attempts left them, and its shape (samples,
    tokens a sample). Plans are made as if the batch had not come (`Trace`); "how long can I go?"
    answers no longer than this model does, so that a length refused is not named again. A
    ModernBERT answered 1,499 tokens at batch 4, was refused there, and answered 1,499 again;
    from what the failed attempt taught, 1,012, which trained. Kept until a step of as many samples
    or more, longer than the lesson's own answer, runs to its end (the cost model has measured past
    it), or another batch is given up so."""

    costs: tuple  # CostModel.snapshot()
    lengths: dict  # LengthsSeen.state_dict()
    batch: int
    seq: int
    longest: int  # the lesson's own answer at `batch` (0: none)

    def passed(self, batch: int, seq: int) -> bool:
        """A step of this shape ran to its end: what the lesson answers is behind the run."""
        return batch >= self.batch and seq > self.longest


def unfittable(
    record: PlanRecord, start: int, limit: int | None, measured: bool, ran: bool = True, guessed: bool = False
) -> bool:
    """The tightest plan, at a measured shape, is predicted over `limit` beyond the margin (the wider
    one where the plan has not `ran` there block for block). Not where its prediction is a guess
    (`guessed`: a mode no block of its kind has run, priced to err high): it runs once, measured. A
    Glm4Moe's retry under OFFLOAD, never run, was predicted at 93 MiB on a 39 MiB stand-in and the
    batch was given up; that plan trains it at 34."""
    if record.feasible or record.predicted is None or limit is None or not measured or guessed:
        return False
    margin = REFUSE_MARGIN if ran else UNRUN_REFUSE_MARGIN
    return start + (record.predicted - start) * (1 - margin) > limit


def below_floor(start: int, budget: int) -> str:
    """The message when, with other ranks, the budget is under what a rank holds as its step
    reaches its first block: no plan can keep it."""
    return (
        f"adaptmem: the budget ({format_bytes(budget)}, the smallest of the ranks') is below what a rank holds "
        f"as its step reaches its first block ({format_bytes(start)}: weights, gradients and optimizer state on "
        "the device; under FSDP2 its shards of them, plus the parameters gathered for the first blocks), so no "
        "plan can keep a step under it. Raise the budget (budget= in bytes or a share of the device), shard "
        "across more ranks, or keep the optimizer's state off the device."
    )


def refusal(
    record: PlanRecord,
    batch: int,
    extent: int,
    seq: int,
    start: int,
    attempts: list[dict],
    *,
    predicted: float | None,
    budget: int,
    limit: int | None,
    longest: Callable[[int], Any],
    largest: Callable[[int], Any] | None = None,
    elsewhere: bool = False,
    before: Any = None,
    failed_here: bool = False,
    head_kept_for: str | None = None,
    head_lacked: float | None = None,
) -> str:
    """The message of a refused step: what was asked, what the tightest plan needs (`predicted`),
    the budget and the device's usable memory (`limit`), and what fits (`longest(batch)`, a `Reach`).
    `elsewhere`: another rank gave the batch up, and every rank does. `before`: a batch given up earlier
    in the run (a `GivenUp`), no larger, with as much room or more, rules this one out. `failed_here`: the tightest
    plan is one that ran out of memory in this step (its prediction is wrong at this size).
    `head_kept_for`: why the loss head is kept for good, said where the plan keeps it. `head_lacked`:
    an attempt ran out in the loss head, short of these bytes, and no plan with its head frees them."""
    size = f"batch {batch} x {seq:,} tokens" if seq else f"batch {batch} x {extent:,} input elements"
    # after an attempt failed the plan is a retry's: the plans it retreats to, not the one predicted lowest
    named = "plan a retry would run" if attempts else "tightest plan"
    if elsewhere:
        why = "another rank found no plan predicted lower than those that ran out of memory there"
    elif before is not None:
        free = f": {format_bytes(before.free)} above the floor then" if before.free is not None else ""
        why = (
            f"a batch of {before.batch} x {before.length:,} tokens was given up earlier in this run with as much "
            f"room as this one or more{free}"
        )
    elif record.exhausted and head_lacked is not None:
        why = (
            f"it ran out of memory in the loss head or the loss, after every block's forward, "
            f"{format_bytes(head_lacked)} short, and no plan with that "
            "head holds that much less while it runs: a block's mode does not change what the head needs"
        )
    elif record.exhausted:
        why = (
            f"no plan was predicted lower than the {len(attempts)} that ran out of memory in this step, "
            "nor tighter in every block"
        )
    else:
        why = f"the {named} is predicted over the device's usable memory"
    counts = counts_text(Counter(m.label for m in record.modes))
    head = f", head {record.head.label}" if record.head is not None else ""
    lines = [
        f"adaptmem: {size} cannot fit under any plan ({why}); given up without running again.",
        f"  {named}: {counts}{head}; predicted peak now "
        + (format_bytes(predicted) if predicted is not None else "unknown")
        + ("; it ran out of memory in this step all the same" if failed_here else ""),
        f"  floor (allocated as the first block starts: weights, optimizer state, and what ran before it, "
        f"such as the embeddings): {format_bytes(start)}",
        f"  budget {format_bytes(budget)}" + (f"; device usable {format_bytes(limit)}" if limit is not None else ""),
    ]
    for i, a in enumerate(attempts, 1):
        lines.append(f"  attempt {i}: {attempt_text(a)} before it ran; out of memory {phase_text(a['phase'])}")
    if head_kept_for is not None and record.head is not None and record.head.label == "KEPT":
        lines.append(kept_head_text(head_kept_for))
    if largest is not None and seq:  # every step ran at one length (images of one size): batches vary
        fits = _figure(lambda: largest(seq).batch)
        fits = fits if fits is not None and fits < batch else None
        what = f"  The largest batch predicted to fit at {seq:,} tokens a sample: {fits:,}. " if fits else "  "
    else:
        fits = _figure(lambda: longest(batch).length) if seq else None
        if fits is not None and fits >= seq:  # the predictions this batch proved wrong: no answer from them
            fits = None
        what = f"  The longest sequence predicted to fit at batch {batch}: {fits:,} tokens. " if fits else "  "
    lines.append(
        what + f"Split or truncate this batch, lower the batch size, or {ROOM}. The controller's "
        "state is as it was before this batch: catch the error and go on to skip it."
    )
    return "\n".join(lines)


def _figure(read: Callable[[], int]) -> int | None:
    try:
        return read()
    except Exception:  # a prediction must never hide the error it explains
        return None
