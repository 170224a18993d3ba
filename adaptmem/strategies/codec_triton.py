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
"""

from __future__ import annotations

import importlib.util
import os

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
    kernels = _kernels()
    numel = flat.numel()
    groups = -(-numel // group_size)
    codes = torch.empty((groups, group_size), dtype=torch.int8, device=flat.device)
    scales = torch.empty((groups, 1), dtype=torch.float32, device=flat.device)
    grid = (-(-groups // _GROUPS_PER_PROGRAM),)
    kernels.encode_kernel[grid](flat, codes, scales, numel, groups, _TINY, GROUP=group_size, ROWS=_GROUPS_PER_PROGRAM)
    return codes, scales


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The `numel` values of `codes` x `scales`, flat, in `dtype`."""
    kernels = _kernels()
    group_size = codes.shape[-1]
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    grid = (-(-numel // _DECODE_BLOCK),)
    kernels.decode_kernel[grid](codes, scales, out, numel, GROUP=group_size, BLOCK=_DECODE_BLOCK)
    return out


def _kernels():
    """The kernels' module, imported on first use so that importing adaptmem never imports Triton."""
    from adaptmem.strategies import codec_kernels

    return codec_kernels
