"""Payloads: saved tensors in another form, each able to restore itself.

Every value a pack hook returns is a tensor or a `Payload`; `restore` (the
unpack hook) never reads the handle's current mode, so a mode flip between
forward and backward is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class Payload:
    """A saved tensor in some other form; `restore()` gives the tensor back."""

    __slots__ = ()

    def restore(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> "Payload":
        """The same payload with each tensor part replaced by ``fn(part)``."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor parts to map")

    def nbytes(self) -> int:
        """Bytes of the payload's tensor parts."""
        sizes: list[int] = []

        def count(part: torch.Tensor) -> torch.Tensor:
            sizes.append(nbytes_of(part))
            return part

        self.map_tensors(count)
        return sum(sizes)


class Strided(Payload):
    """A view into a saved storage: the storage goes as one flat payload (`base`, shared by
    every view of it a block saves), and the view comes back with the shape, strides and
    offset it had. A copy of the view alone would come back contiguous, and kernels that
    loop over other strides can round differently in the last bit."""

    __slots__ = ("base", "shape", "stride", "offset")

    def __init__(self, base: Any, shape: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.base = base
        self.shape = shape
        self.stride = stride
        self.offset = offset

    def restore(self) -> torch.Tensor:
        return restore(self.base).as_strided(self.shape, self.stride, self.offset)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> "Strided":
        return Strided(fn(self.base), self.shape, self.stride, self.offset)


def restore(packed: Any) -> torch.Tensor:
    """The unpack hook: payloads restore themselves, tensors pass through."""
    return packed.restore() if isinstance(packed, Payload) else packed


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def backward_entry(output: Any) -> torch.Tensor | None:
    """The first tensor of a block's output that requires grad: a hook on it runs as backward
    reaches the block. None when no output needs a gradient."""
    leaves, _ = tree_flatten(output)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad), None)
