"""What the cost model's fits know, and so which steps need measuring: the sizes measured at a
batch, how far past them a size is predicted, and the offloads whose only time is a cold one.
"""

from __future__ import annotations

from adaptmem.control.costs import CostModel
from adaptmem.modes import Mode

#: Sizes measured at a batch before the others are predicted from the fits rather than measured:
#: two fix both terms of an activation's fit (tokens, and tokens x sequence for attention's scores).
GENERALISE_AFTER = 2
#: How far past the largest size measured at a batch a new one is still predicted rather than
#: measured. Further out, the step is measured, once each time the largest grows by as much: the
#: far fits answer "how long can I go" (`reach`), where a few percent of the peak is a long stretch
#: of tokens, and a user creeping up to the answer gives them the sizes that check it (an Exaone
#: measured up to 749 tokens a sample was answered 1,087 again after steps at 978 and 1,087, which
#: read only their peaks, and the step at 1,087 peaked 1.4% over the limit; the limit was four
#: times the largest size with three measured).
PREDICT_PAST = 1.25


def sizes(costs: CostModel, batch: int) -> set[int]:
    """The input sizes (elements per sample) measured block by block at `batch`."""
    return {s for b, s in costs.latent[0]["input_bytes"].points if b == batch} if costs.latent else set()


def known(costs: CostModel, batch: int, extent: int) -> bool:
    """This shape is measured, or `covers` holds: a plan is made for it, not for its bucket's top."""
    return costs.measured(batch, extent) or covers(costs, batch, extent)


def covers(costs: CostModel, batch: int, extent: int) -> bool:
    """The fits cover this shape closely: `generalises` at this batch, and this one at most the
    policy's `bucket_ratio` past the largest size measured (further out is extrapolation, which a
    plan makes with the bucket's margin)."""
    measured = sizes(costs, batch)
    return len(measured) >= GENERALISE_AFTER and extent <= max(measured) * costs.policy.bucket_ratio


def generalises(costs: CostModel, batch: int, extent: int) -> bool:
    """`GENERALISE_AFTER` sizes or more are measured at this batch, and this one is no further past
    the largest than `PREDICT_PAST` allows: it is predicted, not measured."""
    measured = sizes(costs, batch)
    if len(measured) < GENERALISE_AFTER:
        return False
    return extent <= max(measured) * PREDICT_PAST


#: Modes whose figures are a guess until a block runs them, and which a plan tries on one block once
#: per run (`PlanBook._trial`): the lossless ones that the other modes' measurements do not reveal.
TRIED = (Mode.SELECTIVE, Mode.OFFLOAD)


def measured_kinds(costs: CostModel, mode: Mode) -> set[str]:
    """The kinds of block (`CostModel.kinds`) some block of which has been measured in `mode`."""
    kinds = costs.kinds
    return {kinds[i] for i, d in enumerate(costs.direct) if mode in d}


def guessed(costs: CostModel, mode: Mode, index: int | None = None) -> bool:
    """`mode` is one of `TRIED` and no block of block `index`'s kind (its class, made of the same
    modules: `CostModel.kinds`) has been measured in it; with no `index`, of some kind. A hybrid's
    Mamba layers learn nothing of a mode from its attention layers of the same class."""
    if mode not in TRIED:
        return False
    measured = measured_kinds(costs, mode)
    if index is not None:
        return costs.kinds[index] not in measured
    return len(measured) < len(set(costs.kinds))


def guessed_in(costs: CostModel, modes: tuple[Mode, ...]) -> set[Mode]:
    """The modes of the plan `modes` that it runs on some block whose kind has not been measured in
    them (`guessed` for each block, with each mode's measured kinds read once)."""
    kinds, out = costs.kinds, set()
    for mode in set(modes) & set(TRIED):
        measured = measured_kinds(costs, mode)
        if any(m is mode and kinds[i] not in measured for i, m in enumerate(modes)):
            out.add(mode)
    return out


def needs_warm(costs: CostModel, modes: tuple[Mode, ...]) -> bool:
    """Some block offloaded under `modes` has only its first (cold) time reading, and no block of
    its class a warm one: the pooled figures stand for a cold block while another has one."""
    if not costs.cold:  # every step asks: most have nothing cold
        return False

    def warm_reading(i: int, m: Mode) -> bool:
        fit = costs.direct[i].get(m, {}).get("seconds")
        return (i, m) not in costs.cold and fit is not None and fit.settled

    warm = {(costs.classes[i], m) for i, m in costs.offloaded if warm_reading(i, m)}
    return any((i, m) in costs.cold and (costs.classes[i], m) not in warm for i, m in enumerate(modes))
