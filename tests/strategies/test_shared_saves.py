"""A tensor several ops save is packed once per block call: one host copy, one trip over the
link each way, one compressed payload; and saves that only look alike are never matched."""

import torch
from torch import nn

import adaptmem
from adaptmem import Mode, OffloadOptions
from adaptmem.devices.link import SimulatedLink
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import HostCopy
from adaptmem.strategies.offload_runtime import OffloadRuntime
from adaptmem.strategies.packing import Packer
from adaptmem.testing import SimulatedDevice

MiB = 2**20
B, D = 64, 256


class Reuser(nn.Module):
    """`h` is saved four times: by exp (its output), twice by h * h, and by sin."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        h = self.proj(x).exp()
        s = (h * h).sum(-1, keepdim=True)
        return s * h.sin()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Reuser() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) / D
        return x


class CountingLink(SimulatedLink):
    """The stand-in's link, noting the bytes of every copy each way."""

    def __init__(self):
        super().__init__(4 * 2**30)
        self.sent, self.fetched = [], []

    def send(self, t, limit=None):
        self.sent.append(t.numel() * t.element_size())
        return super().send(t, limit)

    def fetch(self, nbytes, after=0.0):
        self.fetched.append(nbytes)
        return super().fetch(nbytes, after)


def _train(mode):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(B, D, requires_grad=True)
    handles = adaptmem.instrument(model, mode=mode, offload=OffloadOptions(min_bytes=0),
                                  compress=CompressOptions(min_bytes=0)) if mode is not None else []
    dev = SimulatedDevice(link_bytes_per_s=1.0)
    dev.link = link = CountingLink()
    dev.track(model)
    with dev:
        model(x).sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())], handles, link


def test_a_tensor_several_ops_save_is_offloaded_once_and_brought_back_once():
    expected, _, _ = _train(None)
    grads, handles, link = _train(Mode.OFFLOAD)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    # per block: the block input (saved by the linear), h, s and sin(h); h once, not four times
    per_block = [B * D * 4, B * D * 4, B * 4, B * D * 4]
    assert sorted(link.sent) == sorted(per_block * 2)
    assert sorted(link.fetched) == sorted(link.sent)
    assert [h.host_bytes for h in handles] == [sum(per_block)] * 2
    assert [h.packed_bytes for h in handles] == [sum(per_block)] * 2


def test_a_tensor_several_ops_save_is_compressed_once():
    _, handles, link = _train(Mode.COMPRESS | Mode.OFFLOAD)
    assert [h.packed_bytes for h in handles] == [(3 * B * D + B) * 4] * 2
    assert len(link.sent) == 2 * 4 * 2  # two blocks, four tensors, each as codes and scales
    assert sorted(link.fetched) == sorted(link.sent)


def test_a_storage_freed_and_another_at_its_address_is_packed_anew():
    packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime())
    buffer = bytearray(torch.arange(8, dtype=torch.float32).numpy().tobytes())
    first = torch.frombuffer(buffer, dtype=torch.float32)
    with packer.installed():
        packed = packer(first)
        address = first.untyped_storage().data_ptr()
        del first  # its storage goes; the bytes stay, and the next storage lands on them
        buffer[:4] = torch.tensor([100.0]).numpy().tobytes()
        second = torch.frombuffer(buffer, dtype=torch.float32)
        assert second.untyped_storage().data_ptr() == address
        again = packer(second)
    assert again is not packed
    assert again.restore()[0].item() == 100.0 and packed.restore()[0].item() == 0.0


def test_a_tensor_changed_in_place_between_saves_is_packed_anew():
    packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime())
    t = torch.zeros(16)
    with packer.installed():
        before = packer(t)
        assert packer(t) is before  # the same save twice: one copy
        t.add_(1)
        after = packer(t)
    assert after is not before
    assert torch.equal(before.restore(), torch.zeros(16)) and torch.equal(after.restore(), torch.ones(16))


def test_a_copy_several_saves_hold_is_fetched_once_and_let_go_after_the_last():
    class Tier:
        fetches = 0

        def fetch(self, copy):
            Tier.fetches += 1

        def finish(self, copy, fetched):
            return copy.host.clone()

    copy = HostCopy(torch.ones(4), Tier())
    for _ in range(2):
        copy.share()
    first = copy.restore()
    assert copy.restore() is first and copy.restore() is first
    assert Tier.fetches == 1 and copy.back is None  # the third read let it go
    assert copy.restore() is not first and Tier.fetches == 2  # a second backward (retain_graph) fetches again
