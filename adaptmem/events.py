"""The decision log: one JSON object a line, written off the training thread.

Records are queued by the manager as they happen and written by the
background thread (or at close). Every record has `type`, `time` (seconds since
the epoch) and `step`; the README lists the fields of each type.
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class EventLog:
    """Queue records; `flush()` writes them. Keeps the last `keep` records in memory too."""

    def __init__(self, path: str | Path | None, *, keep: int = 10_000) -> None:
        self.path = Path(path) if path is not None else None
        self.recent: collections.deque[dict] = collections.deque(maxlen=keep)
        self._queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")

    def emit(self, kind: str, **fields: Any) -> dict:
        record = {"type": kind, "time": round(time.time(), 6), **fields}
        self.recent.append(record)
        if self._file is not None:
            self._queue.put(record)
        return record

    def flush(self) -> int:
        """Write what is queued; returns the number of records written."""
        if self._file is None:
            return 0
        written = 0
        with self._lock:
            while True:
                try:
                    record = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._file.write(json.dumps(record, default=_jsonable) + "\n")
                written += 1
            if written:
                self._file.flush()
        return written

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.recent if r["type"] == kind]


def _jsonable(value: Any) -> Any:
    label = getattr(value, "label", None)
    if isinstance(label, str):
        return label
    return str(value)


def read_log(path: str | Path) -> list[dict]:
    """The records of a log file, in order."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
