"""Offload machinery that needs no GPU: prefetch order, size classes, host tier."""

import weakref

import pytest
import torch

import adaptmem
from adaptmem import Mode, OffloadOptions
from adaptmem.strategies.offload import HostCopy, OffloadRuntime, PackGroup
from adaptmem.strategies.pinned import size_class
from adaptmem.testing import SimulatedDevice

from helpers import step, tiny, tiny_batch


class RecordingTier:
    """Stands in for the CUDA tier to observe the order of prefetches and restores."""

    def __init__(self):
        self.log = []

    def prefetch(self, copy):
        self.log.append(("prefetch", copy.host.item()))

    def restore(self, copy):
        self.log.append(("restore", copy.host.item()))
        return copy.host


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
    assert tier.log == [
        ("prefetch", 10), ("prefetch", 11), ("restore", 21), ("restore", 20),
        ("prefetch", 0), ("prefetch", 1), ("restore", 11), ("restore", 10),
        ("restore", 1), ("restore", 0),
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
    assert tier.log == [("prefetch", 1.0)]  # the dead copy is skipped, the live one fetched


def test_size_classes_bound_the_slack():
    assert size_class(1) == 512
    assert size_class(1000) == 1024
    assert size_class(2**20) == 2**20
    for n in (2**20 + 1, 3 * 2**20 + 5, 1234567890):
        c = size_class(n)
        assert n <= c <= 1.25 * n + 1


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


def test_parameters_and_buffers_are_never_offloaded():
    from torch import nn

    from adaptmem.strategies.packing import Packer

    lin = nn.Linear(256, 256)
    lin.register_buffer("table", torch.randn(256, 256))
    packer = Packer(lin, offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime())
    for state in (lin.weight, lin.weight.t(), lin.table):
        packed = packer(state)
        assert isinstance(packed, torch.Tensor) and packed.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
    assert isinstance(packer(torch.randn(256, 256)), HostCopy)
