"""CUDA offload under adversarial timing: side streams delayed, memory churned on every stream.

Skipped without a GPU. Each guard has a twin test that removes it and expects
the gradients to go wrong, so a pass means the guard is what keeps them right
(the twins are how the tests were checked: run them, they must corrupt).
Gradients are compared bitwise, with eager attention and deterministic
algorithms (SDPA's memory-efficient backward is not deterministic).
"""

import contextlib
import json
import threading

import pytest
import torch
from helpers import hf_batch, llama

import adaptmem
from adaptmem import Mode, OffloadOptions
from adaptmem.strategies.cuda_offload import CopyWindow, CudaTier
from adaptmem.wrapping import get_instrumentation

pytestmark = pytest.mark.cuda
MiB = 2**20
DELAY = 20_000_000  # GPU cycles (~10 ms): long enough for compute to run far ahead of the copies


def eager_llama(layers=4, hidden=256):
    model = llama(layers=layers, hidden=hidden, dropout=0.0)
    model.config._attn_implementation = "eager"
    return model.cuda()


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def grads_of(model, batch, churn=False):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    loss = model(**batch).loss
    junk = churned() if churn else []
    loss.backward()
    junk += churned() if churn else []
    torch.cuda.synchronize()
    del junk
    return loss.detach().cpu(), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}


def churned():
    """Take freed memory back at once and overwrite it, on the compute stream."""
    return [torch.full((MiB,), float("nan"), device="cuda") for _ in range(32)]


def same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


@pytest.fixture
def slow_side_streams(monkeypatch):
    """Every copy on the D2H and H2D streams starts after a long sleep on that stream, and each
    pack is followed by allocations on the compute stream that reuse whatever was just freed."""
    pack, fetch = CudaTier.pack, CudaTier.fetch
    junk = []

    def slow_pack(self, t, group, options):
        with torch.cuda.stream(self.d2h):
            torch.cuda._sleep(DELAY)
        copy = pack(self, t, group, options)
        junk.append(torch.full((t.numel(),), float("nan"), device=t.device))  # compute-stream churn
        return copy

    def slow_fetch(self, copy):
        with torch.cuda.stream(self.h2d):
            torch.cuda._sleep(DELAY)
            junk.append(torch.full((1024,), float("nan"), device=self.device))  # churn on the side stream
        return fetch(self, copy)

    monkeypatch.setattr(CudaTier, "pack", slow_pack)
    monkeypatch.setattr(CudaTier, "fetch", slow_fetch)
    yield junk
    junk.clear()


def offloaded(window=64 * MiB, prefetch=True, seq=512):
    model = eager_llama()
    batch = {k: v.cuda() for k, v in hf_batch(batch=2, seq=seq).items()}
    with deterministic():
        reference = grads_of(model, batch)
    adaptmem.instrument(
        model, mode=Mode.OFFLOAD, offload=OffloadOptions(min_bytes=0, max_in_flight_bytes=window, prefetch=prefetch)
    )
    return model, batch, reference


