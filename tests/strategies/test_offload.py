"""Offload machinery that needs no GPU: prefetch order, size classes, host tier."""

import weakref

import pytest
import torch
from helpers import step, tiny, tiny_batch

import adaptmem
from adaptmem import Mode, OffloadOptions
from adaptmem.strategies.offload import HostCopy, PackGroup
from adaptmem.strategies.offload_runtime import OffloadRuntime
from adaptmem.strategies.pinned import size_class
from adaptmem.testing import SimulatedDevice


class RecordingTier:
    """Stands in for the CUDA tier to observe the order of copies back (fetch) and their use (finish)."""

    def __init__(self):
        self.log = []

    def fetch(self, copy):
        self.log.append(("fetch", copy.host.item()))
        return copy.host.item()

    def finish(self, copy, fetched):
        self.log.append(("finish", fetched))
        return copy.host

    def abandon(self, fetched):
        self.log.append(("abandon", fetched))


def test_restoring_a_block_prefetches_the_block_before_it():
    tier = RecordingTier()
    runtime = OffloadRuntime()
    groups, copies = [], []
    for block in range(3):  # forward order
        group = runtime.new_group(OffloadOptions())
        for k in range(2):
            copy = HostCopy(torch.tensor(10 * block + k), tier, group=group)
            group.add(copy)
            copies.append(copy)
        groups.append(group)
    assert groups[0].prev is None and groups[2].prev is groups[1]
    for copy in reversed(copies):  # backward order
        copy.restore()
    assert tier.log == [  # the copy needed now is fetched before the block before it is prefetched
        ("fetch", 21),
        ("fetch", 10),
        ("fetch", 11),
        ("finish", 21),
        ("fetch", 20),
        ("finish", 20),
        ("fetch", 0),
        ("fetch", 1),
        ("finish", 11),
        ("finish", 10),
        ("finish", 1),
        ("finish", 0),
    ]


def test_a_new_forward_does_not_link_to_a_group_already_restoring():
    runtime = OffloadRuntime()
    first = runtime.new_group(OffloadOptions())
    first.begin_restore()
    assert runtime.new_group(OffloadOptions()).prev is None
    assert runtime.new_group(OffloadOptions(prefetch=False)) is None


def test_groups_hold_copies_weakly():
    """A group neither keeps a copy alive (autograd owns it) nor prefetches it once gone."""
    tier = RecordingTier()
    group = PackGroup(prev=None)
    kept = HostCopy(torch.tensor(1.0), tier, group=group)
    dropped = HostCopy(torch.tensor(2.0), tier, group=group)
    group.add(kept)
    group.add(dropped)
    gone = weakref.ref(dropped)
    del dropped
    assert gone() is None  # the group's reference did not keep it alive
    group.prefetch()
    assert tier.log == [("fetch", 1.0)]  # the dead copy is skipped, the live one fetched
    del kept
    assert tier.log[-1] == ("abandon", 1.0)  # prefetched, never used: the tier lets the copy back finish first


def test_size_classes_are_what_the_host_allocator_pins():
    """PyTorch's host allocator rounds every request to the next power of two."""
    assert size_class(1) == 512
    assert size_class(1000) == 1024
    assert size_class(2**20) == 2**20
    for n in (2**20 + 1, 3 * 2**20 + 5, 1234567890):
        c = size_class(n)
        assert n <= c < 2 * n and c & (c - 1) == 0


def test_small_tensors_stay_on_the_device():
    model = tiny()
    batch = tiny_batch(model)
    handles = adaptmem.instrument(model, mode=Mode.OFFLOAD, offload=OffloadOptions(min_bytes=2**40))
    with SimulatedDevice() as dev:
        step(model, batch)
    assert dev.host_peak_bytes == 0
    assert handles[0].offload_options.min_bytes == 2**40


def test_offloaded_tensors_survive_retain_graph_and_a_second_backward():
    model = tiny()
    batch = tiny_batch(model)
    reference = step(model, batch)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    loss = model(**batch).loss
    loss.backward(retain_graph=True)
    loss.backward()
    doubled = {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.equal(doubled[n], 2 * reference[1][n]) for n in doubled)


def test_offload_options_are_checked():
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int"):
        OffloadOptions(min_bytes=-1)
    with pytest.raises(ValueError, match="max_in_flight_bytes must be a non-negative int"):
        OffloadOptions(max_in_flight_bytes=1.5)


def test_parameters_and_buffers_are_never_offloaded():
    from torch import nn

    from adaptmem.strategies.packing import Packer

    lin = nn.Linear(256, 256)
    lin.register_buffer("table", torch.randn(256, 256))
    packer = Packer(lin, offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime())
    for state in (lin.weight, lin.weight.t(), lin.table):
        packed = packer(state)
        assert (
            isinstance(packed, torch.Tensor)
            and packed.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
        )
    assert isinstance(packer(torch.randn(256, 256)), HostCopy)


def test_fetch_state_is_safe_when_backward_threads_race():
    """Autograd runs a backward thread per device: each copy is fetched once, however they interleave."""
    import threading
    import time

    class SlowTier(RecordingTier):
        def fetch(self, copy):  # widens the window between checking and setting `fetched`
            time.sleep(0.002)
            return super().fetch(copy)

    tier = SlowTier()
    runtime = OffloadRuntime()
    first, second = runtime.new_group(OffloadOptions()), runtime.new_group(OffloadOptions())
    early = [HostCopy(torch.tensor(float(k)), tier, group=first) for k in range(8)]
    late = HostCopy(torch.tensor(99.0), tier, group=second)
    for copy in early:
        first.add(copy)
    barrier = threading.Barrier(4)

    def worker(k):
        barrier.wait()
        if k == 0:
            late.restore()  # begins the second group: prefetches the first
        for copy in early[k::2] if k < 2 else early:
            copy.prefetch() if k >= 2 else copy.restore()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fetches = [value for kind, value in tier.log if kind == "fetch"]
    finished = [value for kind, value in tier.log if kind == "finish"]
    assert sorted(finished) == [float(k) for k in range(8)] + [99.0]
    assert sorted(fetches) == sorted(finished)  # each copy fetched exactly once: none twice, none for nobody
    assert not [entry for entry in tier.log if entry[0] == "abandon"]


def test_the_window_of_copies_in_flight_is_bounded_and_waits_on_the_oldest():
    from adaptmem.strategies.cuda_offload import CopyWindow

    class Event:
        def __init__(self):
            self.complete = False

        def query(self):
            return self.complete

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    window, compute = CopyWindow(), Stream()
    tensors = [torch.empty(100, dtype=torch.uint8) for _ in range(5)]
    events = [Event() for _ in tensors]
    for t, e in zip(tensors[:3], events[:3]):
        window.push(t, e, limit=300, compute=compute)
    assert window.bytes == 300 and compute.waited == []  # full, nobody waited yet
    window.push(tensors[3], events[3], limit=300, compute=compute)
    assert compute.waited == [events[0]] and window.bytes == 300 and window.waits == 1
    events[1].complete = True  # arrived: let go of without a wait
    window.push(tensors[4], events[4], limit=300, compute=compute)
    assert compute.waited == [events[0]] and window.bytes == 300 and window.peak_bytes == 300
    window.drain(compute)
    assert window.bytes == 0 and compute.waited == [events[0], events[2], events[3], events[4]]
