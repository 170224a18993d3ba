"""COMPRESS: saved floating tensors are quantized in forward, restored in backward.

Codecs (chosen per block handle):
  int8  per-group absmax: each run of `group_size` values keeps one fp32 scale;
        about 1.06 bytes per value with groups of 64 (fp32: 4 bytes).
  fp8   e4m3 with the same per-group scales, mapped onto fp8's ±448 range.
  bf16  a plain cast; only for fp32 tensors (smaller types pass through).

Boolean tensors (dropout masks) are bit-packed, 8 values to a byte, which is
lossless. Tensors below `min_bytes`, integer tensors, parameters and buffers
pass through untouched.

Each way, int8 and fp8 can be one fused kernel per tensor (`CompressOptions.compile`
"on"; "off", the default, runs eager ops): the scales, the division and the cast
in one pass over the values, built by `torch.compile` on first use. Where no
compiler works, the first failure is logged once and the eager ops run. The
scale is the group's largest magnitude over the code's range, the code the value
over it rounded half to even: on the CPU the fused kernel gives the eager codes
bit for bit; on CUDA a code can differ by one step where the kernel's division
rounds the last bit otherwise, within the same error bound. Measured on an H100
(TinyLlama's shape, bf16, 2048 tokens), the fused codec ran COMPRESS at 2.54x
NONE's step at batch 4 and 4.54x at batch 1, where a compiled function's call
costs more than the eager ops it replaces: hence off by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adaptmem.strategies import codec_triton
from adaptmem.strategies.payloads import Decoded, Layout, Payload, nbytes_of, place, restore

CODECS = ("int8", "fp8", "bf16")
COMPILE = ("auto", "on", "off", "triton")
_FP8_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny

log = logging.getLogger("adaptmem")


@dataclass(frozen=True)
class CompressOptions:
    """How a block compresses.

    codec: "int8" (default), "fp8" (e4m3) or "bf16".
    group_size: values sharing one scale for int8 / fp8 (count, >= 8).
    min_bytes: floating tensors smaller than this pass through (bytes).
    pack_bool: bit-pack boolean tensors such as dropout masks (lossless).
    compile: "auto" (default): int8 on CUDA by two hand-written Triton kernels launched directly
        (`codec_triton`) where Triton runs, elsewhere eager ops; "triton": the same, with a
        warning where the kernels cannot run on CUDA; "on": fused kernels by torch.compile (on
        the CPU it needs a C++ compiler; the first call of each shape family compiles); "off":
        eager ops.
    """

    codec: str = "int8"
    group_size: int = 64
    min_bytes: int = 64 * 1024
    pack_bool: bool = True
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"CompressOptions.codec must be one of {CODECS}, got {self.codec!r}")
        if not isinstance(self.group_size, int) or self.group_size < 8:
            raise ValueError(f"CompressOptions.group_size must be an int >= 8, got {self.group_size!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"CompressOptions.min_bytes must be a non-negative int, got {self.min_bytes!r}")
        if self.compile not in COMPILE:
            raise ValueError(f"CompressOptions.compile must be one of {COMPILE}, got {self.compile!r}")


class Quantized(Decoded):
    """Codes plus per-group scales (int8, fp8) or a cast (bf16) of one tensor."""

    __slots__ = ("codec", "codes", "scales", "shape", "dtype", "numel", "compiled", "layout")

    def __init__(
        self,
        codec: str,
        codes: Any,
        scales: Any,
        shape: torch.Size,
        dtype: torch.dtype,
        numel: int,
        compiled: str = "off",
        layout: Layout | None = None,
    ) -> None:
        super().__init__()
        self.codec = codec
        self.codes = codes
        self.scales = scales
        self.shape = shape
        self.dtype = dtype
        self.numel = numel
        self.compiled = compiled  # CompressOptions.compile: how to decode it
        self.layout = layout  # the strides the tensor had (None: contiguous)

    def decode(self) -> torch.Tensor:
        # no grad mode set: nothing here needs a gradient (the context cost a fifth of the host time)
        codes = restore(self.codes)
        if self.codec == "bf16":
            return place(codes.to(self.dtype), self.shape, self.layout)
        if self.compiled == "triton":
            return place(
                codec_triton.decode(codes, restore(self.scales), self.dtype, self.numel), self.shape, self.layout
            )
        values = _kernel(_decode_groups, codes.device, self.compiled)(codes, restore(self.scales), self.dtype)
        return place(values.view(-1)[: self.numel], self.shape, self.layout)

    def nbytes(self) -> int:
        codes, scales = self.codes, self.scales
        if isinstance(codes, torch.Tensor) and (scales is None or isinstance(scales, torch.Tensor)):
            return nbytes_of(codes) + (nbytes_of(scales) if scales is not None else 0)  # no copy made to count
        return super().nbytes()

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Quantized:
        scales = fn(self.scales) if self.scales is not None else None  # bf16 has none
        return Quantized(
            self.codec, fn(self.codes), scales, self.shape, self.dtype, self.numel, self.compiled, self.layout
        )


class BitPacked(Decoded):
    """A boolean tensor, eight values to a byte."""

    __slots__ = ("bits", "shape", "numel", "layout")

    def __init__(self, bits: Any, shape: torch.Size, numel: int, layout: Layout | None = None) -> None:
        super().__init__()
        self.bits = bits
        self.shape = shape
        self.numel = numel
        self.layout = layout

    def decode(self) -> torch.Tensor:
        bits = restore(self.bits)
        with torch.no_grad():
            flags = bits.unsqueeze(1).bitwise_right_shift(_shifts(bits.device)).bitwise_and_(1)
            return place(flags.view(-1)[: self.numel].to(torch.bool), self.shape, self.layout)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> BitPacked:
        return BitPacked(fn(self.bits), self.shape, self.numel, self.layout)


def encode(t: torch.Tensor, options: CompressOptions) -> Payload | None:
    """A compressed payload for `t`, or None when `t` should pass through."""
    if nbytes_of(t) < options.min_bytes:
        return None
    if t.dtype == torch.bool:
        return pack_bits(t) if options.pack_bool else None
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    # on `t` detached, no grad mode is needed: the codec's ops record nothing (and the context
    # was a fifth of a pack and unpack's host time)
    if options.codec == "bf16":
        if t.dtype != torch.float32 and t.dtype != torch.float64:
            return None
        flat, layout = Layout.flatten(t.detach())
        return Quantized("bf16", flat.to(torch.bfloat16), None, t.shape, t.dtype, t.numel(), layout=layout)
    return _quantize(t.detach(), options.codec, options.group_size, options.compile)


def _quantize(t: torch.Tensor, codec: str, group_size: int, compiled: str = "off") -> Quantized:
    """Groups run over the values in memory order, so the tensor comes back with its strides."""
    flat, layout = Layout.flatten(t)
    numel = flat.numel()
    if compiled in ("triton", "auto"):
        if _triton_runs(t, codec, group_size, asked=compiled == "triton"):
            codes, scales = codec_triton.encode(flat, group_size)
            return Quantized(codec, codes, scales, t.shape, t.dtype, numel, "triton", layout)
        compiled = "off"
    pad = (-numel) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    groups = flat.view(-1, group_size)
    codes, scales = _kernel(_encode_groups, t.device, compiled)(groups, codec == "int8")
    return Quantized(codec, codes, scales, t.shape, t.dtype, numel, compiled, layout)


def _encode_groups(groups: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `groups`: its scale (largest magnitude over the code's range) and its codes.
    |value / scale| is at most the range by construction, so int8 needs no clamp. On CUDA the
    largest magnitude comes from one reduction over the values in their own type (a maximum
    is exact in any type) and the division reads them as they are, casting in the kernel:
    four passes over the values in all. On the CPU, where a reduction over half-precision
    values is slow, they are cast to fp32 first."""
    if groups.is_cuda:
        largest = _largest_magnitude(groups)
    else:
        groups = groups.to(torch.float32)
        largest = groups.abs().amax(dim=1, keepdim=True)
    scales = largest.to(torch.float32).div_(127.0 if int8 else _FP8_MAX).clamp_min_(_TINY)
    scaled = torch.div(groups, scales)
    if int8:
        return scaled.round_().to(torch.int8), scales
    return scaled.clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scales


