"""The budget: the ceiling for the device's peak allocated bytes during a step."""

from __future__ import annotations

import os

from adaptmem.policy import ENV_BUDGET, Policy
from adaptmem.probes import MemoryProbe
from adaptmem.units import format_bytes, parse_bytes


def resolve_budget(budget: int | str | None, policy: Policy, probe: MemoryProbe) -> int:
    """Bytes from an int, "12GiB", "80%" of capacity, or None (the policy's fraction of
    what other processes leave free). ADAPTMEM_BUDGET wins over the argument."""
    source = "budget"
    env = os.environ.get(ENV_BUDGET)
    if env:
        budget, source = env.strip(), f"{ENV_BUDGET}={env!r}"
    capacity = _capacity(probe, needed=budget is None or (isinstance(budget, str) and budget.strip().endswith("%")))
    if budget is None:
        usable = capacity - probe.external()
        return max(1, int(policy.budget_fraction * usable))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            share = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"{source}: {budget!r} is not a percentage; write e.g. '80%'") from None
        if not 0 < share <= 1:
            raise ValueError(f"{source}: {budget!r} must be a percentage in (0%, 100%]")
        return max(1, int(share * capacity))
    value = parse_bytes(budget, what=source)
    if value <= 0:
        raise ValueError(f"{source} must be positive, got {budget!r}")
    if capacity is not None and value > capacity:
        raise ValueError(
            f"{source} {format_bytes(value)} is larger than the device ({format_bytes(capacity)} on "
            f"{probe.name}); give at most that, or a fraction such as '90%'"
        )
    return value


def _capacity(probe: MemoryProbe, *, needed: bool) -> int | None:
    try:
        return probe.capacity()
    except ValueError:
        if needed:
            raise
        return None
