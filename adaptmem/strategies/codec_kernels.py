"""The Triton kernels of `codec_triton` (importing this module imports Triton)."""

import triton
import triton.language as tl

#: 1.5 x 2^23: a float32 |q| < 2^22 added to it keeps no fraction, the sum rounded to the nearest
#: integer, ties to even, as IEEE addition rounds; subtracting it gives q rounded so
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def encode_kernel(x_ptr, codes_ptr, scales_ptr, numel, groups, tiny, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """ROWS groups of GROUP values each: the scale (largest magnitude over 127, at least `tiny`)
    and the codes (value over scale, rounded half to even), divisions in round-to-nearest."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    largest = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(largest, tl.full([ROWS], 127.0, tl.float32)), tiny)
    codes = (tl.math.div_rn(x, scale[:, None]) + _ROUNDER) - _ROUNDER
    in_rows = rows < groups
    tl.store(codes_ptr + offsets, codes.to(tl.int8), mask=in_rows[:, None])
    tl.store(scales_ptr + rows, scale, mask=in_rows)


@triton.jit
def decode_kernel(codes_ptr, scales_ptr, out_ptr, numel, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK values: code x its group's scale in fp32, stored in the output's type (a narrower
    type rounded to nearest, ties to even, Triton's default as PyTorch's; Triton's interpreter
    truncates to bfloat16)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    codes = tl.load(codes_ptr + offsets, mask=inside, other=0).to(tl.float32)
    scales = tl.load(scales_ptr + offsets // GROUP, mask=inside, other=0.0)
    tl.store(out_ptr + offsets, (codes * scales).to(out_ptr.dtype.element_ty), mask=inside)
