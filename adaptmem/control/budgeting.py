"""The budget in force: the user's, shrunk at once when others take memory, given back when calm.

`BudgetKeeper` holds two figures: `user` (what the user asked for, or set with
`set_budget`) and `current` (what plans aim under now). When other processes
take memory, `squeeze()` lowers `current` at once to what is left less the
policy's `emergency_margin`; after `calm_steps` steps with room again,
`relieve()` gives it back, up to `user`.
"""

from __future__ import annotations

from adaptmem.config.policy import Policy
from adaptmem.devices.probe import MemoryProbe


class BudgetKeeper:
    def __init__(self, user: int, probe: MemoryProbe, policy: Policy) -> None:
        self.user = user
        self.current = user
        self.probe = probe
        self.policy = policy
        self.calm = 0
        self.external: int | None = None  # others' bytes at the last reading (`available`), None before one
        try:
            self.capacity: int | None = probe.capacity()
        except ValueError:  # a stand-in without capacity: no outside pressure to watch
            self.capacity = None

    def available(self) -> int | None:
        """Bytes this process may use now (capacity less others, less the emergency margin)."""
        if self.capacity is None:
            return None
        self.capacity = self.probe.capacity()  # a partition can shrink (MIG, a stand-in's set_capacity)
        self.external = self.probe.external()
        return int(self.capacity * (1 - self.policy.emergency_margin)) - self.external

    def squeeze(self, available: int | None) -> tuple[int, int] | None:
        """Shrink `current` to `available` when it no longer fits: (before, after), or None."""
        if available is None or available >= self.current:
            return None
        before, self.current = self.current, max(1, available)
        self.calm = 0
        return before, self.current

    @property
    def squeezed(self) -> bool:
        """Others' memory holds the budget in force under the user's."""
        return self.current < self.user

    def relieve(self, available: int | None) -> tuple[int, int] | None:
        """After a step: once the others have let go for `calm_steps` steps, give the budget
        back (up to `user`): (before, after), or None."""
        if available is None or not self.squeezed:
            return None
        if available < self.current * 1.02:
            self.calm = 0
            return None
        self.calm += 1
        if self.calm < self.policy.calm_steps:
            return None
        before, self.current = self.current, min(self.user, available)
        self.calm = 0
        return before, self.current

    def resume(self, current: int, user: int | None = None) -> None:
        """A saved run's budget in force where others' memory held it under that run's own user
        budget (`user`), never above this one's; where nothing held it under (its user budget in
        force, as `set_budget` left it), this manager's user budget stands. (A state saved before
        the user budget was kept: its budget in force, never above the user's.)"""
        if user is not None and int(current) >= int(user):
            return
        self.current = min(self.user, int(current))

    def set_user(self, value: int, available: int | None) -> tuple[int, int]:
        """A new user budget, in force at once (within what others leave): (before, after)."""
        before = self.current
        self.user = value
        self.current = value if available is None else max(1, min(value, available))
        self.calm = 0
        return before, self.current
