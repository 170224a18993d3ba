"""OFFLOAD on CUDA: side-stream copies, a bounded window of copies in flight, pinned buffers.

One D2H and one H2D stream per device. Lifetimes across streams, the part that
is easy to get wrong:

  - Out (D2H): the side stream waits for the compute stream (the tensor is
    fully written), copies into a pinned buffer and records an event. The
    device tensor is held in a `CopyWindow` until its copy is done; it is let
    go of either when its event has completed, or, when the window is full,
    after the compute stream has been made to wait on the event. Its memory
    then returns to the compute stream's pool with no later compute kernel able
    to run before the copy has read it; `memory_allocated` counts the window,
    so the manager's measurement and the planner see copies in flight (no
    `record_stream`, which hid them from `allocated` while the allocator kept
    them reserved).
  - Back (H2D): the device tensor is allocated on the compute stream (so it
    comes from the pool forward freed into); the H2D stream waits for the
    compute stream before writing it, and the compute stream waits on the
    copy's event before using it. A prefetched copy that is never used makes
    the compute stream wait on its event before its memory is freed.
  - A pinned buffer returns to the pool only when its payload is gone, and is
    reused only after the last copy touching it has completed (its event).
  - When the pool has no pinned bytes left under its cap, or pinning fails,
    the copy goes to pageable memory, synchronously.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from adaptmem.strategies.offload import HostCopy, PackGroup
from adaptmem.strategies.payloads import nbytes_of
from adaptmem.strategies.pinned import PinnedPool, host_view


class CopyWindow:
    """Device tensors whose copies to the host are still in flight, at most `limit` bytes."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[torch.Tensor, Any, int]] = collections.deque()
        self._lock = threading.Lock()
        self.bytes = 0
        self.peak_bytes = 0
        self.waits = 0  # packs that found the window full and made compute wait for the oldest copy

    def push(self, t: torch.Tensor, done: Any, limit: int, compute: torch.cuda.Stream) -> None:
        nbytes = t.untyped_storage().nbytes()
        with self._lock:
            self._retire(compute, limit - nbytes)
            self._pending.append((t, done, nbytes))
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drain(self, compute: torch.cuda.Stream) -> None:
        """Let go of every tensor, the compute stream waiting on copies not yet done."""
        with self._lock:
            self._retire(compute, 0)

    def _retire(self, compute: torch.cuda.Stream, room: int) -> None:
        while self._pending:
            t, done, nbytes = self._pending[0]
            if not done.query():
                if self.bytes <= room:
                    return
                compute.wait_event(done)  # later compute kernels run after the copy has read t
                self.waits += 1
            self._pending.popleft()
            self.bytes -= nbytes


class CudaTier:
    """Pinned pool + one D2H and one H2D side stream + a window of copies in flight, for one device."""

    def __init__(self, device: torch.device, pool: PinnedPool) -> None:
        self.device = device
        self.pool = pool
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.window = CopyWindow()

    def pack(self, t: torch.Tensor, group: PackGroup | None, limit: int) -> HostCopy:
        t = t.detach()
        main = torch.cuda.current_stream(self.device)
        block = self.pool.acquire(nbytes_of(t))  # idle: no copy still touches it; None: no pinned bytes
        if block is None:
            host = torch.empty_like(t, device="cpu")  # t's strides when dense, as host_view keeps them
            host.copy_(t)  # pageable: synchronous, nothing left in flight
            return HostCopy(host, self, group=None, ready=_recorded(main))
        host = host_view(block, t)
        self.d2h.wait_stream(main)  # t is fully written before we read it
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            ready = _recorded(self.d2h)
        block.busy_until = ready
        self.window.push(t, ready, limit, main)
        copy = HostCopy(host, self, group=group, block=block, ready=ready)
        weakref.finalize(copy, self.pool.release, block)
        if group is not None:
            group.add(copy)
        return copy

    def fetch(self, copy: HostCopy) -> tuple[torch.Tensor, Any]:
        """Start the copy back: allocated on the compute stream, written on the H2D stream."""
        host = copy.host
        main = torch.cuda.current_stream(self.device)
        dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        self.h2d.wait_stream(main)  # the memory is free on the compute stream's timeline
        self.h2d.wait_event(copy.ready)  # the bytes are on the host
        with torch.cuda.stream(self.h2d):
            dev.copy_(host, non_blocking=True)
            done = _recorded(self.h2d)
        if copy.block is not None:
            copy.block.busy_until = done
        return dev, done

    def finish(self, copy: HostCopy, fetched: tuple[torch.Tensor, Any]) -> torch.Tensor:
        dev, done = fetched
        main = torch.cuda.current_stream(self.device)
        self.window.drain(main)  # backward has begun: forward's copies are no longer worth holding
        main.wait_event(done)
        return dev

    def settle(self) -> None:
        """A failed attempt's copies out: let go of their device tensors (compute waits on the copies)."""
        self.window.drain(torch.cuda.current_stream(self.device))

    def abandon(self, fetched: tuple[torch.Tensor, Any]) -> None:
        torch.cuda.current_stream(self.device).wait_event(fetched[1])  # before its memory is reused


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
