"""Probe readings that never stop training: a failing reading gives the last good value."""

from __future__ import annotations

import logging
from typing import Any

from adaptmem.devices.probe import MemoryProbe

log = logging.getLogger("adaptmem")


class SafeReadings:
    """A probe whose readings never raise: a reading that fails (a driver hiccup, a lost GPU,
    a probe of the user's that throws) gives the last good value instead, is counted, and is
    logged (the first time, then every 100th). Training goes on; the step is not learned from."""

    def __init__(self, probe: MemoryProbe) -> None:
        self.inner = probe
        self.failures = 0
        self._last = 0

    def __getattr__(self, name: str) -> Any:  # name, step_started, ...
        return getattr(self.inner, name)

    def read(self, what: str, fn: Any, default: Any, *args: Any) -> Any:
        """`fn(*args)`, or `default` when it raises (the failure counted and logged as `what`)."""
        try:
            return fn(*args)
        except Exception as err:
            self._failed(what, err)
            return default

    def _failed(self, what: str, err: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning(
                "adaptmem: reading %s from the probe failed (%s: %s; %d so far): the step goes on "
                "with the last good reading and is not learned from",
                what,
                type(err).__name__,
                err,
                self.failures,
            )

    def allocated(self) -> int:
        self._last = self.read("allocated", self.inner.allocated, self._last)
        return self._last

    def peak(self) -> int:
        return self.read("peak", self.inner.peak, self._last)

    def reset_peak(self) -> None:
        self.read("reset_peak", self.inner.reset_peak, None)

    def take_peak(self) -> tuple[int, int]:
        """(peak since the last reset, allocation now), then the peak reset: from one reading of
        the probe's `take_peak` where it has one, else `peak`, `reset_peak` and `allocated`."""
        take = getattr(self.inner, "take_peak", None)
        if take is None:
            top = self.peak()
            self.reset_peak()
            return top, self.allocated()
        top, self._last = self.read("take_peak", take, (self._last, self._last))
        return top, self._last

    def restart(self) -> int:
        """Start the peak again from now and read the allocation: one reading of the probe's
        `take_peak` where it has one, else `reset_peak` and `allocated`."""
        take = getattr(self.inner, "take_peak", None)
        if take is None:
            self.reset_peak()
            return self.allocated()
        _, self._last = self.read("take_peak", take, (self._last, self._last))
        return self._last

    def mark(self) -> Any:
        return self.read("mark", self.inner.mark, None)

    def seconds(self, start: Any, end: Any) -> float:
        if start is None or end is None:  # a mark that failed
            return 0.0
        return self.read("seconds", self.inner.seconds, 0.0, start, end)

    def synchronize(self) -> None:
        self.read("synchronize", self.inner.synchronize, None)
