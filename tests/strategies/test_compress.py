"""COMPRESS: codec accuracy, what passes through, and training close to exact."""

import pytest
import torch
from helpers import hf_batch, int8_codes, llama, min_cosine, step, tiny, tiny_batch
from torch import nn

import adaptmem
from adaptmem import CompressOptions, Mode
from adaptmem.strategies.compress import BitPacked, Quantized, encode
from adaptmem.strategies.packing import Packer
from adaptmem.strategies.payloads import Payload, restore


def roundtrip(t, **opts):
    payload = encode(t, CompressOptions(min_bytes=0, **opts))
    return payload, restore(payload)


@pytest.mark.parametrize("shape", [(1000,), (7, 33), (4, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_error_is_within_half_a_step_per_group(shape, dtype):
    torch.manual_seed(0)
    t = (torch.randn(shape) * 3).to(dtype)
    payload, back = roundtrip(t, group_size=64)
    assert isinstance(payload, Quantized) and payload.codes.dtype == torch.int8
    assert back.shape == t.shape and back.dtype == t.dtype
    flat = t.float().reshape(-1)
    pad = (-flat.numel()) % 64
    groups = torch.nn.functional.pad(flat, (0, pad)).view(-1, 64)
    step_size = groups.abs().amax(1, keepdim=True) / 127
    bound = (step_size / 2).expand_as(groups).reshape(-1)[: flat.numel()]
    tolerance = flat.abs() * (0.01 if dtype != torch.float32 else 0) + 1e-6
    assert ((back.float().reshape(-1) - flat).abs() <= bound + tolerance).all()


def test_fp8_and_bf16_relative_error():
    torch.manual_seed(0)
    t = torch.randn(64, 256)
    _, fp8 = roundtrip(t, codec="fp8")
    _, bf16 = roundtrip(t, codec="bf16")
    rel = lambda x: ((x - t).norm() / t.norm()).item()
    assert rel(fp8) < 0.05
    assert rel(bf16) < 0.005


def test_bool_masks_are_bit_packed_losslessly():
    torch.manual_seed(0)
    mask = torch.rand(3, 5, 37) > 0.3
    payload, back = roundtrip(mask)
    assert isinstance(payload, BitPacked)
    assert payload.bits.numel() == -(-mask.numel() // 8)
    assert torch.equal(back, mask)


def test_zero_tensor_and_non_contiguous_input():
    z = torch.zeros(10, 100)
    assert torch.equal(roundtrip(z)[1], z)
    t = torch.randn(100, 64).t()
    assert torch.allclose(roundtrip(t)[1], t, atol=t.abs().max().item() / 100)


@pytest.mark.parametrize("codec", ["int8", "fp8", "bf16", "bool"])
def test_a_view_comes_back_with_the_strides_it_had(codec):
    """Compiled backward code asserts the strides of what it saved: a transposed or permuted
    view comes back as that view of its values in memory order, a slice with gaps as a copy
    with its strides, an expanded tensor (overlapping) contiguous."""
    torch.manual_seed(0)
    base = torch.randn(6, 40, 64) if codec != "bool" else torch.rand(6, 40, 64) > 0.5
    opts = {"codec": codec} if codec != "bool" else {}
    views = {
        "transposed": base[0].t(),
        "permuted": base.permute(2, 0, 1),
        "gapped": base[:, :, :32],
        "gapped and permuted": base[:, :20].transpose(0, 1),
    }
    for name, t in views.items():
        payload, back = roundtrip(t, **opts)
        assert back.shape == t.shape and back.stride() == t.stride(), name
        if codec == "bool":
            assert torch.equal(back, t), name
        else:
            assert torch.allclose(back, t, atol=t.abs().max().item() / 20), name
    expanded = base[:1].expand(6, 40, 64)
    assert roundtrip(expanded, **opts)[1].is_contiguous()


@pytest.mark.parametrize("codec", ["int8", "fp8", "bf16"])
def test_the_codec_records_nothing_for_autograd_in_grad_mode(codec):
    """A pack hook runs in forward and an unpack under `create_graph=True` in grad mode: neither the
    payload nor the tensor it gives back carries a gradient or a node."""
    t = (torch.randn(64, 64) * 2).requires_grad_()
    with torch.enable_grad():
        payload = encode(t * 1.0, CompressOptions(min_bytes=0, codec=codec))
        back = payload.restore()
    assert not payload.codes.requires_grad and back.grad_fn is None and not back.requires_grad
    assert (
        payload.nbytes()
        == Payload.nbytes(payload)
        == sum(  # counted without a copy of it made
            p.numel() * p.element_size() for p in (payload.codes, payload.scales) if p is not None
        )
    )


def test_what_passes_through_untouched():
    opts = CompressOptions(min_bytes=1024)
    assert encode(torch.randn(10), opts) is None  # below min_bytes
    assert encode(torch.arange(10_000), opts) is None  # integers
    assert encode(torch.randn(1000).half(), CompressOptions(codec="bf16", min_bytes=0)) is None
    assert encode(torch.rand(2000) > 0.5, CompressOptions(min_bytes=0, pack_bool=False)) is None


def test_parameters_buffers_and_autocast_weight_copies_are_never_compressed():
    lin = nn.Linear(64, 64)
    lin.register_buffer("table", torch.randn(64, 64))
    packer = Packer(lin, compress=CompressOptions(min_bytes=0))
    assert not isinstance(packer(lin.weight), Quantized)
    assert not isinstance(packer(lin.weight.t()), Quantized)
    assert not isinstance(packer(lin.table), Quantized)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = lin.weight.to(torch.bfloat16)
    assert not isinstance(packer(cast), Quantized)
    assert isinstance(packer(torch.randn(64, 64)), Quantized)


def test_autocast_training_keeps_weights_exact_in_saved_tensors(monkeypatch):
    model = tiny()
    adaptmem.instrument(model, mode=Mode.COMPRESS, compress=CompressOptions(min_bytes=0))
    seen = []
    original = Packer.__call__

    def spy(self, t):
        out = original(self, t)
        if isinstance(out, Quantized):
            seen.append(t.shape)
        return out

    monkeypatch.setattr(Packer, "__call__", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**tiny_batch(model, batch=2, seq=24)).loss  # 48 rows: no weight has that shape
    loss.backward()
    weight_shapes = {tuple(p.shape) for p in model.blocks.parameters() if p.dim() == 2}
    assert seen and not any(tuple(s) in weight_shapes for s in seen)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="codec must be one of"):
        CompressOptions(codec="int4")
    with pytest.raises(ValueError, match="group_size must be an int >= 8"):
        CompressOptions(group_size=2)
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int"):
        CompressOptions(min_bytes=-5)


def test_int8_gradients_point_the_same_way_on_hf_llama():
    model = llama(layers=3)
    batch = hf_batch(seq=128)
    _, exact = step(model, batch)
    adaptmem.instrument(model, mode=Mode.COMPRESS, compress=CompressOptions(codec="int8", min_bytes=0))
    _, approx = step(model, batch)
    assert min_cosine(approx, exact) >= 0.99


def _losses(mode, codec="int8", steps=50):
    model = tiny(dim=96, n_layers=4, vocab_size=64, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    adaptmem.instrument(model, mode=mode, compress=CompressOptions(codec=codec, min_bytes=0))
    gen = torch.Generator().manual_seed(0)
    # a learnable task: each sequence repeats a short random motif
    motifs = torch.randint(0, 64, (8, 6), generator=gen)
    data = motifs.repeat(1, 8)
    losses = []
    for i in range(steps):
        loss, _ = step(model, {"input_ids": data, "labels": data}, seed=i)
        opt.step()
        losses.append(loss.item())
    return losses


def test_int8_training_loss_within_two_percent_of_exact_over_50_steps():
    exact = _losses(Mode.NONE)
    int8 = _losses(Mode.COMPRESS)
    assert exact[-1] < 0.5 * exact[0], "the task must be learnable for the comparison to mean anything"
    assert abs(int8[-1] - exact[-1]) <= 0.02 * exact[-1]


@pytest.mark.parametrize("codec,min_cos", [("bf16", 0.999), ("fp8", 0.95)])
def test_bf16_and_fp8_errors_are_reported(codec, min_cos, record_property, capsys):
    model = llama(layers=3)
    batch = hf_batch(seq=128)
    _, exact = step(model, batch)
    handles = adaptmem.instrument(model, mode=Mode.COMPRESS, compress=CompressOptions(codec=codec, min_bytes=0))
    _, approx = step(model, batch)
    cos = min_cosine(approx, exact)
    rel = max(((approx[n] - exact[n]).norm() / exact[n].norm()).item() for n in exact)
    record_property(f"{codec}_min_grad_cosine", cos)
    record_property(f"{codec}_max_grad_rel_error", rel)
    with capsys.disabled():
        print(f"\n[compress {codec}] min gradient cosine {cos:.6f}, max relative gradient error {rel:.4%}")
    assert handles[0].compress_options.codec == codec
    assert cos >= min_cos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_codec_gives_the_defined_codes(dtype):
    torch.manual_seed(0)
    t = torch.cat([torch.randn(5000) * 4, torch.zeros(64), torch.full((64,), -3.0)]).to(dtype)
    codes, scales = int8_codes(t, 64)
    payload = encode(t, CompressOptions(min_bytes=0, compile="off"))
    assert torch.equal(payload.codes, codes) and torch.equal(payload.scales, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_one_pass_reduction_and_decode_give_the_same_values(dtype):
    """What the eager codec runs on CUDA, run here: one `aminmax` for the largest magnitudes, one
    multiply writing the values' type for the decode; both equal to the CPU's way bit for bit."""
    from adaptmem.strategies.compress import _largest_magnitude

    torch.manual_seed(0)
    groups = (torch.randn(500, 64) * 5).to(dtype)
    groups[3], groups[4], groups[5] = 0.0, -2.0, groups[5].abs()
    assert torch.equal(_largest_magnitude(groups), groups.abs().amax(dim=1, keepdim=True))
    codes, scales = int8_codes(groups, 64)
    fused = torch.mul(codes, scales, out=torch.empty(codes.shape, dtype=dtype))
    assert torch.equal(fused, (codes.float() * scales).to(dtype))


def test_a_codec_that_cannot_compile_runs_eager_with_one_warning(monkeypatch, caplog):
    from adaptmem.strategies import compress

    def no_compiler(fn, **options):
        def failing(*args):
            raise RuntimeError("no C++ compiler found")

        return failing

    monkeypatch.setattr(compress, "_COMPILED", {})
    monkeypatch.setattr(compress._Guarded, "warned", False)
    monkeypatch.setattr(torch, "compile", no_compiler)
    torch.manual_seed(0)
    t = torch.randn(40, 64)
    first = encode(t, CompressOptions(min_bytes=0, compile="on"))
    second = encode(t, CompressOptions(min_bytes=0, compile="on"))
    codes, _ = int8_codes(t, 64)
    assert torch.equal(first.codes, codes) and torch.equal(second.codes, codes)
    assert torch.equal(restore(first), restore(encode(t, CompressOptions(min_bytes=0, compile="off"))))
    warned = [r for r in caplog.records if "could not compile its codec" in r.getMessage()]
    assert len(warned) == 1 and "no C++ compiler found" in warned[0].getMessage()


@pytest.mark.slow
def test_the_compiled_codec_gives_the_eager_codes_on_the_cpu():
    torch.manual_seed(0)
    for shape in ((4, 100, 64), (3, 333, 65)):  # two shapes of one family: compiled once
        t = torch.randn(shape) * 2
        fused = encode(t, CompressOptions(min_bytes=0, compile="on"))
        plain = encode(t, CompressOptions(min_bytes=0, compile="off"))
        assert torch.equal(fused.codes, plain.codes) and torch.equal(fused.scales, plain.scales)
        assert torch.equal(restore(fused), restore(plain))


@pytest.mark.cuda
def test_the_codec_is_fused_on_cuda_within_one_step_of_the_eager_codes():
    """Triton's division can round the last bit otherwise than the eager kernel: a code may move by
    one step, within the codec's error bound, and the scales are the same."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from adaptmem.strategies import compress

    torch.manual_seed(0)
    t = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
    fused = encode(t, CompressOptions(min_bytes=0, compile="on"))
    plain = encode(t, CompressOptions(min_bytes=0, compile="off"))
    # the eager codec on CUDA: the scales are the largest magnitudes over 127 (CUDA divides by a
    # number as a multiply by its reciprocal, which can move the last bit), the codes the values
    # over those scales rounded half to even, the decode their product cast, each exactly
    groups = t.cpu().float().view(-1, 64)
    _, scales = int8_codes(t.cpu(), 64)
    assert torch.allclose(plain.scales.cpu(), scales, rtol=2**-23, atol=0)
    on_cuda = plain.scales.cpu()
    assert torch.equal(plain.codes.cpu(), (groups / on_cuda).round().to(torch.int8))
    assert torch.equal(restore(plain).cpu(), (plain.codes.cpu().float() * on_cuda).to(t.dtype).view(t.shape))
    assert torch.equal(fused.scales, plain.scales)
    moved = (fused.codes.int() - plain.codes.int()).abs()
    assert moved.max() <= 1 and moved.float().mean() < 0.01
    back, flat = restore(fused).float().reshape(-1), t.float().reshape(-1)
    bound = (fused.scales / 2).expand(-1, 64).reshape(-1)[: flat.numel()] * 1.01 + flat.abs() * 0.01
    assert ((back - flat).abs() <= bound).all()
    fp8 = encode(t, CompressOptions(min_bytes=0, codec="fp8", compile="on"))
    assert ((restore(fp8).float() - t.float()).norm() / t.float().norm()).item() < 0.05
    guarded = compress._COMPILED.get((compress._encode_groups, "cuda"))
    assert guarded is not None and not guarded.failed