@pytest.mark.parametrize("window", [0, 4 * MiB, 1 << 40], ids=["no-window", "small", "unbounded"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gradients_stay_exact_with_slow_side_streams(slow_side_streams, window, prefetch):
    model, batch, reference = offloaded(window, prefetch)
    with deterministic():
        for _ in range(2):
            assert same(grads_of(model, batch, churn=True), reference)


@pytest.mark.parametrize("after", [Mode.NONE, Mode.SELECTIVE, Mode.CHECKPOINT])
def test_a_block_that_offloads_nothing_prefetches_the_one_before_it_exactly(slow_side_streams, after):
    """Plan O, O, X, X: block 1's copies back are started from a gradient hook as backward
    reaches block 2, on the side stream, while block 2's gradients run; block 1 must still read
    them only once written."""
    model, batch, reference = offloaded(4 * MiB, True)
    for h, mode in zip(adaptmem.get_handles(model), (Mode.OFFLOAD, Mode.OFFLOAD, after, after)):
        h.mode = mode
    with deterministic():
        for _ in range(2):
            assert same(grads_of(model, batch, churn=True), reference)


def test_without_the_window_the_copies_read_reused_memory(slow_side_streams, monkeypatch):
    """The guard removed: the device tensor is let go of before its copy ran (what freeing it without
    record_stream, or without a wait, does). The copy then reads memory compute overwrote."""
    monkeypatch.setattr(CopyWindow, "push", lambda self, t, done, limit, compute: None)
    model, batch, reference = offloaded()
    with deterministic():
        assert not same(grads_of(model, batch, churn=True), reference)


def test_without_the_h2d_wait_backward_reads_a_copy_not_yet_written(slow_side_streams, monkeypatch):
    """The guard removed: the compute stream does not wait for the copy back's event."""

    def finish(self, copy, fetched):
        return fetched[0]

    monkeypatch.setattr(CudaTier, "finish", finish)
    model, batch, reference = offloaded()
    with deterministic():
        assert not same(grads_of(model, batch, churn=True), reference)


def test_copies_in_flight_are_allocated_and_bounded():
    model, batch, _ = offloaded(window=8 * MiB, seq=256)  # no saved tensor over 4 MiB (eager scores: 4 MiB)
    tier = get_instrumentation(model).runtime.offload.tier_for(torch.device("cuda", 0))
    grads_of(model, batch)
    assert 0 < tier.window.peak_bytes <= 8 * MiB
    assert tier.window.bytes == 0  # backward drained it


def test_restored_tensors_come_from_the_compute_streams_pool():
    """Backward's copies back reuse what forward freed: reserved memory stays near allocated."""
    model, batch, _ = offloaded()
    grads_of(model, batch)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    retries = torch.cuda.memory_stats()["num_alloc_retries"]  # counted since the process began
    grads_of(model, batch)
    stats = torch.cuda.memory_stats()
    assert stats["reserved_bytes.all.peak"] <= 1.25 * stats["allocated_bytes.all.peak"] + 64 * MiB
    assert stats["num_alloc_retries"] == retries


def copy_profile(prefetch: bool, tmp_path) -> dict:
    """One profiled OFFLOAD step of a model whose copies take longer than issuing them (hidden
    1024, batch 4 x 1024): on a tiny model a copy ends before the CPU has launched the next
    kernel, and nothing could overlap."""
    from torch.profiler import ProfilerActivity, profile

    from stress.profile_offload import summarize

    model = llama(layers=6, hidden=1024, dropout=0.0).cuda()
    batch = {k: v.cuda() for k, v in hf_batch(batch=4, seq=1024).items()}
    adaptmem.instrument(model, mode=Mode.OFFLOAD, offload=OffloadOptions(prefetch=prefetch))
    for _ in range(2):
        grads_of(model, batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        grads_of(model, batch)
    trace = tmp_path / f"trace-{prefetch}.json"
    prof.export_chrome_trace(str(trace))
    s = summarize(json.loads(trace.read_text())["traceEvents"])
    assert s["h2d"]["bytes"] > 0 and s["h2d"]["pageable"] == 0, s
    return s


def test_a_blocks_copy_back_overlaps_the_next_blocks_compute(tmp_path):
    """With prefetch, block i-1's copies back run while block i's gradients are computed; without
    it each copy is fetched when needed and compute waits for it. The link here is the bottleneck
    (copies take longer than compute), so the share of copy time hidden is bounded by compute's."""
    hidden = {p: copy_profile(p, tmp_path)["h2d"] for p in (True, False)}
    ms = {p: h["ms"] * h["overlapped"] for p, h in hidden.items()}
    assert ms[True] >= 0.1 * hidden[True]["ms"], hidden
    assert ms[True] >= 3 * ms[False], hidden


def test_the_pinned_pool_is_bounded_and_its_counters_match_the_host_allocator():
    import gc

    model, batch, _ = offloaded()
    pool = get_instrumentation(model).runtime.offload.pool
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    counts, pinned = [], []
    for _ in range(5):  # no synchronize between steps: buffers come back when their events complete
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        counts.append(pool.allocations)
        pinned.append(pool.pinned_bytes)
    torch.cuda.synchronize()
    assert counts[-1] == counts[-2] and max(pinned) <= 2 * pinned[0]  # reused, not grown step after step
    # the pool's buffers (in use or idle) are the host allocator's blocks checked out, rounding
    # included; PyTorch itself may hold a few bytes more (staging for small non-blocking copies)
    grown = torch.cuda.host_memory_stats().get("active_bytes.current", 0) - before
    assert pool.pinned_bytes <= grown <= pool.pinned_bytes + 64 * 1024
    assert pool.pinned_bytes <= pool.max_pinned_bytes


def test_a_failed_pinned_allocation_falls_back_to_pageable_copies(monkeypatch):
    model, batch, reference = offloaded()
    pool = get_instrumentation(model).runtime.offload.pool

    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(pool, "_allocate", refuse)
    with deterministic():
        assert same(grads_of(model, batch), reference)
    assert pool.failures > 0 and pool.pageable == pool.failures and pool.in_use_bytes == 0


def test_a_model_on_cuda_1_is_measured_and_offloaded_there_while_cuda_0_is_current():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from adaptmem.devices.select import make_probe

    model = llama(layers=4, hidden=256, dropout=0.0).to("cuda:1")
    model.config._attn_implementation = "eager"
    batch = {k: v.to("cuda:1") for k, v in hf_batch(batch=2, seq=256).items()}
    torch.cuda.set_device(0)
    with deterministic():
        reference = grads_of(model, batch)
    on_zero = torch.cuda.memory_allocated(0)
    assert make_probe(None, model).name == "cuda:1"
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    with deterministic():
        assert same(grads_of(model, batch), reference)
    adaptmem.restore(model)
    with deterministic(), adaptmem.manage(model, policy="every-2") as mem:  # lossless, and checkpoints
        assert mem.probe.name == "cuda:1"
        for _ in range(3):
            with mem.step():
                got = grads_of(model, batch)
            assert same(got, reference)
    assert torch.cuda.memory_allocated(0) == on_zero  # nothing of it landed on the current device


def test_outside_memory_reads_steady_while_the_allocator_churns():
    from adaptmem.devices.cuda import CudaProbe

    probe = CudaProbe()
    torch.cuda.synchronize()
    baseline = probe.external()
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
            del x
            torch.cuda.empty_cache()

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        readings = [probe.external() for _ in range(2000)]
    finally:
        stop.set()
        worker.join()
    assert max(readings) - baseline < 64 * MiB, (max(readings) - baseline) / MiB
