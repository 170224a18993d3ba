"""Reading device memory: the one interface every device answers through.

A probe answers, in bytes: how big the device is (`capacity`), what this
process's tensors hold now (`allocated`) and at most since the last reset
(`peak`), and what is taken outside them (`external`: other processes, the CUDA
context, non-PyTorch libraries). It also marks time, so block timings on CUDA
come from events rather than host clocks.

A probe of a device that runs asynchronously says so with a class attribute
`asynchronous = True` (optional; False when absent): the recorder then waits
for the device (`synchronize`) only at the end of a step it measures block by
block, never at a light one's. It may also have `take_peak()`, returning
(peak, allocated) from one reading and then resetting the peak, where two
readings cost more than one (CUDA's counters).
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

import psutil


@runtime_checkable
class MemoryProbe(Protocol):
    name: str

    def capacity(self) -> int: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...

    def external(self) -> int: ...

    def host_available(self) -> int: ...

    def signals(self) -> dict: ...

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def synchronize(self) -> None: ...


class HostClock:
    """Host-clock timing, for devices that run synchronously."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)

    def synchronize(self) -> None:
        pass

    def host_available(self) -> int:
        return psutil.virtual_memory().available

    def signals(self) -> dict:
        return {}
