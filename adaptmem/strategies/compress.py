"""COMPRESS: saved floating tensors are quantized in forward, restored in backward.

Codecs (chosen per block handle):
  int8  per-group absmax: each run of `group_size` values keeps one fp32 scale;
        about 1.06 bytes per value with groups of 64 (fp32: 4 bytes).
  fp8   e4m3 with the same per-group scales, mapped onto fp8's ±448 range.
  bf16  a plain cast; only for fp32 tensors (smaller types pass through).

Boolean tensors (dropout masks) are bit-packed, 8 values to a byte, which is
lossless. Tensors below `min_bytes`, integer tensors, parameters and buffers
pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adaptmem.strategies.payloads import Payload, nbytes_of, restore

CODECS = ("int8", "fp8", "bf16")
_FP8_MAX = 448.0


@dataclass(frozen=True)
class CompressOptions:
    """How a block compresses.

    codec: "int8" (default), "fp8" (e4m3) or "bf16".
    group_size: values sharing one scale for int8 / fp8 (count, >= 8).
    min_bytes: floating tensors smaller than this pass through (bytes).
    pack_bool: bit-pack boolean tensors such as dropout masks (lossless).
    """

    codec: str = "int8"
    group_size: int = 64
    min_bytes: int = 64 * 1024
    pack_bool: bool = True

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"CompressOptions.codec must be one of {CODECS}, got {self.codec!r}")
        if not isinstance(self.group_size, int) or self.group_size < 8:
            raise ValueError(f"CompressOptions.group_size must be an int >= 8, got {self.group_size!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"CompressOptions.min_bytes must be a non-negative int, got {self.min_bytes!r}")


class Quantized(Payload):
    """Codes plus per-group scales (int8, fp8) or a cast (bf16) of one tensor."""

    __slots__ = ("codec", "codes", "scales", "shape", "dtype", "numel")

    def __init__(self, codec: str, codes: Any, scales: Any, shape: torch.Size, dtype: torch.dtype, numel: int) -> None:
        self.codec = codec
        self.codes = codes
        self.scales = scales
        self.shape = shape
        self.dtype = dtype
        self.numel = numel

    def restore(self) -> torch.Tensor:
        codes = restore(self.codes)
        with torch.no_grad():
            if self.codec == "bf16":
                return codes.to(self.dtype).view(self.shape)
            values = codes.to(torch.float32).mul_(restore(self.scales))
            return values.view(-1)[: self.numel].view(self.shape).to(self.dtype)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Quantized:
        scales = fn(self.scales) if self.scales is not None else None  # bf16 has none
        return Quantized(self.codec, fn(self.codes), scales, self.shape, self.dtype, self.numel)


class BitPacked(Payload):
    """A boolean tensor, eight values to a byte."""

    __slots__ = ("bits", "shape", "numel")

    def __init__(self, bits: Any, shape: torch.Size, numel: int) -> None:
        self.bits = bits
        self.shape = shape
        self.numel = numel

    def restore(self) -> torch.Tensor:
        bits = restore(self.bits)
        with torch.no_grad():
            flags = bits.unsqueeze(1).bitwise_right_shift(_shifts(bits.device)).bitwise_and_(1)
            return flags.view(-1)[: self.numel].to(torch.bool).view(self.shape)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> BitPacked:
        return BitPacked(fn(self.bits), self.shape, self.numel)


def encode(t: torch.Tensor, options: CompressOptions) -> Payload | None:
    """A compressed payload for `t`, or None when `t` should pass through."""
    if nbytes_of(t) < options.min_bytes:
        return None
    if t.dtype == torch.bool:
        return pack_bits(t) if options.pack_bool else None
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    with torch.no_grad():
        if options.codec == "bf16":
            if t.dtype != torch.float32 and t.dtype != torch.float64:
                return None
            return Quantized("bf16", t.detach().to(torch.bfloat16), None, t.shape, t.dtype, t.numel())
        return _quantize(t.detach(), options.codec, options.group_size)


def _quantize(t: torch.Tensor, codec: str, group_size: int) -> Quantized:
    flat = t.reshape(-1)
    numel = flat.numel()
    pad = (-numel) % group_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    groups = flat.view(-1, group_size).to(torch.float32)
    top = 127.0 if codec == "int8" else _FP8_MAX
    scales = groups.abs().amax(dim=1, keepdim=True).div_(top).clamp_min_(torch.finfo(torch.float32).tiny)
    scaled = groups / scales
    if codec == "int8":
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return Quantized(codec, codes, scales, t.shape, t.dtype, numel)


def pack_bits(t: torch.Tensor) -> BitPacked:
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        numel = flat.numel()
        pad = (-numel) % 8
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        bytes_ = flat.view(-1, 8).to(torch.uint8).bitwise_left_shift_(_shifts(t.device))
        bits = bytes_.sum(dim=1, dtype=torch.uint8)
    return BitPacked(bits, t.shape, numel)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)
