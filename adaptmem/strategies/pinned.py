"""Pinned host buffers for CUDA offload, reused across steps.

A buffer returns to the pool only when its payload is gone, and is handed out
again only after the last copy touching it has completed (its CUDA event), so
a reuse can never overwrite bytes a copy still reads or writes.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from adaptmem.strategies.payloads import nbytes_of


class PinnedBlock:
    __slots__ = ("buffer", "busy_until")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.busy_until: Any = None  # CUDA event of the last copy touching the buffer

    def idle(self) -> bool:
        return self.busy_until is None or self.busy_until.query()


class PinnedPool:
    """Reusable pinned host buffers, bucketed by size class.

    max_cached_bytes: idle buffers kept for reuse; past it they are freed.
    """

    def __init__(self, max_cached_bytes: int = 8 * 2**30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._idle: dict[int, list[PinnedBlock]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.allocations = 0
        self.reuses = 0

    @property
    def cached_bytes(self) -> int:
        return self._idle_bytes

    def acquire(self, nbytes: int) -> PinnedBlock:
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
            self.in_use_bytes += size
            self.allocations += 1
        return PinnedBlock(torch.empty(size, dtype=torch.uint8, pin_memory=True))

    def release(self, block: PinnedBlock) -> None:
        size = block.buffer.numel()
        with self._lock:
            self.in_use_bytes -= size
            if self._idle_bytes + size <= self.max_cached_bytes:
                self._idle.setdefault(size, []).append(block)
                self._idle_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


def size_class(nbytes: int) -> int:
    """Round up so that varying shapes still reuse buffers: powers of two up to
    1 MiB, then quarters of the power of two below (at most 25% slack)."""
    nbytes = max(int(nbytes), 512)
    if nbytes <= 2**20:
        return 1 << (nbytes - 1).bit_length()
    step = (1 << (nbytes.bit_length() - 1)) // 4
    return -(-nbytes // step) * step


def host_view(block: PinnedBlock, t: torch.Tensor) -> torch.Tensor:
    """A view of the pinned buffer shaped like `t`: same strides when `t` is
    dense (so backward sees the layout it saved), contiguous otherwise."""
    flat = block.buffer[: nbytes_of(t)].view(t.dtype)
    if t.is_contiguous():
        return flat.view(t.shape)
    probe = torch.empty_like(t, device="meta")  # preserve_format: t's strides when dense
    return flat.as_strided(t.shape, probe.stride())
