"""COMPRESS's Triton codec: the defined codes and scales, the decode, strides kept, and where it
does not run. On the CPU the kernels run under Triton's interpreter, where Triton is installed
(`pip install triton`): Triton reads `TRITON_INTERPRET=1` as it is imported, so those tests run
in a process started with it (`test_the_interpreted_kernels`); on a GPU under the `cuda` marker."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import int8_codes

from adaptmem import CompressOptions
from adaptmem.config.policy import Policy
from adaptmem.strategies import codec_triton
from adaptmem.strategies.compress import Quantized, _TritonCheck, encode
from adaptmem.strategies.payloads import restore


def values(n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    torch.manual_seed(n)
    t = torch.randn(n) * 3
    if n >= 256:
        t[64:128] = 0.0  # a group of zeros: the tiny scale
        t[128:192] = torch.arange(64) - 31.5  # halves: ties rounded to even
        t[200] = 1e4  # one large value in a group
    return t.to(dtype=dtype, device=device)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in a process started with TRITON_INTERPRET=1")


@pytest.mark.skipif(not codec_triton.AVAILABLE or INTERPRETED, reason="needs Triton (pip install triton)")
def test_the_interpreted_kernels():
    """The tests marked `interpreted`, in a process where Triton runs kernels on the CPU."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_interpreted_"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [5, 1000, 64 * 33, 64 * 16 * 3 + 7])
