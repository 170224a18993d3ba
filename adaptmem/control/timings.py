"""What a mode adds to a step's time: the time half of the cost model (`CostModel.times`).

A mode's cost is what it does that NONE does not, read within the step it ran in:

  CHECKPOINT              its recompute in backward (`recompute_s`)
  SELECTIVE               its recompute, plus what its forward takes over a plain one:
                          each weight layer's output held (a Python call per layer)
  OFFLOAD, COMPRESS       their pack and unpack hooks (`moved_s`): encoding, host copies,
                          waits for the link (a full window of copies, a copy back not yet
                          arrived), decoding
  CHECKPOINT|OFFLOAD      both

Each is the mean over the blocks alike (same class, same input size) that have run
the mode; an offload's keeps its own block's reading, in block order, since a copy
made later has less compute after it to hide behind.

Where a mode's own reading is missing (no alike block has run it; on CUDA, where
copies and codecs run asynchronously and the host cannot time them without waiting),
its cost is a difference: its blocks' time less their time in NONE, read in other
steps. Block by block that difference is biased and noisy: it read SELECTIVE 10 to
25 ms dearer than NONE for a 3 ms recompute, and an offload anywhere from -26 to
+22 ms a block where side by side it cost 3 to 8 ms.
"""

from __future__ import annotations

from typing import Any

from adaptmem.control.fits import Fit, non_decreasing
from adaptmem.control.priors import Figures
from adaptmem.modes import Mode

RECOMPUTES = (Mode.CHECKPOINT, Mode.SELECTIVE)  # modes whose only extra work is their recompute
MOVES = Mode.OFFLOAD | Mode.COMPRESS  # modes whose extra work is in their pack and unpack hooks


