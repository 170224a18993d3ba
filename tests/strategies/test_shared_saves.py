"""What Packer sends: a tensor several ops save is packed once per block call (one host copy,
one trip over the link each way, one compressed payload), views go as their storage and come
back as themselves, and saves that only look alike are never matched."""

import copy

import torch
from torch import nn

import adaptmem
from adaptmem import Mode, OffloadOptions
from adaptmem.devices.link import SimulatedLink
from adaptmem.devices.tiers import using_link
from adaptmem.strategies.compress import CompressOptions, Quantized, encode
from adaptmem.strategies.offload import HostCopy
from adaptmem.strategies.offload_runtime import OffloadRuntime
from adaptmem.strategies.packing import Packer
from adaptmem.strategies.payloads import Decoded
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
    """`n` blocks of `block` in a row, each output scaled by `scale`."""

    def __init__(self, block=None, n: int = 2, scale: float = 1 / D):
        super().__init__()
        self.layers = nn.ModuleList((block or Reuser)() for _ in range(n))
        self.scale = scale

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * self.scale
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
    handles = (
        adaptmem.instrument(
            model, mode=mode, offload=OffloadOptions(min_bytes=0), compress=CompressOptions(min_bytes=0)
        )
        if mode is not None
        else []
    )
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


def test_a_tensor_several_ops_save_is_decoded_once_with_the_same_gradients(monkeypatch):
    decodes = []
    decode = Quantized.decode

    def counted(self):
        decodes.append(self.numel)
        return decode(self)

    monkeypatch.setattr(Quantized, "decode", counted)
    shared, handles, _ = _train(Mode.COMPRESS)
    # per block: the input, h (saved four times), s and sin(h), each decoded once
    assert sorted(decodes) == sorted([B * D, B * D, B, B * D] * 2)
    monkeypatch.setattr(Decoded, "share", lambda self: None)  # each save decodes its own
    decodes.clear()
    apart, _, _ = _train(Mode.COMPRESS)
    assert len(decodes) == 2 * 7
    assert all(torch.equal(a, b) for a, b in zip(shared, apart))


def test_a_decoded_tensor_is_kept_for_the_saves_yet_to_read_it_and_let_go_after_the_last():
    payload = encode(torch.randn(4, 64), CompressOptions(min_bytes=0))
    payload.share()
    first = payload.restore()
    assert payload.back is first
    assert payload.restore() is first and payload.back is None  # the second save let it go
    again = payload.restore()  # a second backward through a kept graph decodes again
    assert again is not first and torch.equal(again, first)


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


def test_views_of_one_storage_go_as_the_storage_once_and_come_back_with_their_own_strides():
    packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime())
    fused = torch.randn(4, 10, 2 * 343)  # a fused projection, as Phi-3's gate_up_proj
    gate, up = fused.chunk(2, dim=-1)
    transposed = torch.randn(6, 5).t()
    with packer.installed():
        packed = [packer(t) for t in (gate, up, transposed)]
    copies = {id(p.base) for p in packed[:2]}
    assert len(copies) == 1  # one copy of the storage for both views
    assert packed[0].base.host.numel() == fused.numel()
    back = [p.restore() for p in packed]
    for original, restored in zip((gate, up, transposed), back):
        assert torch.equal(restored, original)
        assert (restored.stride(), restored.storage_offset()) == (original.stride(), original.storage_offset())
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()  # as NONE keeps them


def test_a_small_view_of_a_large_storage_stays_on_the_device_and_an_expanded_one_goes_as_its_storage():
    stats = {}
    packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime(), stats=stats)
    hidden = torch.randn(4, 64, 32)
    last = hidden[:, -1]  # 1/64 of its storage
    row = torch.randn(1, 32).expand(64, 32)  # 64 times its storage's elements
    with packer.installed():
        kept, expanded = packer(last), packer(row)
    assert isinstance(kept.part, torch.Tensor) and kept.part.data_ptr() == last.data_ptr()
    assert stats["on_device"] == last.numel() * 4 and kept.restore() is kept.part
    assert expanded.base.host.numel() == 32
    restored = expanded.restore()
    assert torch.equal(restored, row) and restored.stride() == (0, 1)