def test_interpreted_kernels_give_the_defined_codes_and_decode_them(n, dtype):
    t = values(n, dtype)
    codes, scales = codec_triton.encode(t, 64)
    expected_codes, expected_scales = int8_codes(t)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    back = codec_triton.decode(codes, scales, dtype, n)
    product = (codes.float() * scales).view(-1)[:n]
    if dtype == torch.bfloat16:  # the interpreter truncates to bfloat16; a GPU rounds (the cuda test)
        product = (product.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert back.shape == (n,) and torch.equal(back, product.to(dtype))


@interpreted
def test_interpreted_compress_keeps_a_views_strides_and_its_payload_says_so():
    t = values(64 * 40, torch.float32).view(40, 64).t()
    payload = encode(t, CompressOptions(min_bytes=0, compile="triton"))
    assert isinstance(payload, Quantized) and payload.compiled == "triton"
    codes, scales = int8_codes(t.t())  # the transposed view's memory order is its base's
    assert torch.equal(payload.codes, codes) and torch.equal(payload.scales, scales)
    back = restore(payload)
    assert back.stride() == t.stride() and torch.equal(back, (codes.float() * scales).view(40, 64).t())


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernels on CPU tensors")
def test_where_the_kernels_do_not_run_the_eager_codec_does(caplog):
    """On a CPU tensor (no interpreter), for fp8, or groups not a power of two: eager codes, no
    warning (it is for CUDA tensors, where "triton" was asked of a device it could serve)."""
    t = values(1000, torch.float32)
    for options in (
        CompressOptions(min_bytes=0, compile="triton"),
        CompressOptions(min_bytes=0, compile="triton", group_size=48),
    ):
        payload = encode(t, options)
        assert payload.compiled == "off"
        assert torch.equal(payload.codes, int8_codes(t, options.group_size)[0])
    assert encode(t, CompressOptions(min_bytes=0, codec="fp8", compile="triton")).compiled == "off"
    assert not [r for r in caplog.records if "triton" in r.getMessage()]


@pytest.mark.skipif(not codec_triton.AVAILABLE or INTERPRETED, reason="needs Triton (pip install triton)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_a_gpu_with_ieee_division_and_the_rounding_kept(dtype):
    """Compiled here for an H100's target (no GPU needed): the divisions round to nearest, and the
    rounding's add and subtract of 1.5 x 2^23 survive the compiler (folded, no code would round)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from adaptmem.strategies import codec_kernels

    target = GPUTarget("cuda", 90, 32)
    encode_args = {"x_ptr": f"*{dtype}", "codes_ptr": "*i8", "scales_ptr": "*fp32", "numel": "i64", "groups": "i64"}
    encode = ASTSource(
        fn=codec_kernels.encode_kernel,
        signature={**encode_args, "tiny": "fp32", "GROUP": "constexpr", "ROWS": "constexpr"},
        constexprs={"GROUP": 64, "ROWS": 16},
    )
    ptx = triton.compile(encode, target=target).asm["ptx"]
    assert re.search(r"div\.rn(\.ftz)?\.f32", ptx) and not re.search(r"div\.(full|approx)", ptx)
    assert "0f4B400000" in ptx and "0fCB400000" in ptx
    decode = ASTSource(
        fn=codec_kernels.decode_kernel,
        signature={"codes_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": f"*{dtype}", "numel": "i64"}
        | {"GROUP": "constexpr", "BLOCK": "constexpr"},
        constexprs={"GROUP": 64, "BLOCK": 2048},
    )
    assert "ld.global" in triton.compile(decode, target=target).asm["ptx"]


def test_the_policy_takes_triton_and_names_the_choices_otherwise():
    assert Policy(compress_compile="triton").compress_compile == "triton"
    assert Policy().compress_compile == "auto" and CompressOptions().compile == "auto"
    with pytest.raises(ValueError, match="compress_compile"):
        Policy(compress_compile="fast")
    with pytest.raises(ValueError, match="'auto', 'on', 'off', 'triton'"):
        CompressOptions(compile="fast")


def test_auto_runs_the_eager_codec_off_cuda_and_says_nothing(caplog):
    """The default: on a CPU tensor the eager codes, even where Triton's interpreter could run."""
    t = values(1000, torch.float32)
    payload = encode(t, CompressOptions(min_bytes=0))
    assert payload.compiled == "off" and torch.equal(payload.codes, int8_codes(t)[0])
    assert not [r for r in caplog.records if "riton" in r.getMessage()]


@pytest.fixture
def kernels_anywhere(monkeypatch):
    """Triton's kernels taken for CPU tensors, as on CUDA, with no first run checked yet."""
    monkeypatch.setattr(codec_triton, "supports", lambda t, codec, group_size: codec == "int8")
    monkeypatch.setattr(_TritonCheck, "checked", {})
    monkeypatch.setattr(_TritonCheck, "failed", False)
    monkeypatch.setattr(codec_triton, "on_gpu", lambda t: True)


@pytest.mark.parametrize("failure", ["raises", "wrong values"])
def test_kernels_that_fail_their_first_run_leave_the_eager_codec_with_one_warning(
    kernels_anywhere, monkeypatch, caplog, failure
):
    """A Triton that cannot build its launcher (no C compiler) or a kernel that gives wrong values:
    found on a small tensor before any saved tensor is encoded, once for the process."""
    calls = []

    def broken(flat, group_size):
        calls.append(flat.numel())
        if failure == "raises":
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
        groups = -(-flat.numel() // group_size)
        return torch.zeros(groups, group_size, dtype=torch.int8), torch.ones(groups, 1)

    monkeypatch.setattr(codec_triton, "encode", broken)
    monkeypatch.setattr(codec_triton, "decode", lambda codes, scales, dtype, n: torch.zeros(n, dtype=dtype))
    t = values(1000, torch.float32)
    with caplog.at_level("WARNING", logger="adaptmem"):
        payloads = [encode(t, CompressOptions(min_bytes=0, compile=how)) for how in ("auto", "triton", "auto")]
    assert [p.compiled for p in payloads] == ["off"] * 3
    assert all(torch.equal(p.codes, int8_codes(t)[0]) for p in payloads)
    assert calls == [3 * 64 + 5]  # the one check, on its own small tensor
    warned = [r.getMessage() for r in caplog.records if "failed its first run" in r.getMessage()]
    assert len(warned) == 1 and ("C compiler" in warned[0]) == (failure == "raises")


def test_kernels_that_pass_their_first_run_encode_every_tensor_after_it(kernels_anywhere, monkeypatch):
    calls = []

    def fine(flat, group_size):
        calls.append(flat.numel())
        return int8_codes(flat, group_size)

    monkeypatch.setattr(codec_triton, "encode", fine)
    monkeypatch.setattr(
        codec_triton, "decode", lambda codes, scales, dtype, n: (codes.float() * scales).view(-1)[:n].to(dtype)
    )
    t = values(1000, torch.float32)
    assert [encode(t, CompressOptions(min_bytes=0)).compiled for _ in range(2)] == ["triton"] * 2
    assert calls == [3 * 64 + 5, 1000, 1000]
    assert encode(t.to(torch.bfloat16), CompressOptions(min_bytes=0)).compiled == "triton"
    assert calls[3:] == [3 * 64 + 5, 1000]  # a new type is checked first: its decode is other code


def fake_encode_kernel(flat, codes, scales, numel, groups, tiny, GROUP, ROWS):
    c, s = int8_codes(flat, GROUP)
    codes.copy_(c)
    scales.copy_(s)


def fake_decode_kernel(codes, scales, out, numel, GROUP, BLOCK):
    out.copy_((codes.float() * scales).view(-1)[:numel].to(out.dtype))


class FakeJit:
    """A kernel as Triton's `kernel[grid](...)` runs it: it returns a compiled kernel whose
    `compiled[grid](*args, stream=...)` launches it again, or raises where `direct` says."""

    def __init__(self, fn, launches, direct="works"):
        self.fn, self.launches, self.direct = fn, launches, direct

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.launches.append(("triton", self.fn.__name__, grid, args[3], tuple(constexprs)))
            self.fn(*args, **constexprs)
            return FakeCompiled(self)

        return run


class FakeCompiled:
    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        def run(*args, stream):
            self.jit.launches.append(("direct", self.jit.fn.__name__, grid, args[3], stream))
            if self.jit.direct == "raises":
                raise TypeError("function takes exactly 14 arguments (19 given)")
            self.jit.fn(*args)
            if self.jit.direct == "zeros":
                args[2].zero_()

        return run


@pytest.fixture
def fake_triton(monkeypatch):
    """`codec_triton`'s launches on fake kernels that compute the defined codes on the CPU."""
    launches = []
    jits = types.SimpleNamespace(
        encode_kernel=FakeJit(fake_encode_kernel, launches), decode_kernel=FakeJit(fake_decode_kernel, launches)
    )
    monkeypatch.setattr(codec_triton, "_kernels", lambda: jits)
    monkeypatch.setattr(codec_triton, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(codec_triton, "_ENCODE", codec_triton._Launch("encode_kernel", ("GROUP", "ROWS")))
    monkeypatch.setattr(codec_triton, "_DECODE", codec_triton._Launch("decode_kernel", ("GROUP", "BLOCK")))
    monkeypatch.setattr(codec_triton._Launch, "direct", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return jits, launches


def test_a_kernel_is_launched_directly_after_its_first_launch_of_the_same_specialization(fake_triton):
    """Triton's launch once per specialization; then the compiled kernel's, with the constexprs
    in order and the device's stream. Another alignment, or a length not a multiple of 16, is
    another variant to Triton: its first launch goes through Triton again."""
    _, launches = fake_triton
    base = values(2048, torch.float32)
    for flat in (base[:1024], base[:1024], base[1:1025], base[:1000], base[1:1025]):
        codes, scales = codec_triton.encode(flat, 64)
        assert torch.equal(codes, int8_codes(flat)[0]) and torch.equal(scales, int8_codes(flat)[1])
    assert [(how, numel) for how, _, _, numel, _ in launches] == [
        ("triton", 1024),
        ("direct", 1024),
        ("triton", 1024),  # 4 bytes in: the same length, not aligned to 16 bytes
        ("triton", 1000),
        ("direct", 1024),
    ]
    assert launches[0][2:] == ((1,), 1024, ("GROUP", "ROWS")) and launches[1][2:] == ((1, 1, 1), 1024, 7)
    back = [codec_triton.decode(codes, scales, torch.bfloat16, 1000) for _ in range(2)]
    assert [how for how, *_ in launches[5:]] == ["triton", "direct"] and torch.equal(back[0], back[1])
    assert torch.equal(back[1], (codes.float() * scales).view(-1)[:1000].to(torch.bfloat16))


@pytest.mark.parametrize("kernel, direct", [("encode_kernel", "raises"), ("decode_kernel", "zeros")])
def test_a_direct_launch_that_fails_its_first_run_leaves_tritons_launch_with_one_warning(
    fake_triton, kernels_anywhere, caplog, kernel, direct
):
    """A launcher that takes its arguments otherwise than this code gives them, or one that gives
    other values: found by the first round trip's second run, before any saved tensor."""
    jits, launches = fake_triton
    getattr(jits, kernel).direct = direct
    t = values(1024, torch.float32)
    with caplog.at_level("WARNING", logger="adaptmem"):
        payloads = [encode(t, CompressOptions(min_bytes=0)) for _ in range(3)]
    assert [p.compiled for p in payloads] == ["triton"] * 3
    assert all(torch.equal(restore(p), (p.codes.float() * p.scales).view(-1)[:1024]) for p in payloads)
    warned = [r.getMessage() for r in caplog.records if "riton" in r.getMessage()]
    assert len(warned) == 1 and "failed a direct launch" in warned[0], warned
    assert not codec_triton.launches_directly() and not codec_triton.holds_launchers()
    # the round trip, again directly up to the launch that failed, then Triton's launches only
    checked = ["triton", "triton", "direct"] + (["direct"] if direct == "zeros" else [])
    hows = [how for how, *_ in launches]
    assert hows == checked + ["triton"] * (len(hows) - len(checked)) and len(hows) == len(checked) + 6


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_on_cuda_give_the_defined_codes_and_decode_exactly(dtype):
    if not torch.cuda.is_available() or not codec_triton.AVAILABLE:
        pytest.skip("needs a CUDA device and Triton")
    for n in (5, 64 * 33 + 7, 8 * 512 * 256):
        t = values(n, dtype, "cuda")
        expected_codes, expected_scales = int8_codes(t)
        for _ in range(2):  # Triton's launch, then the compiled kernel's launcher directly
            codes, scales = codec_triton.encode(t, 64)
            assert torch.equal(codes.cpu(), expected_codes) and torch.equal(scales.cpu(), expected_scales)
            back = codec_triton.decode(codes, scales, dtype, n)
            assert torch.equal(back.cpu(), (expected_codes.float() * expected_scales).view(-1)[:n].to(dtype))
    assert codec_triton.launches_directly() and codec_triton.holds_launchers()
    t = values(64 * 40 * 8, dtype, "cuda").view(8, 40, 64).permute(2, 0, 1)
    payload = encode(t, CompressOptions(min_bytes=0, compile="triton"))
    assert payload.compiled == "triton" and restore(payload).stride() == t.stride()
    assert encode(t, CompressOptions(min_bytes=0)).compiled == "triton"  # the default, "auto"


@pytest.mark.cuda
def test_the_codec_benchmark_runs_both_launches():
    if not torch.cuda.is_available() or not codec_triton.AVAILABLE:
        pytest.skip("needs a CUDA device and Triton")
    from stress.bench_codec import main

    assert main(["--sizes", "0.25", "--calls", "8", "--rounds", "2"]) == 0
    assert codec_triton.launches_directly()
