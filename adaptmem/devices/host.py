"""Training on the CPU itself: the process's resident memory, through psutil."""

from __future__ import annotations

import os
import threading
import weakref

import psutil

from adaptmem.devices.probe import HostClock


class _KeptOpen:
    """A file of /proc opened once and read whole in one system call each time; `read()` gives
    None where it cannot be opened or read (not Linux), and from then on."""

    def __init__(self, owner: object, path: str, size: int) -> None:
        self.size = size
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY)
        except OSError:
            self.fd = None
        self._close = weakref.finalize(owner, os.close, self.fd) if self.fd is not None else None

    def read(self) -> bytes | None:
        if self.fd is None:
            return None
        try:
            return os.pread(self.fd, self.size, 0)
        except OSError:
            self.fd = None
            return None

    def close(self) -> None:
        self.fd = None
        if self._close is not None:
            self._close()


class HostProbe(HostClock):
    """CPU training: process RSS through psutil (coarse: a sampled peak, not every allocation).

    On Linux the RSS is read from `/proc/self/statm` and the memory available from
    `/proc/meminfo`, each kept open and read in one system call: a step reads the RSS a dozen
    times and what others use once (its record's `external_bytes`), and psutil opens and
    parses the files each time (25 us for the RSS, 30 us for the machine's memory, against 8)."""

    def __init__(self) -> None:
        self.name = "host"
        self._process = psutil.Process(os.getpid())
        self._peak = 0
        self._lock = threading.Lock()
        self._total = psutil.virtual_memory().total  # the machine's RAM does not change while it runs
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm = _KeptOpen(self, "/proc/self/statm", 128)  # not Linux: psutil reads them
        self._meminfo = _KeptOpen(self, "/proc/meminfo", 8192)

    def capacity(self) -> int:
        return self._total

    def _rss(self) -> int:
        text = self._statm.read()
        if text is not None:
            try:
                return int(text.split()[1]) * self._page
            except (ValueError, IndexError):
                self._statm.close()
        return self._process.memory_info().rss

    def _available(self) -> int:
        """The machine's memory available to start new work without swapping (psutil's `available`)."""
        text = self._meminfo.read()
        if text is not None:
            try:
                at = text.index(b"MemAvailable:")
                return int(text[at + 13 : text.index(b"\n", at)].split()[0]) * 1024
            except (ValueError, IndexError):
                self._meminfo.close()
        return psutil.virtual_memory().available

    def close(self) -> None:
        self._statm.close()
        self._meminfo.close()

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

    def take_peak(self) -> tuple[int, int]:
        """(peak, allocated) from one reading of the resident size, then the peak starts again
        from it: what a step measured block by block reads at each boundary."""
        rss = self._rss()
        with self._lock:
            top, self._peak = max(self._peak, rss), rss
        return top, rss

    def external(self) -> int:
        return max(0, self._total - self._available() - self._rss())
