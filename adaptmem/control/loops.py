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
        self._hooks = [m.register_forward_pre_hook(self._count_call(key)) for key, m in holders.items()]
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

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
