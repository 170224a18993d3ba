"""The background thread: watches for outside pressure, writes the event log.

Every `interval` seconds it calls its owner's tick (the manager's) and then
flushes the event log. It holds the owner only weakly: a manager dropped
without `close()` neither stays alive for the thread's sake nor keeps its
model alive, and the thread ends at its next wake-up. It never takes training
down: an exception in a tick is logged (at most once a minute with its
traceback) and sampling goes on. `stop()` ends and joins it.

`wait_ticks(n)` blocks until n more ticks have completed, so a caller (a test,
the demo) can wait for the thread's reaction by event rather than by sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("adaptmem")


class Sampler(threading.Thread):
    def __init__(self, tick: Callable[[], None], flush: Callable[[], object], interval: float) -> None:
        super().__init__(name="adaptmem-sampler", daemon=True)
        self._tick = weakref.WeakMethod(tick) if hasattr(tick, "__self__") else (lambda: tick)
        self._flush = flush
        self.interval = interval
        self._stop_event = threading.Event()
        self._ticked = threading.Condition()
        self.ticks = 0
        self.errors = 0
        self.done = False
        self._last_trace = 0.0

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            tick = self._tick()
            if tick is None:  # the owner is gone
                break
            self._safely(tick)
            del tick  # hold the owner only while ticking
            self._safely(self._flush)
            with self._ticked:
                self.ticks += 1
                self._ticked.notify_all()
        self._safely(self._flush)
        with self._ticked:
            self.done = True
            self._ticked.notify_all()

    def wait_ticks(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Block until `n` ticks that start after this call have completed (True), the
        thread has ended, or `timeout` seconds have passed (False)."""
        with self._ticked:
            target = self.ticks + n + 1  # the tick under way may have read the state before the call
            return self._ticked.wait_for(lambda: self.ticks >= target or self.done, timeout)

    def _safely(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # never let sampling take training down
            self.errors += 1
            now = time.monotonic()
            if now - self._last_trace > 60:
                self._last_trace = now
                log.exception("adaptmem: background sampler error (sampling goes on)")
            elif self.errors % 100 == 0:  # a failing probe fails every tick: say so, not every time
                log.warning("adaptmem: background sampler error %d (sampling goes on)", self.errors)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
