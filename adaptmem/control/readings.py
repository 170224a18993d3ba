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

    def _failed(self, what: str, err: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("adaptmem: reading %s from the probe failed (%s: %s; %d so far): the step goes on "
                        "with the last good reading and is not learned from", what, type(err).__name__, err,
                        self.failures)

    def allocated(self) -> int:
        try:
            self._last = self.inner.allocated()
        except Exception as err:
            self._failed("allocated", err)
        return self._last

    def peak(self) -> int:
        try:
            return self.inner.peak()
        except Exception as err:
            self._failed("peak", err)
            return self._last

    def reset_peak(self) -> None:
        try:
            self.inner.reset_peak()
        except Exception as err:
            self._failed("reset_peak", err)

    def mark(self) -> Any:
        try:
            return self.inner.mark()
        except Exception as err:
            self._failed("mark", err)
            return None

    def seconds(self, start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        try:
            return self.inner.seconds(start, end)
        except Exception as err:
            self._failed("seconds", err)
            return 0.0

    def synchronize(self) -> None:
        try:
            self.inner.synchronize()
        except Exception as err:
            self._failed("synchronize", err)
