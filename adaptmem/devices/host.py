"""Training on the CPU itself: the process's resident memory, through psutil."""

from __future__ import annotations

import os
import threading
import weakref

import psutil

from adaptmem.devices.probe import HostClock


class HostProbe(HostClock):
    """CPU training: process RSS through psutil (coarse: a sampled peak, not every allocation).

    On Linux the RSS is read from `/proc/self/statm` and the memory available from
    `/proc/meminfo`, each kept open and read in one system call: a step reads the RSS a dozen
    times and what others use once (its record's `external_bytes`), and psutil opens and
    parses the files each time (25 us for the RSS, 150 us for the machine's memory)."""

    def __init__(self) -> None:
        self.name = "host"
        self._process = psutil.Process(os.getpid())
        self._peak = 0
        self._lock = threading.Lock()
        self._total = psutil.virtual_memory().total  # the machine's RAM does not change while it runs
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # not Linux: psutil reads it
            self._statm = None
        self._close_statm = weakref.finalize(self, os.close, self._statm) if self._statm is not None else None
        try:
            self._meminfo: int | None = os.open("/proc/meminfo", os.O_RDONLY)
        except OSError:
            self._meminfo = None
        self._close_meminfo = weakref.finalize(self, os.close, self._meminfo) if self._meminfo is not None else None

    def capacity(self) -> int:
        return self._total

    def _rss(self) -> int:
        if self._statm is not None:
            try:
                return int(os.pread(self._statm, 128, 0).split()[1]) * self._page
            except (OSError, ValueError, IndexError):
                self._statm = None
        return self._process.memory_info().rss

    def _available(self) -> int:
        """The machine's memory available to start new work without swapping (psutil's `available`)."""
        if self._meminfo is not None:
            try:
                text = os.pread(self._meminfo, 8192, 0)
                at = text.index(b"MemAvailable:")
                return int(text[at + 13 : text.index(b"\n", at)].split()[0]) * 1024
            except (OSError, ValueError, IndexError):
                self._meminfo = None
        return psutil.virtual_memory().available

    def close(self) -> None:
        self._statm = self._meminfo = None
        for close in (self._close_statm, self._close_meminfo):
            if close is not None:
                close()

    def allocated(self) -> int:
        rss = self._rss()
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
        return max(0, self._total - self._available() - self._rss())