def test_small_views_of_one_storage_wait_on_the_device_until_they_are_worth_its_copy():
    """A loop that saves one slice of a large tensor per step (a scan, chunked attention): each
    slice alone is too small a part to send the storage for, so the first slices wait on the
    device; once the slices add up to a quarter of it, the storage goes once, every slice
    kept so far comes back as a view of that copy, with its strides, and so do later ones."""
    link = CountingLink()
    stats = {}
    packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime(), stats=stats)
    states = torch.randn(2, 16, 12, 8)  # 16 steps along dim 1: a slice is 1/16 of the storage
    slices = [states[:, i] for i in range(5)]
    with using_link(link), packer.installed():
        packed = [packer(s) for s in slices[:3]]
        assert link.sent == [] and stats["on_device"] == 3 * slices[0].numel() * 4
        again = packer(slices[1])  # a slice saved twice before the storage goes
        assert again is packed[1]
        packed.append(packer(slices[3]))  # 4/16 of the storage: a quarter
        packed.append(packer(slices[4]))  # after the copy: a view of it at once
    whole = states.numel() * 4
    assert link.sent == [whole]  # the storage, once
    assert stats["host"] == whole and stats["on_device"] == 0
    copies = {id(p.part.base) if hasattr(p, "part") else id(p.base) for p in packed}
    assert len(copies) == 1
    with using_link(link):
        restored = [p.restore() for p in [*packed, again]]
    for got, want in zip(restored, [*slices, slices[1]]):
        assert torch.equal(got, want) and got.stride() == want.stride()
    assert len(link.fetched) == 1  # brought back once for its six saves


def test_a_loop_over_slices_is_offloaded_exactly_and_frees_the_device():
    """A block that steps through its own projection one position at a time, as a scan does:
    its slices leave the device with their storage, and the gradients are those of NONE."""

    class Scan(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            a = self.proj(x)  # saved by nothing whole: only its slices, by the products
            h = torch.zeros_like(a[:, 0])
            outs = []
            for i in range(a.shape[1]):
                h = h * a[:, i] + x[:, i]
                outs.append(h)
            return torch.stack(outs, 1)

    torch.manual_seed(0)
    base, x = Net(Scan, n=3, scale=1.0), torch.randn(8, 48, 32)
    results = {}
    for mode in (None, Mode.OFFLOAD):
        model = copy.deepcopy(base)
        if mode is not None:
            adaptmem.instrument(model, mode=mode, offload=OffloadOptions(min_bytes=0))
        dev = SimulatedDevice()
        dev.track(model)
        with dev:
            model(x).square().mean().backward()
        results[mode] = dev.peak_bytes, {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.equal(results[Mode.OFFLOAD][1][n], g) for n, g in results[None][1].items())
    assert results[Mode.OFFLOAD][0] < 0.6 * results[None][0]  # 0.52; with the slices kept on the device, 0.65


def test_a_phi3_with_fused_projections_offloads_exactly():
    """Phi-3 chunks its fused gate_up projection and transposes its heads: the views its ops save
    come back with their strides, so the gradients are bit for bit those of NONE."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    base = Phi3ForCausalLM(config)
    ids = torch.randint(3, 512, (2, 64))
    grads = []
    for mode in (None, Mode.OFFLOAD):
        model = copy.deepcopy(base)
        if mode is not None:
            adaptmem.instrument(model, mode=mode, offload=OffloadOptions(min_bytes=0))
        dev = SimulatedDevice(link_bytes_per_s=4 * 2**30)
        dev.track(model)
        with dev:
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_tensor_and_a_view_of_it_share_one_copy_whichever_is_saved_first():
    for order in ((0, 1), (1, 0)):
        stats = {}
        packer = Packer(nn.Identity(), offload=OffloadOptions(min_bytes=0), runtime=OffloadRuntime(), stats=stats)
        whole = torch.randn(8, 2 * 343)
        tensors = (whole, whole[:, 343:])
        with packer.installed():
            packed = {i: packer(tensors[i]) for i in order}
        copies = {id(p if isinstance(p, HostCopy) else p.base) for p in packed.values()}
        assert len(copies) == 1 and stats["host"] == whole.numel() * 4
        for i, t in enumerate(tensors):
            back = packed[i].restore()
            assert torch.equal(back, t) and back.stride() == t.stride() and back.storage_offset() == t.storage_offset()
