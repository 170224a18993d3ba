"""Training on the CPU itself: the process's resident memory, through psutil."""

from __future__ import annotations

import os
import threading

import psutil

from adaptmem.devices.probe import HostClock


class HostProbe(HostClock):
    """CPU training: process RSS through psutil (coarse: a sampled peak, not every allocation)."""

    def __init__(self) -> None:
        self.name = "host"
        self._process = psutil.Process(os.getpid())
        self._peak = 0
        self._lock = threading.Lock()
        self._total = psutil.virtual_memory().total  # the machine's RAM does not change while it runs

    def capacity(self) -> int:
        return self._total

    def allocated(self) -> int:
        rss = self._process.memory_info().rss
        with self._lock:
            self._peak = max(self._peak, rss)
        return rss

    def peak(self) -> int:
        self.allocated()
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = 0
        self.allocated()

    def external(self) -> int:
        vm = psutil.virtual_memory()
        return max(0, vm.total - vm.available - self._process.memory_info().rss)
