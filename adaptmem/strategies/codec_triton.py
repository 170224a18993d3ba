"""COMPRESS's int8 codec as two hand-written Triton kernels, one launch per tensor each way.

The codec compiled by `torch.compile` (`CompressOptions.compile = "on"`) fuses each way
into one kernel, but each call goes through the compiler's guards and wrappers: on an
H200 (batch 4 x 2048, TinyLlama's shape) the device was busy 194 ms of a 320 ms step,
waiting on the host. These kernels are launched directly. Encode reads the values in
memory order (the flat view `Layout.flatten` gives), one group of `group_size` per row of
a tile, and writes the codes and one fp32 scale per group; decode reads the codes and
writes the values' type, exactly `numel` of them. The scale is the group's largest
magnitude over 127 and the code the value over it rounded half to even, divided in IEEE
round-to-nearest, so the codes are the defined ones; the eager codec on CUDA divides its
scales by 127 as a multiply by the reciprocal, so a scale (and with it a code) can differ
from its by a last bit (and the GPU's division flushes subnormal values to zero: a value
below fp32's smallest normal codes to 0). int8 only, and a group size that is a power of
two: anything else runs the eager codec (`supports`).

Each kernel is launched through Triton's ``kernel[grid](...)`` once per specialization
(the device, the values' type, and for each pointer and integer what Triton compiles a
variant for: 16-byte alignment, a multiple of 16, one, 32 bits), which compiles or finds
the kernel and returns it; later launches of that specialization call the compiled
kernel's launcher directly (`_Launch`), skipping Triton's per-call argument binding,
cache key and checks, host time paid per saved tensor each way. The first round trip
on a device (`compress._TritonCheck`) runs both ways and compares them; where the
direct launch fails, Triton's own launch runs from then on.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

_TINY = torch.finfo(torch.float32).tiny
_GROUPS_PER_PROGRAM = 16  # rows of the encode tile: 1,024 values at groups of 64
_DECODE_BLOCK = 2048  # values per decode program

AVAILABLE = importlib.util.find_spec("triton") is not None


def supports(t: torch.Tensor, codec: str, group_size: int) -> bool:
    """Whether these kernels can encode `t`: int8 on a CUDA tensor (or any tensor under
    Triton's interpreter, `TRITON_INTERPRET=1`), groups a power of two, Triton importable."""
    if not AVAILABLE or codec != "int8" or group_size & (group_size - 1):
        return False
    return on_gpu(t) or _interpreting()


def on_gpu(t: torch.Tensor) -> bool:
    """Whether `t` is where the kernels run compiled (a CUDA tensor)."""
    return t.is_cuda


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def encode(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (groups x `group_size`, int8, the last group's tail zero) and scales (groups x 1,
    fp32) of the contiguous 1-D `flat`."""
    numel = flat.numel()
    groups = -(-numel // group_size)
    codes = torch.empty((groups, group_size), dtype=torch.int8, device=flat.device)
    scales = torch.empty((groups, 1), dtype=torch.float32, device=flat.device)
    key = (flat.device.index, flat.dtype, group_size, flat.data_ptr() % 16, _kind(numel), _kind(groups))
    grid = -(-groups // _GROUPS_PER_PROGRAM)
    _ENCODE(key, grid, flat, codes, scales, numel, groups, _TINY, group_size, _GROUPS_PER_PROGRAM)
    return codes, scales


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The `numel` values of `codes` x `scales`, flat, in `dtype`."""
    group_size = codes.shape[-1]
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    key = (codes.device.index, dtype, group_size, codes.data_ptr() % 16, scales.data_ptr() % 16, _kind(numel))
    _DECODE(key, -(-numel // _DECODE_BLOCK), codes, scales, out, numel, group_size, _DECODE_BLOCK)
    return out


def _kind(n: int) -> tuple[bool, bool, bool, bool]:
    """What Triton specializes an integer argument on (one, a multiple of 16, 32 bits), and
    whether a tensor of `n` elements (8 bytes or fewer each) has its byte offsets in 32 bits."""
    return n == 1, n % 16 == 0, n < 2**31, n < 2**28


class _Launch:
    """One kernel's launches. The first of each key goes through Triton's ``kernel[grid](...)``
    (constexprs by name), which compiles or finds the kernel and returns it; later ones run that
    compiled kernel's launcher with the same arguments in order (`direct`). A key holds the device
    and everything Triton specializes a variant on for these arguments (newly allocated tensors
    are aligned), so a launch never runs a variant compiled for other arguments."""

    direct = True  # False where a direct launch failed its first check (`compress._TritonCheck`)

    def __init__(self, name: str, constexprs: tuple[str, ...]) -> None:
        self.name = name
        self.constexprs = constexprs
        self.compiled: dict[tuple, object] = {}

    def __call__(self, key: tuple, grid: int, *args: object) -> None:
        compiled = self.compiled.get(key) if _Launch.direct else None
        if compiled is not None:
            compiled[(grid, 1, 1)](*args, stream=_raw_stream(key[0]))
            return
        kernel = getattr(_kernels(), self.name)
        given = len(args) - len(self.constexprs)
        made = kernel[(grid,)](*args[:given], **dict(zip(self.constexprs, args[given:])))
        if launches_directly() and callable(getattr(made, "__getitem__", None)):
            self.compiled[key] = made


_ENCODE = _Launch("encode_kernel", ("GROUP", "ROWS"))
_DECODE = _Launch("decode_kernel", ("GROUP", "BLOCK"))


def launches_directly() -> bool:
    """Whether kernels launched before run by their compiled launchers from now on (not under the
    interpreter, and not once a direct launch has failed)."""
    return _Launch.direct and not _interpreting()


def holds_launchers() -> bool:
    """Whether a launch so far left a compiled kernel to launch directly."""
    return bool(_ENCODE.compiled or _DECODE.compiled)


def launch_through_triton() -> None:
    """Every launch from now on through Triton's ``kernel[grid](...)``."""
    _Launch.direct = False
    _ENCODE.compiled.clear()
    _DECODE.compiled.clear()


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


#: the current CUDA stream of a device, as a launcher takes it (PyTorch's compiled code reads it so)
_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream)


def _kernels():
    """The kernels' module, imported on first use so that importing adaptmem never imports Triton."""
    from adaptmem.strategies import codec_kernels

    return codec_kernels
