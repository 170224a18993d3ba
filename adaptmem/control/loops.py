"""Finding blocks a model calls more than once in one forward.

A model may run one module several times in a forward: ALBERT's one shared layer
`num_hidden_layers` times, a recurrent-depth model's core in a loop, a hybrid's
shared attention block between its own layers. Each call keeps its own
activations for backward, so each is planned as a block of its own
(`adaptmem.wrapping.repeat_calls`). Seen from the blocks alone, a block run again
before the backward is also what a second forward looks like (a contrastive loss
runs the model twice): what tells them apart is the modules around the block.
A second forward calls again every module between the model and its blocks; a
loop does not call again the module whose forward runs it. So while it watches,
the finder counts the calls of the modules that hold a block, the managed model
included: a block run again while one of them that had run has not run since is
a call of the same forward (the managed model's own forward is not always called:
a LightningModule's `training_step` calls the model inside it, which counts).
The lowest of them that did not run again between two calls of a block is the
loop's owner: from then on the block's calls count from each of its calls
(`adaptmem.wrapping.loop_owner`), so a forward that runs the loop longer than the
first is told from a second forward too.
"""

from __future__ import annotations

from torch import nn

from adaptmem.wrapping import BlockHandle


class LoopFinder:
    """Watches the steps until one completes: the calls of each block in its first forward."""

    def __init__(self, model: nn.Module, handles: list[BlockHandle]) -> None:
        parents: dict[int, nn.Module] = {}
        for parent in model.modules():
            for child in parent.children():
                parents.setdefault(id(child), parent)
        self._counts: dict[int, int] = {}
        self._chains: list[tuple[int, ...]] = []  # per block: the modules that hold it, up to the model
        holders: dict[int, nn.Module] = {}
        for handle in handles:
            chain, holder = [], parents.get(id(handle.module))
            while holder is not None:
                chain.append(id(holder))
                holders[id(holder)] = holder
                holder = parents.get(id(holder)) if holder is not model else None
            self._chains.append(tuple(chain))
        self._holders = holders
        self._hooks = [m.register_forward_pre_hook(self._count_call(key)) for key, m in holders.items()]
        self._owners: dict[int, int] = {}  # a block run in a loop: the holder whose forward runs the loop
        self._last: dict[int, tuple[int, ...]] = {}  # a block's holders' counts at its last call
        self._order: list[int] = []  # the first forward's calls, by block
        self._whole = False  # that forward ended (a second one began)
        self.looped = False  # a block ran again in one forward

    def _count_call(self, key: int):
        counts = self._counts

        def count(module: nn.Module, args: tuple) -> None:
            counts[key] = counts.get(key, 0) + 1

        return count

    def begin(self) -> None:
        """A step (an attempt, a micro-batch) begins."""
        self._last.clear()
        self._order, self._whole, self.looped = [], False, False

    def call(self, index: int) -> bool:
        """Block `index` starts a call in the open step; True where it ran already in this forward."""
        counts = tuple(self._counts.get(key, 0) for key in self._chains[index])
        before = self._last.get(index)
        self._last[index] = counts
        again = before is not None and any(now and now == then for now, then in zip(counts, before))
        if again and not self._whole:
            lowest = next(j for j, (now, then) in enumerate(zip(counts, before)) if now and now == then)
            self._owners.setdefault(index, self._chains[index][lowest])
        if before is not None and not again:
            self._whole = True  # a second forward: the first one's calls are all in
        elif not self._whole:
            self._order.append(index)
        self.looped = self.looped or again
        return again

    def calls(self) -> list[int] | None:
        """The blocks of the step's first forward in the order they ran, where one ran more
        than once; None where each ran once."""
        return list(self._order) if self.looped else None

    def owners(self) -> list[tuple[nn.Module, list[int]]]:
        """Each module whose forward runs blocks in a loop, with those blocks (their indices then)."""
        owned: dict[int, list[int]] = {}
        for index, key in sorted(self._owners.items()):
            owned.setdefault(key, []).append(index)
        return [(self._holders[key], indices) for key, indices in owned.items()]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def longer_calls(calls: list[int], longer: dict[int, int]) -> list[int] | None:
    """One forward's calls, by block (`calls`, as `repeat_calls` takes them), with the loop run more
    turns: `longer` gives each block called past its calls, with its calls in that forward. A turn of
    the loop is the calls from the second-to-last call of its first block to the last one; the added
    turns follow the last. None where the counts are not whole turns more (the model's calls changed
    some other way)."""
    if not longer or any(order not in calls for order in longer):
        return None
    first = min(longer, key=calls.index)
    at = [i for i, order in enumerate(calls) if order == first]
    if len(at) < 2:
        return None
    turn = calls[at[-2] : at[-1]]
    end = at[-1] + len(turn)
    if calls[at[-1] : end] != turn:
        return None
    added = longer[first] - len(at)
    if added <= 0 or set(longer) != set(turn):
        return None
    if any(longer[order] != calls.count(order) + added * turn.count(order) for order in turn):
        return None
    return calls[:end] + turn * added + calls[end:]
