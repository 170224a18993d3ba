"""A host link of finite speed for the stand-in: offloaded copies take time, as on PCIe.

Copies queue in order, one queue each way (the link is full duplex), each taking
`latency_s + nbytes / bytes_per_s`, where `nbytes` are the tensor's own elements:
a view moves its elements, not its whole storage. A copy to the host keeps its
device tensor alive (so the stand-in still counts its bytes) until the copy has
arrived; the device bytes in flight count each storage once, however many of its
views travel (q, k and v split from one projection: counted per view, the link
moved a third more than offloading keeps, and the bytes in flight read three
times the storage, so a block's `held` read negative and the next one's high);
compute goes on meanwhile, up to a window of bytes in flight (`send(limit=...)`), past
which the next copy waits for the oldest to arrive. A copy back is scheduled when backward asks for it,
or earlier by a prefetch, and backward waits for its arrival. Time is the real
clock by default; tests pass a scripted `clock` and `sleep`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch


class SimulatedLink:
    def __init__(
        self,
        bytes_per_s: float,
        latency_s: float = 0.0,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be positive, got {bytes_per_s!r}")
        if latency_s < 0:
            raise ValueError(f"link_latency_s must not be negative, got {latency_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self.latency_s = float(latency_s)
        self.clock = clock
        self.sleep = sleep
        self._free_at = {"to_host": 0.0, "to_device": 0.0}
        # (arrival, the tensor kept alive, its storage's key in `_storages`)
        self._in_flight: collections.deque[tuple[float, torch.Tensor, int]] = collections.deque()
        self._storages: dict[int, list[int]] = {}  # storage in flight: [copies of it in flight, its bytes]
        self._bytes = 0  # device bytes in flight now, each storage once
        self.peak_in_flight_bytes = 0
        self.window_waits = 0  # packs that waited for the oldest copy: the window was full
        self._lock = threading.RLock()
        self.waited_s = 0.0  # time compute spent waiting for copies to arrive

    def _schedule(self, direction: str, nbytes: int, after: float = 0.0) -> float:
        start = max(self.clock(), self._free_at[direction], after)
        self._free_at[direction] = start + self.latency_s + nbytes / self.bytes_per_s
        return self._free_at[direction]

    def send(self, t: torch.Tensor, limit: int | None = None) -> float:
        """Start copying `t` to the host; it stays allocated until the copy arrives. With
        `limit` (bytes), first wait for the oldest copies until `t` fits in the window of
        copies in flight. Returns the arrival."""
        storage = t.untyped_storage()
        key, held = storage.data_ptr(), storage.nbytes()
        self.poll()
        while limit is not None and self._in_flight and key not in self._storages and self._bytes + held > limit:
            self.window_waits += 1
            self.wait(self._in_flight[0][0])
        with self._lock:
            arrival = self._schedule("to_host", t.numel() * t.element_size())
            self._in_flight.append((arrival, t, key))
            entry = self._storages.setdefault(key, [0, held])
            entry[0] += 1
            if entry[0] == 1:
                self._bytes += held
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self._bytes)
            return arrival

    def fetch(self, nbytes: int, after: float = 0.0) -> float:
        """Copy `nbytes` back to the device, once they are on the host (`after`, the arrival
        of the copy there): compute does not wait for it here. Returns the arrival."""
        with self._lock:
            return self._schedule("to_device", nbytes, after)

    def wait(self, arrival: float) -> None:
        """Block until a copy that arrives at `arrival` is there."""
        delay = arrival - self.clock()
        if delay > 0:
            self.waited_s += delay
            self.sleep(delay)
        self.poll()

    def settle(self) -> None:
        """Wait for every copy to the host in flight to arrive, and let go of their device tensors."""
        if self._in_flight:
            self.wait(self._in_flight[-1][0])

    def poll(self) -> None:
        """Let go of the device tensors whose copies have arrived."""
        if not self._in_flight:
            return
        now = self.clock()
        with self._lock:
            while self._in_flight and self._in_flight[0][0] <= now:
                _, _, key = self._in_flight.popleft()
                entry = self._storages[key]
                entry[0] -= 1
                if not entry[0]:
                    self._bytes -= self._storages.pop(key)[1]

    @property
    def in_flight_bytes(self) -> int:
        """Device bytes whose copies to the host have not arrived yet (each storage once)."""
        return self._bytes
