"""The decision log: one JSON object a line, written off the training thread.

Records are queued by the manager as they happen and written by the
background thread (or at close). Every record has `type`, `time` (seconds since
the epoch), `run` (the run id) and `step`; docs/usage.md lists the fields of each
type. A log file is appended to, never truncated: a resumed run continues it
under its original run id, and `read_log(path, run=...)` picks one run out.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

log = logging.getLogger("adaptmem")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class EventLog:
    """Queue records; `flush()` writes them. Keeps the last `keep` records in memory too.

    Safe across threads: the training thread emits, the sampler thread emits and
    flushes, and any thread may read `of_type` / `records`.

    Raises OSError (with the path) when the log file cannot be opened for appending.
    """

    def __init__(self, path: str | Path | None, *, run_id: str | None = None, keep: int = 10_000) -> None:
        self.path = Path(path) if path is not None else None
        self.run_id = run_id or new_run_id()
        self._recent: collections.deque[dict] = collections.deque(maxlen=keep)
        self._queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the file and `_recent`
        self._file = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            except OSError as err:  # the same kind of error, saying what to pass instead
                raise type(err)(
                    err.errno,
                    f"adaptmem: cannot write the decision log at {self.path} ({err.strerror}); pass log= a file "
                    "path in a directory this process can write, or log=None",
                ) from err

    def continue_run(self, run_id: str | None) -> str:
        """Log under a saved run's id from now on (a resumed run); returns the id used before."""
        before = self.run_id
        self.run_id = run_id or before
        return before

    def emit(self, kind: str, **fields: Any) -> dict:
        record = {"type": kind, "time": round(time.time(), 6), "run": self.run_id, **fields}
        with self._lock:
            self._recent.append(record)
            if self._file is not None:
                self._queue.put(record)
        return record

    def flush(self) -> int:
        """Write what is queued; returns the number of records written."""
        written = 0
        with self._lock:
            if self._file is None:
                return 0
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

    @property
    def records(self) -> list[dict]:
        """A copy of the records kept in memory, oldest first."""
        with self._lock:
            return list(self._recent)

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["type"] == kind]

    def last(self, kind: str) -> dict | None:
        """The most recent record of this type, or None."""
        with self._lock:
            return next((r for r in reversed(self._recent) if r["type"] == kind), None)


def _jsonable(value: Any) -> Any:
    label = getattr(value, "label", None)
    if isinstance(label, str):
        return label
    return str(value)


def read_log(path: str | Path, run: str | None = None) -> list[dict]:
    """The records of a log file, in order; with `run`, only that run's. A last line cut short (a
    run stopped as it wrote) is left out with a warning; any other line that is not a record is an
    error naming it."""
    with Path(path).open(encoding="utf-8") as fh:
        lines = [(n, line) for n, line in enumerate(fh, 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if n == lines[-1][0] and records:
                log.warning("adaptmem: %s: left out its last line, cut short (%s)", path, err)
                break
            raise ValueError(
                f"{path}, line {n}: not an adaptmem log record ({err}); pass the file given as log= to adaptmem.manage"
            ) from None
        if not isinstance(record, dict) or "type" not in record:
            raise ValueError(f"{path}, line {n}: not an adaptmem log record (no 'type'); pass the file given as log=")
        records.append(record)
    return records if run is None else [r for r in records if r.get("run") == run]
