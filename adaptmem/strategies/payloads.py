"""Payloads: saved tensors in another form, each able to restore itself.

Every value a pack hook returns is a tensor or a `Payload`; `restore` (the
unpack hook) never reads the handle's current mode, so a mode flip between
forward and backward is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptmem.pytree import tensors_in


class Payload:
    """A saved tensor in some other form; `restore()` gives the tensor back."""

    __slots__ = ()

    def restore(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Payload:
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

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Strided:
        return Strided(fn(self.base), self.shape, self.stride, self.offset)


class Waiting(Payload):
    """A view of a storage many times its size, kept on the device while the block's views of
    that storage are too small a part of it to be worth its copy. Once they are not, the
    storage goes, and every view kept so far becomes a view of the copy (`send`): a loop that
    saves one slice of a large tensor per step sends it once rather than keeping it all."""

    __slots__ = ("part", "nbytes", "holders")

    def __init__(self, part: Any, nbytes: int) -> None:
        self.part = part  # the device view, or (sent) a `Strided` on the storage's copy
        self.nbytes = nbytes
        self.holders = 1  # saves that hold it (a view several ops saved is packed once)

    def send(self, copy: Any) -> None:
        """The storage went to `copy` (a `HostCopy`): the view becomes a view of it, and each
        save holding it holds the copy."""
        for _ in range(self.holders):
            copy.share()
        t = self.part
        self.part = Strided(copy, t.shape, t.stride(), t.storage_offset())

    def restore(self) -> torch.Tensor:
        return restore(self.part)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> Waiting:
        part = fn(self.part) if isinstance(self.part, torch.Tensor) else self.part.map_tensors(fn)
        return Waiting(part, self.nbytes)


class Decoded(Payload):
    """A payload rebuilt by work on the device (a codec's decode). Several ops can save one
    tensor (a norm's input, read by its square and its scaling): the block packs it once and
    each save holds the same payload (`share`). The first save to read it decodes it and the
    tensor is kept for the saves yet to read it, so it is decoded once, as NONE keeps it once;
    the last of them lets it go (a second backward through a kept graph decodes it again)."""

    __slots__ = ("users", "back", "left")

    def __init__(self) -> None:
        self.users = 1  # saves that hold this payload
        self.back: torch.Tensor | None = None  # decoded, kept for the saves yet to read it
        self.left = 0

    def share(self) -> None:
        """One more save holds this payload."""
        self.users += 1

    def restore(self) -> torch.Tensor:
        back = self.back
        if back is not None:
            self.left -= 1
            if self.left <= 0:
                self.back = None
            return back
        back = self.decode()
        if self.users > 1:
            self.back, self.left = back, self.users - 1
        return back

    def decode(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def restore(packed: Any) -> torch.Tensor:
    """The unpack hook: payloads restore themselves, tensors pass through."""
    return packed.restore() if isinstance(packed, Payload) else packed


class Layout:
    """Where a tensor's values lie in memory, for a payload that stores them as one flat run
    (a codec's codes): `flatten` reads them out, `place` lays restored values out again with
    the strides the tensor had. Compiled backward code checks the strides of what it saved,
    and a kernel looping over other strides can round differently."""

    __slots__ = ("stride", "dense")

    def __init__(self, stride: tuple[int, ...], dense: bool) -> None:
        self.stride = stride
        self.dense = dense  # the values filled one gapless run of storage, in memory order

    @staticmethod
    def flatten(t: torch.Tensor) -> tuple[torch.Tensor, Layout | None]:
        """`t`'s values as one flat tensor, and their layout (None: contiguous). A tensor whose
        values fill a run of its storage without gaps or overlaps (a permuted or transposed
        view) is read in memory order, as a view; one with gaps (a slice) is copied in index
        order; one whose elements overlap (an expanded tensor) comes back contiguous."""
        if t.is_contiguous():
            return t.reshape(-1), None
        spread = _spread(t)
        if spread == "dense":
            return t.as_strided((t.numel(),), (1,), t.storage_offset()), Layout(tuple(t.stride()), True)
        return t.reshape(-1), Layout(tuple(t.stride()), False) if spread == "apart" else None

    def place(self, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The values `flatten` read, with `shape` and the strides they had."""
        if self.dense:
            return flat.as_strided(shape, self.stride)
        out = torch.empty_strided(shape, self.stride, dtype=flat.dtype, device=flat.device)
        return out.copy_(flat.view(shape))


def place(flat: torch.Tensor, shape: torch.Size, layout: Layout | None) -> torch.Tensor:
    """`Layout.place`, or a contiguous view where the values had no other layout."""
    return flat.view(shape) if layout is None else layout.place(flat, shape)


def _spread(t: torch.Tensor) -> str:
    """How `t`'s elements lie in its storage: "dense" (numel consecutive slots, each once),
    "apart" (each its own slot, with gaps) or "overlapping" (some slot shared, or beyond this
    check: dimensions interleaved)."""
    reach, dense = 0, True  # the furthest slot the dimensions so far reach, from the first
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride <= reach:
            return "overlapping"
        dense = dense and stride == reach + 1
        reach += (size - 1) * stride
    return "dense" if dense else "apart"


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def backward_entry(output: Any) -> torch.Tensor | None:
    """The first tensor of a block's output that requires grad: a hook on it runs as backward
    reaches the block. None when no output needs a gradient."""
    return next((t for t in tensors_in(output) if t.requires_grad), None)
