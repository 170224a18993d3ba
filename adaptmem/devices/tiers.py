"""Which memory tier an allocation belongs to, and the link between them, when the process cannot tell.

On CUDA the tier is the tensor's device. On the CPU stand-in
(`adaptmem.devices.simulated.SimulatedDevice`) every tensor lives in host RAM, so the
offload strategy marks the copies it makes for the host tier, and the stand-in
counts them as host bytes rather than device bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_state = threading.local()


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Storages allocated in this thread inside the block are host-tier memory."""
    depth = getattr(_state, "host_depth", 0)
    _state.host_depth = depth + 1
    try:
        yield
    finally:
        _state.host_depth = depth


def allocating_on_host() -> bool:
    """True inside `host_allocations()` in the current thread."""
    return getattr(_state, "host_depth", 0) > 0


@contextlib.contextmanager
def using_link(link: Any) -> Iterator[None]:
    """Offloaded copies made in this thread inside the block travel over `link` (a stand-in's)."""
    previous = getattr(_state, "link", None)
    _state.link = link
    try:
        yield
    finally:
        _state.link = previous


def current_link() -> Any:
    """The link offloaded copies travel over in this thread, or None for instant copies."""
    return getattr(_state, "link", None)


def link_clock() -> Callable[[], float]:
    """The clock a stand-in's link waits are on (a benchmark's virtual clock), else the host's:
    the clock a `SimulatedProbe` marks steps with, so times read on it add up with the step's."""
    link = current_link()
    return link.clock if link is not None else time.perf_counter
