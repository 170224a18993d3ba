"""The budget: the ceiling for the device's peak allocated bytes during a step."""

from __future__ import annotations

import logging
import os
from typing import Protocol

from adaptmem.config.policy import ENV_BUDGET, Policy
from adaptmem.config.units import format_bytes, parse_bytes

log = logging.getLogger("adaptmem")

Budget = int | str | None


class DeviceSize(Protocol):
    """What resolving a budget reads of a device (every memory probe has it)."""

    name: str

    def capacity(self) -> int: ...

    def external(self) -> int: ...


def resolve_budget(budget: Budget, policy: Policy, probe: DeviceSize, *, use_env: bool = True) -> int:
    """Bytes from an int, "12GiB", "80%" of capacity, or None (the policy's fraction of
    what other processes leave free). ADAPTMEM_BUDGET wins over the argument, and says so."""
    source = "budget"
    env = os.environ.get(ENV_BUDGET) if use_env else None
    if env:
        if budget is not None and str(budget).strip() != env.strip():
            log.warning("adaptmem: %s=%r overrides budget=%r given in code", ENV_BUDGET, env, budget)
        budget, source = env.strip(), f"{ENV_BUDGET}={env!r}"
    is_share = budget is None or (isinstance(budget, str) and budget.strip().endswith("%"))
    capacity = _capacity(probe, needed=is_share)
    if budget is None:
        usable = capacity - probe.external()
        return max(1, int(policy.budget_fraction * usable))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        return _share(budget, capacity, source)
    value = parse_bytes(budget, what=source)
    if value <= 0:
        raise ValueError(f"{source} must be positive, got {budget!r}")
    if capacity is not None and value > capacity:
        raise ValueError(
            f"{source} {format_bytes(value)} is larger than the device ({format_bytes(capacity)} on "
            f"{probe.name}); give at most that, or a fraction such as '90%'"
        )
    return value


def _share(budget: str, capacity: int, source: str) -> int:
    try:
        share = float(budget.strip()[:-1]) / 100
    except ValueError:
        raise ValueError(f"{source}: {budget!r} is not a percentage; write e.g. '80%'") from None
    if not 0 < share <= 1:
        raise ValueError(f"{source}: {budget!r} must be a percentage in (0%, 100%]")
    return max(1, int(share * capacity))


def _capacity(probe: DeviceSize, *, needed: bool) -> int | None:
    try:
        return probe.capacity()
    except ValueError:
        if needed:
            raise
        return None
