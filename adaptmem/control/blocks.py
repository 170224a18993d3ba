"""The managed blocks and loss head, and the plan they run now."""

from __future__ import annotations

from collections import Counter

from adaptmem.control.headcosts import HeadChoice
from adaptmem.modes import Mode
from adaptmem.wrapping import BlockHandle, HeadHandle, checkpoints_itself


class ManagedBlocks:
    """Sets each block's mode (and the head's choice); `modes` and `head_choice` are the plan in force."""

    def __init__(self, handles: list[BlockHandle], head: HeadHandle | None) -> None:
        self.handles = handles
        self.head = head
        self.modes: tuple[Mode, ...] = tuple(h.mode for h in handles)
        self.head_choice: HeadChoice | None = None
        self._modules = [h.module for h in handles]
        self._own: list[bool] = [False] * len(handles)  # `checkpoints_itself` of each block at the last look
        self._described: tuple = ((), [], {})  # the last plan `described`, as (modes, labels, counts)

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.handles]

    def running(self) -> tuple[Mode, ...]:
        """The mode each block's wrapper runs in now (a plan made for part of a forward included)."""
        return tuple(h.mode for h in self.handles)

    def described(self, ran: dict[int, Mode]) -> tuple[list[str], dict[str, int]]:
        """A step's plan as its record writes it: each block's mode's label (the blocks that did
        not run: the mode they run in now), and the modes of the blocks that ran, counted. A step
        that ran every block under the plan of the step before is written from that step's."""
        n = len(self.handles)
        if len(ran) != n:
            running = self.running()
            return [ran.get(i, mode).label for i, mode in enumerate(running)], _counted(ran.values())
        modes = tuple(map(ran.get, range(n)))
        if modes != self._described[0]:
            self._described = (modes, [m.label for m in modes], _counted(modes))
        _, labels, counts = self._described
        return list(labels), dict(counts)

    def apply(self, modes: tuple[Mode, ...], head: HeadChoice | None) -> bool:
        """Run `modes` (and the head's `head`, where it has one) from the next block on; True when
        that changes the plan in force. Also puts back a plan as it was (a resume, a batch given up)."""
        for handle, mode in zip(self.handles, modes):
            if handle.mode is not mode:
                handle.mode = mode
        if self.head is not None and head is not None:
            self.head.planned(head.mode, head.chunk)
        if modes == self.modes and head == self.head_choice:
            return False
        self.modes, self.head_choice = modes, head
        return True

    def own_checkpointing(self) -> tuple[frozenset[int], frozenset[int]] | None:
        """The blocks whose model checkpoints them itself (Hugging Face's `gradient_checkpointing`),
        with those added since the last call; None when that has not changed."""
        own = [checkpoints_itself(m) for m in self._modules]  # read at every step's start
        if own == self._own:
            return None
        before, self._own = self._own, own
        now = frozenset(i for i, o in enumerate(own) if o)
        return now, frozenset(i for i in now if not before[i])


def _counted(modes) -> dict[str, int]:
    return dict(Counter(m.label for m in modes))
