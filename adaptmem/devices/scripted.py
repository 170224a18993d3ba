"""A probe whose readings follow a script: decisions tested step by step, exactly."""

from __future__ import annotations

from adaptmem.devices.probe import HostClock


class ScriptedProbe(HostClock):
    """A memory probe whose readings follow a script, to test decisions exactly.

    Each step's peak is ``peaks[i]`` (a sequence, the last value repeating) or
    ``peaks(i)`` (a callable of the step index, counted from 0); likewise the
    allocator's retry count, ``retries``. Allocation and outside memory are
    constants you may change between steps.
    """

    #: its peak is the step's whole, read at any moment: no reading shows part of a step
    whole_step_peaks = True

    def __init__(self, capacity_bytes: int, peaks, *, allocated: int = 0, external: int = 0, retries=None) -> None:
        self.name = "scripted"
        self._capacity = capacity_bytes
        self._peaks = peaks
        self._retries = retries
        self.allocated_bytes = allocated
        self.external_bytes = external
        self.step = -1

    def step_started(self) -> None:
        self.step += 1

    def _at(self, script) -> int:
        if callable(script):
            return int(script(self.step))
        return int(script[min(max(self.step, 0), len(script) - 1)])

    def capacity(self) -> int:
        return self._capacity

    def allocated(self) -> int:
        return self.allocated_bytes

    def peak(self) -> int:
        return max(self.allocated_bytes, self._at(self._peaks))

    def reset_peak(self) -> None:
        pass

    def external(self) -> int:
        return self.external_bytes

    def host_available(self) -> int:
        return 1 << 40

    def signals(self) -> dict:
        return {} if self._retries is None else {"alloc_retries": self._at(self._retries)}
