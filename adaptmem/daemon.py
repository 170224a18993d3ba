"""The background thread: watches for outside pressure, writes the event log.

Every `interval` seconds it calls `tick()` of its owner (the manager), which
reads the probe and reacts, then flushes the event log. It never takes
training down: an exception in a tick is logged (at most once a minute with
its traceback) and sampling goes on. `stop()` ends and joins it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("adaptmem")


class Sampler(threading.Thread):
    def __init__(self, tick: Callable[[], None], flush: Callable[[], object], interval: float) -> None:
        super().__init__(name="adaptmem-sampler", daemon=True)
        self._tick = tick
        self._flush = flush
        self.interval = interval
        self._stop_event = threading.Event()
        self.ticks = 0
        self.errors = 0
        self._last_trace = 0.0

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self._safely(self._tick)
            self._safely(self._flush)
            self.ticks += 1
        self._safely(self._flush)

    def _safely(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # never let sampling take training down
            self.errors += 1
            now = time.monotonic()
            if now - self._last_trace > 60:
                self._last_trace = now
                log.exception("adaptmem: background sampler error (sampling goes on)")
            else:
                log.warning("adaptmem: background sampler error %d (sampling goes on)", self.errors)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