def _largest_magnitude(groups: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude, from one reduction that reads the values once."""
    low, high = torch.aminmax(groups, dim=1, keepdim=True)
    return torch.maximum(low.neg_(), high)


def _decode_groups(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales in fp32, cast to `dtype`: on CUDA one kernel, writing `dtype` (fp8 codes,
    which take part in no type promotion, are cast to fp32 first)."""
    if not codes.is_cuda or codes.dtype != torch.int8:
        return (codes.to(torch.float32) * scales).to(dtype)
    return torch.mul(codes, scales, out=torch.empty(codes.shape, dtype=dtype, device=codes.device))


def _triton_runs(t: torch.Tensor, codec: str, group_size: int, asked: bool = True) -> bool:
    """Whether the Triton kernels encode `t`. "auto" takes them for int8 on CUDA where they run,
    and says nothing where they cannot; where "triton" was asked on CUDA and they cannot (no
    Triton, fp8, a group size not a power of two), one warning for the process says why. Either
    way the kernels are tried once on the device first (`_TritonCheck`)."""
    if torch.compiler.is_compiling():  # inside compiled code its compiler fuses the codec
        return False
    if (asked or codec_triton.on_gpu(t)) and codec_triton.supports(t, codec, group_size):
        return _TritonCheck.works(t.device, t.dtype, group_size)
    if asked and codec_triton.on_gpu(t) and not _TritonCheck.told:
        _TritonCheck.told = True
        why = (
            "Triton is not installed"
            if not codec_triton.AVAILABLE
            else f"its kernels take int8 in groups of a power of two (codec {codec!r}, groups of {group_size})"
        )
        log.warning('adaptmem: COMPRESS runs its codec as eager ops where compile = "triton" was asked: %s', why)
    return False


class _TritonCheck:
    """Triton's kernels run once on a small tensor of each device and type before any saved
    tensor of them is encoded by them (so the decode that backward needs has run too): Triton
    builds its launcher with the machine's C compiler and each kernel for the GPU on first use,
    and either can fail where PyTorch itself runs. Where the round trip fails or gives other
    values than its codes times its scales, the eager codec runs there from then on, with one
    warning for the process saying why."""

    told = False  # "triton" asked where the kernels cannot run
    failed = False  # a first run failed
    checked: dict[tuple[torch.device, torch.dtype, int], bool] = {}  # -> the kernels work there

    @classmethod
    def works(cls, device: torch.device, dtype: torch.dtype, group_size: int) -> bool:
        key = (device, dtype, group_size)
        if key not in cls.checked:
            cls.checked[key] = cls._round_trip(device, dtype, group_size)
        return cls.checked[key]

    @classmethod
    def _round_trip(cls, device: torch.device, dtype: torch.dtype, group_size: int) -> bool:
        try:
            with torch.no_grad():
                values = torch.linspace(-3.0, 5.0, 3 * group_size + 5, device=device).to(dtype)
                why = cls._wrong(values, group_size)
                if why is None:
                    cls._direct_launch(values, group_size)
                    return True
        except Exception as err:  # Triton's own error types: no compiler, no driver, an unsupported GPU
            why = _first_line(err)
        if not cls.failed:
            cls.failed = True
            log.warning("adaptmem: COMPRESS's Triton codec failed its first run (%s); it runs as eager ops", why)
        return False

    @staticmethod
    def _wrong(values: torch.Tensor, group_size: int) -> str | None:
        """What is wrong with a round trip of `values` through the kernels, or None."""
        codes, scales = codec_triton.encode(values, group_size)
        back = codec_triton.decode(codes, scales, values.dtype, values.numel())
        expected = (codes.float() * scales).view(-1)[: values.numel()].to(values.dtype)
        error = (back.float() - values.float()).abs().max()
        if torch.equal(back, expected) and error.item() <= scales.max().item():
            return None
        return "its round trip gave other values than its codes and scales hold"

    @staticmethod
    def _direct_launch(values: torch.Tensor, group_size: int) -> None:
        """The same round trip again, now through the launches `codec_triton` makes directly; where
        they fail, Triton's own launch runs every kernel from then on, with one warning."""
        if not codec_triton.holds_launchers():
            return
        try:
            why = _TritonCheck._wrong(values, group_size)
        except Exception as err:  # a launcher called otherwise than this Triton's takes
            why = _first_line(err)
        if why is not None:
            codec_triton.launch_through_triton()
            log.warning("adaptmem: COMPRESS's Triton codec failed a direct launch (%s); Triton launches it", why)


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


#: (function, device type) -> its compiled form, which runs the eager one once compiling has failed
_COMPILED: dict[tuple[Callable, str], _Guarded] = {}


def _kernel(fn: Callable, device: torch.device, compiled: str) -> Callable:
    """`fn` compiled into one kernel where `compiled` asks for it and a compiler works, else `fn`."""
    if compiled == "off":
        return fn
    if torch.compiler.is_compiling():  # inside a compiled block: its compiler fuses it already
        return fn
    key = (fn, device.type)
    if key not in _COMPILED:
        _COMPILED[key] = _Guarded(fn, torch.compile(fn, dynamic=True, fullgraph=True))
    return _COMPILED[key]


class _Guarded:
    """A compiled codec that falls back to the eager one, for good, at its first failure (no
    compiler on the machine, say), with one warning for the process."""

    warned = False

    def __init__(self, eager: Callable, compiled: Callable) -> None:
        self.eager, self.compiled, self.failed = eager, compiled, False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            try:
                with torch.no_grad():  # one grad mode for the compiler's guards, whichever way it runs
                    return self.compiled(*args)
            except Exception as err:  # a missing compiler surfaces as the compiler's own error type
                self.failed = True
                if _Guarded.warned:
                    return self.eager(*args)
                _Guarded.warned = True
                log.warning(
                    "adaptmem: COMPRESS could not compile its codec (%s: %s); it runs as eager ops "
                    'from now on (set the policy\'s compress_compile = "off" to skip trying)',
                    type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "",
                )
        return self.eager(*args)


def pack_bits(t: torch.Tensor) -> BitPacked:
    with torch.no_grad():
        flat, layout = Layout.flatten(t.detach())
        numel = flat.numel()
        pad = (-numel) % 8
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        bytes_ = flat.view(-1, 8).to(torch.uint8).bitwise_left_shift_(_shifts(t.device))
        bits = bytes_.sum(dim=1, dtype=torch.uint8)
    return BitPacked(bits, t.shape, numel, layout)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)