class ModeTimes:
    """The time half of one `CostModel`: reads its fits (`direct`, `latent`), its blocks' classes, its
    priors and policy, and keeps the figures it pools per shape until the cost model learns again."""

    def __init__(self, costs: Any) -> None:
        self.costs = costs
        self._pool_key: tuple | None = None  # (batch, extent, steps_learned) the pooled figures are for
        self._pool: dict = {}
        self._alike: dict[tuple[int, int, int], list[tuple[int, ...]]] = {}

    def forget(self) -> None:
        """The cost model was loaded (its steps learned may have gone back): pool afresh."""
        self._pool_key, self._alike = None, {}

    def seconds(self, index: int, mode: Mode, batch: int, extent: int, derived: Figures) -> float:
        """What `mode` adds to a step on block `index`: its own work read within its steps (its
        recompute, `_recompute_floor`; its packing, `_moved`) where some alike block has run it;
        else its measured time less NONE's, averaged over the alike blocks (an offload's own where
        it ran on this very block, in block order, `_ordered`); else the derived figure."""
        if mode is Mode.NONE:
            return 0.0
        floor = self._recompute_floor(index, mode, batch, extent)
        if floor is not None and mode in RECOMPUTES:  # what it does that NONE does not, read in its own step
            return floor + (self._forward_extra(index, mode, batch, extent) if mode is Mode.SELECTIVE else 0.0)
        penalty = self.costs.penalty(mode, self.costs.latents(index, batch, extent)) if mode & Mode.COMPRESS else 0.0
        moved = self._moved(index, mode, batch, extent)
        if moved is not None and (floor is not None or not mode & Mode.CHECKPOINT):
            return (floor or 0.0) + moved + penalty
        overhead = self._ordered(index, mode, batch, extent, "seconds") if mode & Mode.OFFLOAD else None
        if overhead is None:
            overhead = self._pooled_overhead(index, mode, batch, extent)
        if overhead is None:  # no block like it has run the mode and NONE (or a checkpoint) both
            overhead = self.own_overhead(index, mode, batch, extent, siblings=True)
        if overhead is None:
            return derived.seconds
        return max(0.0, overhead, floor or 0.0) + penalty

    def _recompute_floor(self, index: int, mode: Mode, batch: int, extent: int) -> float | None:
        """A recomputing mode's recompute, read within one step (the mean over the alike blocks
        that have run it; None where none has): at least what it costs, and for CHECKPOINT and
        SELECTIVE, which do nothing else that NONE does not, what it costs.

        Read as a difference from NONE's time in other steps instead, a slow spell during NONE's
        made SELECTIVE look free, and with every block in SELECTIVE no NONE reading came to mend
        it; block by block the difference read SELECTIVE 10 to 25 ms dearer than NONE for a 3 ms
        recompute, and CHECKPOINT 28 to 37 ms for a 23 to 30 ms one, where side by side (every
        block in one mode against every block in NONE, 25 rounds) they cost 3.2 and 21 ms a block.
        """
        return self._mean_reading(index, mode, batch, extent, "recompute_s")

    def _mean_reading(self, index: int, mode: Mode, batch: int, extent: int, quantity: str) -> float | None:
        """The mean of `quantity`, read within `mode`'s steps, over the blocks alike with `index`
        that have a reading of it; None where none has."""
        group = self.group(index, batch, extent)
        if ("mean", group, mode, quantity) not in self._pool:
            own = [f.predict(batch, extent) for j in group if (f := self.costs.direct[j].get(mode, {}).get(quantity))]
            self._pool["mean", group, mode, quantity] = sum(own) / len(own) if own else None
        return self._pool["mean", group, mode, quantity]

    def _forward_extra(self, index: int, mode: Mode, batch: int, extent: int) -> float:
        """What `mode`'s forward takes over a plain one on the blocks alike with `index` (the mean
        of each one's forward in `mode` less its own forward in NONE, or where it has not run NONE,
        the plain forward learned from NONE and CHECKPOINT); 0 where none has read both.

        SELECTIVE's forward holds each weight layer's output, a Python call per layer; when it
        ran every op through a dispatch mode this was 1.1 to 2.4 ms a block, as much as its
        recompute. A forward is timed within its block, between its start and its end, so the
        difference of two steps' forwards does not carry what backward's attribution does.
        """
        group = self.group(index, batch, extent)
        if ("forward", group, mode) not in self._pool:
            extra = []
            for j in group:
                own = self.costs.direct[j].get(mode, {}).get("forward_s")
                plain = self.costs.direct[j].get(Mode.NONE, {}).get("forward_s") or self.costs.latent[j]["forward_s"]
                if own and plain:
                    extra.append(own.predict(batch, extent) - plain.predict(batch, extent))
            self._pool["forward", group, mode] = max(0.0, sum(extra) / len(extra)) if extra else 0.0
        return self._pool["forward", group, mode]

    def _moved(self, index: int, mode: Mode, batch: int, extent: int) -> float | None:
        """The time `mode`'s pack and unpack hooks took on block `index` (an offload's in block
        order, `_ordered`; a compression's the mean over the alike blocks); None where no alike
        block has a reading, and on CUDA, whose copies the host does not wait for."""
        if self.costs.cuda or not mode & MOVES:
            return None
        if mode & Mode.OFFLOAD:
            return self._ordered(index, mode, batch, extent, "moved_s")
        return self._mean_reading(index, mode, batch, extent, "moved_s")

    def _pooled_overhead(self, index: int, mode: Mode, batch: int, extent: int) -> float | None:
        """The mean, over the blocks alike with `index` that have run `mode`, of each one's time
        in it less its own time without it.

        One block's timing is one sample of a noisy clock, and the blocks at either end carry
        what runs beside them (the embedding's backward, the head's): block by block, a
        checkpoint on identical layers read from 6 to 26 ms, and the planner chose its blocks
        by that noise. Alike means the same class with the same input size, so a stage of a
        network whose blocks share a class but not a shape is pooled only with itself.
        """
        group = self.group(index, batch, extent)
        if (group, mode) not in self._pool:
            own = [o for j in group if (o := self.own_overhead(j, mode, batch, extent)) is not None]
            self._pool[group, mode] = sum(own) / len(own) if own else None
        return self._pool[group, mode]

    def _ordered(self, index: int, mode: Mode, batch: int, extent: int, quantity: str) -> float | None:
        """An offload's time on block `index`: `moved_s`, its hooks' own time, or `seconds`, its
        time less NONE's. The blocks alike with it that have run `mode` keep their own readings,
        made non-decreasing in block order; a block that has not run it takes their mean, held
        between its measured neighbours' readings (a block before every measured one at most the
        first one's: left at the mean, the first blocks were never offloaded once a later one
        had read cheap: `NONNNN`).

        A copy made at a later block has less compute after it to hide behind, going out in
        forward and coming back in backward, so among alike blocks a later offload never
        costs less. One reading of a block moves by as much as an offload costs; read
        block by block, the noise scattered the offloads (`NNNOOOON`, `SNOONONN`) where the
        first blocks' are the cheapest, and a later block looked cheaper by chance.

        A block whose only reading is its first offload (provisional: it allocated its host
        memory) counts as not measured while an alike block has a settled one: left at its
        cold time, a plan that moved away from it never came back to read it warm.
        """
        group = self.group(index, batch, extent)
        if ("ordered", group, mode, quantity) not in self._pool:
            own: dict[int, float] = {}
            for j in group:
                fit = self.costs.direct[j].get(mode, {}).get(quantity)
                if (
                    fit
                    and (
                        reading := self.own_overhead(j, mode, batch, extent)
                        if quantity == "seconds"
                        else fit.predict(batch, extent)
                    )
                    is not None
                ):
                    own[j] = reading
            settled = {j: o for j, o in own.items() if self.costs.direct[j][mode][quantity].settled}
            own = settled or own
            self._pool["ordered", group, mode, quantity] = (
                dict(zip(own, non_decreasing(list(own.values())))),
                sum(own.values()) / len(own) if own else None,
            )
        ordered, pooled = self._pool["ordered", group, mode, quantity]
        if index in ordered or pooled is None:
            return ordered.get(index)
        below = [v for j, v in ordered.items() if j < index]
        above = [v for j, v in ordered.items() if j > index]
        held = min(pooled, above[0]) if above else pooled  # no dearer than the next measured block
        return max(held, below[-1]) if below else held  # nor cheaper than the one before

    def own_overhead(self, index: int, mode: Mode, batch: int, extent: int, *, siblings: bool = False) -> float | None:
        """Block `index`'s measured time in `mode` less its time without it (with `siblings`, a
        figure it lacks is taken from the first block alike with it that has one)."""

        def fits_of(m: Mode) -> dict[str, Fit] | None:
            return self.costs.direct[index].get(m) or (
                self.costs.sibling(index, m, batch, extent) if siblings else None
            )

        fits, none = fits_of(mode), fits_of(Mode.NONE)
        baseline = none["seconds"] if none is not None and none["seconds"] else self.costs.latent[index]["none_s"]
        if fits is None or not fits["seconds"] or not baseline:
            return None
        return fits["seconds"].predict(batch, extent) - baseline.predict(batch, extent)

    def covers(self, index: int, mode: Mode, batch: int, extent: int) -> tuple[float, float]:
        """The compute block `index`'s offloaded copies can hide behind, where the priors say copies
        travel while compute goes on: going out, the forward of the blocks after it; coming back,
        the backward of the block after it (its NONE time less its forward), which runs while
        the prefetch brings this block's copies back. (0, 0) elsewhere."""
        if not (mode & Mode.OFFLOAD and self.costs.priors.covered_by_compute):
            return 0.0, 0.0
        pool = self.shape_pool(batch, extent)
        if "covers" not in pool:
            q = self.costs.policy.quadratic_prior
            fwd = [lat["forward_s"].predict(batch, extent, q) for lat in self.costs.latent]
            bwd = [max(0.0, lat["none_s"].predict(batch, extent, q) - f) for lat, f in zip(self.costs.latent, fwd)]
            after = [sum(fwd[j + 1 :]) for j in range(len(fwd))]
            pool["covers"] = list(zip(after, bwd[1:] + [0.0]))
        return pool["covers"][index]

    def group(self, index: int, batch: int, extent: int) -> tuple[int, ...]:
        """The blocks alike with `index` at this shape; the pooled figures are kept until the
        shape or the cost model changes."""
        self.shape_pool(batch, extent)
        return self.alike_groups(batch, extent)[index]

    def shape_pool(self, batch: int, extent: int) -> dict:
        """The figures pooled at this shape, emptied when the shape or the cost model changes."""
        key = (batch, extent, self.costs.steps_learned)
        if self._pool_key != key:
            self._pool_key, self._pool = key, {}
        return self._pool

    def alike_groups(self, batch: int, extent: int) -> list[tuple[int, ...]]:
        """Per block, the blocks of its kind (its class, made of the same modules) whose input is within
        2% of its own size (kept per shape until the cost model changes: the pool is for one shape,
        these for any)."""
        key = (batch, extent, self.costs.steps_learned)
        if key not in self._alike:
            if len(self._alike) > 64 or any(k[2] != self.costs.steps_learned for k in self._alike):
                self._alike.clear()
            sizes = [lat["input_bytes"].predict(batch, extent) for lat in self.costs.latent]
            self._alike[key] = [
                tuple(
                    j
                    for j, (k, x) in enumerate(zip(self.costs.kinds, sizes))
                    if k == kind and abs(x - size) <= 0.02 * max(x, size, 1.0)
                )
                for kind, size in zip(self.costs.kinds, sizes)
            ]
        return self._alike[key]
