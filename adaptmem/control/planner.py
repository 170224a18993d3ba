"""The planner: one mode per block, cheapest predicted overhead, predicted peak within budget.

A pure function of predicted figures; it touches no device. In forward order,
block i keeps `saved` bytes until its backward; at its worst moment (its
forward transient, or its backward with everything before it still saved) it
needs `need` bytes above the bytes saved by the blocks before it. So a plan
fits when, for every block i,

    saved_1 + ... + saved_{i-1} + need_i  <=  capacity
    saved_1 + ... + saved_n   + final     <=  capacity    (the head and loss after the blocks)

and the planner minimizes the sum of `seconds`. This is a multiple-choice
knapsack with prefix constraints, solved exactly by dynamic programming over
the prefix sum, on a byte axis of `bins` steps over the capacity. Every byte
count is rounded up to a step, so a plan the planner calls feasible is feasible
in exact bytes; with integer sizes and a capacity of at most `bins` bytes the
axis is exact to the byte.

When nothing fits, the result is the tightest plan (smallest predicted peak;
among those, the one that holds least, then the cheapest) with `feasible=False`
and the shortfall in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from adaptmem.modes import Mode


@dataclass(frozen=True)
class Option:
    """One mode's predicted figures for one block."""

    mode: Mode
    saved: float  # bytes held from the block's forward until its backward
    need: float  # bytes needed above the earlier blocks' saved bytes at the block's worst moment
    seconds: float  # time the mode adds to a step (lossy modes also carry their penalty here)
    host: float = 0.0  # host bytes the mode keeps


@dataclass(frozen=True)
class PlanResult:
    modes: tuple[Mode, ...]
    seconds: float  # predicted overhead of the plan
    peak: float  # predicted peak above the fixed part (bytes), in exact figures
    feasible: bool
    shortfall: float  # bytes over capacity when infeasible, else 0.0


def picked(options: list[list[Option]], modes: tuple) -> list[Option]:
    """The option each row's mode picks (`modes[i]` from `options[i]`)."""
    return [next(o for o in row if o.mode is m) for row, m in zip(options, modes)]


def in_order(rows: list, order: list[int] | None) -> list:
    """`rows` (one per block by index, then any after the blocks: a loss head's) in the order a forward
    runs the blocks (`order`, their indices as they run; None: as indexed)."""
    if order is None:
        return rows
    return [rows[i] for i in order] + rows[len(order) :]


def by_index(modes: tuple, order: list[int] | None) -> tuple:
    """Modes chosen for rows `in_order`, put back by block index."""
    if order is None:
        return modes
    out = list(modes)
    for k, i in enumerate(order):
        out[i] = modes[k]
    return tuple(out)


def predicted_peak(chosen: list[Option], final: float = 0.0, order: list[int] | None = None) -> float:
    """max over blocks of (earlier saved + need), and total saved + final; `chosen` by block index,
    summed in the order a forward runs them (`in_order`)."""
    prefix, peak = 0.0, 0.0
    for option in in_order(chosen, order):
        peak = max(peak, prefix + option.need)
        prefix += option.saved
    return max(peak, prefix + final)


def plan(
    options: list[list[Option]],
    capacity: float,
    final: float = 0.0,
    bins: int = 1024,
    order: list[int] | None = None,
) -> PlanResult:
    """The cheapest plan whose predicted peak is within `capacity` (bytes).

    options[i] lists the modes block i may take (restrict a block to one
    option to fix its mode, e.g. a block that already ran this forward);
    `order`: the blocks' indices in the order a forward runs them (`in_order`).
    """
    if order is not None:
        result = plan(in_order(options, order), capacity, final, bins)
        return replace(result, modes=by_index(result.modes, order))
    if not options:
        return PlanResult((), 0.0, final, final <= capacity, max(0.0, final - capacity))
    if any(not opts for opts in options):
        raise ValueError("every block needs at least one option")
    found = _solve(options, capacity, final, bins, use_cost=True)
    if found is not None:
        return _result(options, found, final, capacity, feasible=True)
    tight = tightest_capacity(options, final, bins)
    # at the tightest peak, the plan that holds least (then the cheapest): where one block's need no
    # mode lowers sets that peak, the cheapest under it kept a Zamba2's last block in NONE, predicted
    # at 648 MiB, where the others' figures put every block offloaded at 270 MiB; far past what ran,
    # that need is the least trusted of the figures, and holding less is the better chance
    holding = [[replace(o, seconds=o.saved + o.seconds) for o in opts] for opts in options]
    found = _solve(holding, tight, final, bins, use_cost=True)
    if found is None:  # pragma: no cover - tightest_capacity guarantees a solution
        raise RuntimeError("planner found no plan at the tightest capacity")
    return _result(options, found, final, capacity, feasible=False)


def feasible(
    options: list[list[Option]], capacity: float, final: float = 0.0, bins: int = 1024, order: list[int] | None = None
) -> bool:
    """Some plan's predicted peak is within `capacity` (each figure rounded up to a step of
    `capacity / bins`, so a borderline plan may be called infeasible, never the reverse)."""
    return bool(options) and _solve(in_order(options, order), capacity, final, bins, use_cost=False) is not None


