"""Pinned host buffers for CUDA offload, reused across steps, under a cap that tells the truth.

A buffer returns to the pool only when its payload is gone, and is handed out
again only after the last copy touching it has completed (its CUDA event), so
a reuse can never overwrite bytes a copy still reads or writes.

Sizes are powers of two, as PyTorch's host allocator rounds them, so the pool's
counters are the pinned bytes the process really holds for it. Buffers in use
and idle together stay under `max_pinned_bytes`; past it (or when pinning
fails) `acquire` returns None and the copy goes to pageable memory. Releases
may come from garbage collection at any moment, on the thread that holds the
lock: the lock is reentrant.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psutil
import torch

from adaptmem.config.units import format_bytes
from adaptmem.strategies.payloads import nbytes_of

log = logging.getLogger("adaptmem")


class PinnedBlock:
    __slots__ = ("buffer", "busy_until")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.busy_until: Any = None  # CUDA event of the last copy touching the buffer

    def idle(self) -> bool:
        return self.busy_until is None or self.busy_until.query()


def _pin(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Reusable pinned host buffers, bucketed by size (powers of two).

    max_cached_bytes: idle buffers kept for reuse; past it they are freed.
    max_pinned_bytes: pinned bytes in use and idle together; None: half the
        machine's RAM. Past it, offloaded copies go to pageable memory.
    allocate: makes a pinned buffer of n bytes (for tests).

    Counters (bytes): `in_use_bytes`, `cached_bytes`, `pinned_bytes` (both);
    `allocations`, `reuses`, `pageable` (copies that got no pinned buffer) and
    `failures` (pinning that raised).
    """

    def __init__(
        self,
        max_cached_bytes: int = 8 * 2**30,
        max_pinned_bytes: int | None = None,
        allocate: Callable[[int], torch.Tensor] = _pin,
    ) -> None:
        self.max_cached_bytes = max_cached_bytes
        self.max_pinned_bytes = psutil.virtual_memory().total // 2 if max_pinned_bytes is None else max_pinned_bytes
        self._allocate = allocate
        self._idle: dict[int, list[PinnedBlock]] = {}
        self._idle_bytes = 0
        self._lock = threading.RLock()  # a release from gc may run while this thread holds it
        self.in_use_bytes = 0
        self.allocations = self.reuses = self.pageable = self.failures = 0
        self._warned = False

    @property
    def cached_bytes(self) -> int:
        return self._idle_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.in_use_bytes + self._idle_bytes

    def acquire(self, nbytes: int) -> PinnedBlock | None:
        """An idle pinned buffer of at least `nbytes`, or None: copy to pageable memory."""
        size = size_class(nbytes)
        with self._lock:
            bucket = self._idle.get(size, [])
            for i, block in enumerate(bucket):
                if block.idle():
                    bucket.pop(i)
                    self._idle_bytes -= size
                    self.in_use_bytes += size
                    self.reuses += 1
                    return block
            if self.pinned_bytes + size > self.max_pinned_bytes:
                self._evict(self.pinned_bytes + size - self.max_pinned_bytes)
            if self.pinned_bytes + size > self.max_pinned_bytes:
                return self._refuse(f"the pool's cap of {format_bytes(self.max_pinned_bytes)} is reached")
            self.in_use_bytes += size  # reserved before allocating: a concurrent acquire sees it
        try:
            buffer = self._allocate(size)
        except RuntimeError as err:  # cudaHostAlloc failed: locked-memory limit, or out of host memory
            with self._lock:
                self.in_use_bytes -= size
                self.failures += 1
            return self._refuse(f"pinning {format_bytes(size)} failed ({err})")
        with self._lock:
            self.allocations += 1
        return PinnedBlock(buffer)

    def release(self, block: PinnedBlock) -> None:
        size = block.buffer.numel()
        with self._lock:
            self.in_use_bytes -= size
            if self._idle_bytes + size <= self.max_cached_bytes:
                self._idle.setdefault(size, []).append(block)
                self._idle_bytes += size

    def clear(self) -> None:
        """Free every idle buffer, and let PyTorch's host allocator give them back to the system."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
        _empty_host_cache()

    def settings(self) -> dict:
        return {"max_cached_bytes": self.max_cached_bytes, "max_pinned_bytes": self.max_pinned_bytes}

    def empty_like(self) -> PinnedPool:
        return PinnedPool(allocate=self._allocate, **self.settings())

    def _evict(self, nbytes: int) -> None:
        """Free idle buffers (largest first) until `nbytes` are freed or none is left."""
        freed = 0
        for size in sorted(self._idle, reverse=True):
            bucket = self._idle[size]
            keep = []
            for block in bucket:
                if freed < nbytes and block.idle():
                    freed += size
                else:
                    keep.append(block)
            self._idle[size] = keep
        self._idle_bytes -= freed
        if freed:
            _empty_host_cache()

    def _refuse(self, why: str) -> None:  # acquire's "no pinned buffer": copy to pageable memory
        with self._lock:
            self.pageable += 1
        if not self._warned:
            self._warned = True
            log.warning("adaptmem: offloaded copies go to pageable host memory (slower, synchronous): %s", why)
        return None


def _empty_host_cache() -> None:
    """Return cached pinned blocks to the system: PyTorch's host allocator keeps what it frees."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None and torch.cuda.is_initialized():
        empty()


def size_class(nbytes: int) -> int:
    """The power of two at or above `nbytes` (at least 512): PyTorch's host allocator
    pins that much for any request, so asking for it wastes nothing more and lets
    varying shapes reuse buffers."""
    return 1 << (max(int(nbytes), 512) - 1).bit_length()


def host_view(block: PinnedBlock, t: torch.Tensor) -> torch.Tensor:
    """A view of the pinned buffer shaped like `t`: same strides when `t` is
    dense (so backward sees the layout it saved), contiguous otherwise."""
    flat = block.buffer[: nbytes_of(t)].view(t.dtype)
    if t.is_contiguous():
        return flat.view(t.shape)
    probe = torch.empty_like(t, device="meta")  # preserve_format: t's strides when dense
    return flat.as_strided(t.shape, probe.stride())
