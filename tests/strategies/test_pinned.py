"""The pinned pool's bookkeeping, on CPU: pinning itself needs CUDA, so a plain allocation stands in
for cudaHostAlloc; the caps, the counters, the fallback and the lock are the pool's own code."""

import gc
import threading

import torch

from adaptmem.strategies.pinned import PinnedBlock, PinnedPool

KiB = 1024


class Allocator:
    """Pins like PyTorch's host allocator would (whole powers of two), or fails when told to."""

    def __init__(self):
        self.sizes, self.fail = [], False

    def __call__(self, nbytes):
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        assert nbytes & (nbytes - 1) == 0, "the pool asks for what the host allocator would pin anyway"
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class Event:
    def __init__(self, complete=False, on_query=None):
        self.complete, self.on_query = complete, on_query

    def query(self):
        if self.on_query is not None:
            self.on_query()
        return self.complete


def test_counters_are_the_pinned_bytes_held():
    alloc = Allocator()
    pool = PinnedPool(allocate=alloc)
    blocks = [pool.acquire(n) for n in (3 * KiB, 5 * KiB, 100 * KiB + 1)]
    assert [b.buffer.numel() for b in blocks] == [4 * KiB, 8 * KiB, 128 * KiB]
    assert pool.in_use_bytes == sum(alloc.sizes) == pool.pinned_bytes
    pool.release(blocks[0])
    assert pool.in_use_bytes == sum(alloc.sizes) - 4 * KiB and pool.cached_bytes == 4 * KiB
    assert pool.pinned_bytes == sum(alloc.sizes)  # idle buffers are still pinned


def test_buffers_in_use_count_against_the_cap_and_past_it_copies_go_pageable():
    alloc = Allocator()
    pool = PinnedPool(max_pinned_bytes=16 * KiB, allocate=alloc)
    held = [pool.acquire(8 * KiB), pool.acquire(8 * KiB)]
    assert all(isinstance(b, PinnedBlock) for b in held)
    assert pool.acquire(1) is None  # all 16 KiB are in use: nothing idle to free
    assert (pool.pageable, pool.in_use_bytes, pool.allocations) == (1, 16 * KiB, 2)
    pool.release(held.pop())
    small = pool.acquire(1 * KiB)  # the idle 8 KiB buffer is freed to make room under the cap
    assert isinstance(small, PinnedBlock)
    assert pool.cached_bytes == 0 and pool.pinned_bytes == 9 * KiB <= pool.max_pinned_bytes


def test_a_busy_idle_buffer_is_neither_reused_nor_freed():
    pool = PinnedPool(max_pinned_bytes=8 * KiB, allocate=Allocator())
    block = pool.acquire(8 * KiB)
    block.busy_until = Event(complete=False)  # its copy back is still running
    pool.release(block)
    assert pool.acquire(8 * KiB) is None  # not reused, not freed: the copy still touches it
    block.busy_until.complete = True
    assert pool.acquire(8 * KiB) is block and pool.reuses == 1


def test_a_failed_pinning_falls_back_with_consistent_counters(caplog):
    alloc = Allocator()
    pool = PinnedPool(allocate=alloc)
    kept = pool.acquire(4 * KiB)
    alloc.fail = True
    with caplog.at_level("WARNING", logger="adaptmem"):
        assert pool.acquire(64 * KiB) is None
        assert pool.acquire(64 * KiB) is None
    assert (pool.failures, pool.pageable, pool.allocations) == (2, 2, 1)
    assert pool.in_use_bytes == 4 * KiB  # the failed reservations were given back
    assert sum("pageable host memory" in r.message and "cudaHostAlloc" in r.message for r in caplog.records) == 1
    alloc.fail = False
    assert pool.acquire(64 * KiB) is not None and pool.in_use_bytes == 68 * KiB
    pool.release(kept)


def test_garbage_collection_releasing_a_copy_while_the_pool_is_busy_does_not_deadlock():
    """A copy's buffer goes back from a weakref finalizer, which a collection can run on the very
    thread that holds the pool's lock (here: during the idle check under the lock)."""
    import weakref

    pool = PinnedPool(allocate=Allocator())
    owner = pool.acquire(4 * KiB)

    class Payload:  # garbage in a cycle: only a collection frees it
        pass

    payload = Payload()
    payload.me = payload
    weakref.finalize(payload, pool.release, owner)
    del payload
    busy = pool.acquire(2 * KiB)
    busy.busy_until = Event(complete=False, on_query=gc.collect)
    pool.release(busy)
    done = []
    worker = threading.Thread(target=lambda: done.append(pool.acquire(2 * KiB)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the pool deadlocked on a release from garbage collection"
    assert pool.in_use_bytes == 2 * KiB and pool.cached_bytes == 4 * KiB + 2 * KiB  # owner came back