def tightest_capacity(options: list[list[Option]], final: float = 0.0, bins: int = 1024) -> float:
    """The smallest capacity (to within 0.1%) at which some plan fits."""
    low = max([final] + [min(o.need for o in opts) for opts in options])
    high = max(1.0, predicted_peak([min(opts, key=lambda o: (o.saved, o.need)) for opts in options], final))
    high = max(high, predicted_peak([min(opts, key=lambda o: o.need) for opts in options], final))
    while _solve(options, high, final, bins, use_cost=False) is None:
        high *= 1.5  # rounding to bins can push the greedy bound just over
    low = max(low, 1.0)
    while high - low > max(1.0, 0.001 * high):
        mid = (low + high) / 2
        if _solve(options, mid, final, bins, use_cost=False) is None:
            low = mid
        else:
            high = mid
    return high


_CHUNK = 8  # blocks whose index rows are built at once: small enough to stay in cache, never mapped afresh


def _solve(options, capacity, final, bins, *, use_cost: bool) -> list[int] | None:
    if capacity <= 0:
        return None
    quantum = max(1.0, capacity / bins)
    top = int(math.floor(capacity / quantum + 1e-9))
    n, width = len(options), max(len(opts) for opts in options)
    flat: list[float] = []
    for opts in options:
        for o in opts:
            flat += (o.saved, o.need, o.seconds if use_cost else 0.0)
        flat += (math.inf, math.inf, 0.0) * (width - len(opts))  # padding: never fits
    raw = torch.tensor(flat, dtype=torch.float64).view(n, width, 3)
    sizes = (raw[..., :2] / quantum - 1e-9).ceil_().clamp_(0, top + 1).to(torch.int32)  # rounded up to bins
    saved, need, cost = sizes[..., 0], sizes[..., 1], raw[..., 2]
    span = top + 1
    # The prefix sum j after block i is reached from j - saved, which must lie in [0, top - need]
    # (the block's peak fits), so j <= lim. Each row of best costs per prefix sum sits behind
    # `pad` infinities: a source below 0 reads infinity by itself, and a choice with j > lim is
    # sent to entry 0. The rows are built a few blocks at a time, in integer arithmetic only:
    # boolean masks, and large temporaries that the allocator maps afresh on every call, would
    # cost more than the loop itself.
    pad = int(saved.max()) + 1
    lim = saved + top - need
    ramp = torch.arange(span, dtype=torch.int32)
    cost_rows = cost[:, :, None].unbind(0)
    source = torch.full((pad + span,), math.inf, dtype=torch.float64)
    source[pad] = 0.0
    sources = [source]  # sources[i]: best cost per prefix sum after i blocks, behind the pad
    grid = torch.empty((width, span), dtype=torch.float64)  # block i's cost per choice and prefix sum
    flat_grid = grid.view(-1)
    for first in range(0, n, _CHUNK):
        rows = _source_rows(saved[first : first + _CHUNK], lim[first : first + _CHUNK], ramp, pad)
        after = torch.full((len(rows), pad + span), math.inf, dtype=torch.float64)
        for row, out, best in zip(rows, after.unbind(0), after[:, pad:].unbind(0)):
            # three kernels a block: this loop is the planner's time
            torch.index_select(sources[-1], 0, row, out=flat_grid)
            grid.add_(cost_rows[len(sources) - 1])
            torch.amin(grid, 0, out=best)
            sources.append(out)
    final_bins = _up(final, quantum)
    if final_bins > top:
        return None
    tail = sources[n][pad : pad + top - final_bins + 1]
    if not torch.isfinite(tail).any():
        return None
    end = int(torch.nonzero(tail == tail.min())[0])  # cheapest, then the smallest total saved
    saved_rows, lim_rows, cost_list = saved.tolist(), lim.tolist(), cost.tolist()
    deepest = pad - 1  # the largest step back a choice takes
    picked: list[int] = []
    for i in range(n - 1, -1, -1):  # back from the end: the first choice that reached it
        # what each choice would have cost to reach `end`, recomputed as the loop computed it
        window = sources[i][pad + end - deepest : pad + end + 1].tolist()  # the rows it can come from
        column = [
            window[deepest - s] + c if end <= cap else math.inf
            for s, cap, c in zip(saved_rows[i], lim_rows[i], cost_list[i])
        ]
        m = column.index(min(column))
        picked.append(m)
        end -= saved_rows[i][m]
    return picked[::-1]


def _source_rows(saved, lim, ramp, pad) -> tuple:
    """Per block, the flat (choice, prefix sum) index into the previous row: pad + j - saved, or 0."""
    lim = lim[:, :, None]
    over = lim - ramp  # < 0 where the block's peak does not fit
    rows = (lim + (pad - saved)[:, :, None]) - over
    rows.add_(over.clamp_(max=0), alpha=pad + len(ramp)).clamp_(min=0)
    return rows.view(len(rows), -1).unbind(0)


def _up(value: float, quantum: float) -> int:
    return max(0, int(math.ceil(value / quantum - 1e-9)))


def _result(options, picked, final, capacity, *, feasible: bool) -> PlanResult:
    chosen = [opts[m] for opts, m in zip(options, picked)]
    peak = predicted_peak(chosen, final)
    return PlanResult(
        modes=tuple(o.mode for o in chosen),
        seconds=sum(o.seconds for o in chosen),
        peak=peak,
        feasible=feasible,
        shortfall=0.0 if feasible else max(0.0, peak - capacity),
    )
