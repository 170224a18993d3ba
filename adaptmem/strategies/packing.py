"""The pack and unpack hooks shared by OFFLOAD and COMPRESS (and CHECKPOINT|OFFLOAD's block input).

PyTorch applies only the innermost `saved_tensors_hooks` pair, so a combined
mode is one pack function (`Packer`), never nested contexts. Parameters and
buffers that autograd saves pass through untouched.

The time spent in both hooks (encoding, copies, waits for the link, decoding) is
what these modes do that NONE does not: it is added up per block call in the
call's `stats` ("pack_s", "unpack_s") for the cost model, on the clock the
stand-in's probe times steps with (`adaptmem.devices.tiers.link_clock`).

A tensor several ops save (a norm's input, read by its square and its scaling)
is packed once per block call: the later saves get the first one's payload, so
it is copied and compressed once, as NONE would keep it once. Saves match when
they read the same elements of the same live storage at the same version; the
storage is held weakly, so a tensor freed and another allocated at its address
never match.

An offloaded tensor goes as its storage, once for every view of it the block
saves. A view that is not its whole storage laid out contiguously (a chunk of a
fused projection, a transpose) comes back as a view of the copy, with its own
strides and offset (`payloads.Strided`): exactly what NONE keeps. Views of a
storage more than `_VIEW_STORAGE_LIMIT` times their size, with no copy of the
storage made yet, stay on the device (`payloads.Waiting`) until the block's
views of it add up to that share: then the storage goes, and the views kept
so far become views of its copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from adaptmem.devices.tiers import link_clock
from adaptmem.registrations import buffers_of
from adaptmem.strategies.compress import CompressOptions, encode
from adaptmem.strategies.offload import HostCopy, OffloadOptions
from adaptmem.strategies.offload_runtime import OffloadRuntime
from adaptmem.strategies.payloads import Decoded, Payload, Strided, Waiting, nbytes_of, restore


class Packer:
    """One block call's pack hook: pass state through, compress, offload, in that order.

    Args:
        module: the block; its buffers are state and never packed.
        compress: codec options, or None for no compression.
        offload: offload options, or None to keep payloads on the device.
        runtime: where offloaded bytes go (host tier or CUDA pinned pool).
        grad_only: pack only tensors that require grad, and those sharing storage
            with `main` (used for checkpoint inputs: the block's activations go,
            masks and rotary tables, shared by every block, stay put).
        main: the block's main input, packed under `grad_only` even when it needs
            no gradient (the first block after frozen embeddings).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        compress: CompressOptions | None = None,
        offload: OffloadOptions | None = None,
        runtime: OffloadRuntime | None = None,
        grad_only: bool = False,
        main: torch.Tensor | None = None,
        stats: dict | None = None,
    ) -> None:
        self._is_state = State(module)
        self._compress = compress
        self._offload = offload
        self._runtime = runtime
        self._group = runtime.new_group(offload) if offload is not None and runtime else None
        self._grad_only = grad_only
        self._main = _storage(main) if main is not None else None
        self._stats = stats if stats is not None else {}
        self._seen: dict[tuple, tuple[weakref.ref, Any]] = {}  # this call's saves: key -> (storage, payload)
        self._storages: dict[tuple, tuple[weakref.ref, HostCopy]] = {}  # storages sent for views of them
        self._waiting: dict[tuple, tuple[weakref.ref, list[Waiting]]] = {}  # small views kept, per storage
        for key in ("packed", "on_device", "host"):
            self._stats.setdefault(key, 0)
        for key in ("pack_s", "unpack_s"):
            self._stats.setdefault(key, 0.0)

    def __call__(self, t: torch.Tensor) -> Any:
        if self._is_state(t) or (self._grad_only and not t.requires_grad and _storage(t) != self._main):
            return t.detach()
        if torch.compiler.is_compiling():  # no clock or table inside a compiled graph
            return self._pack(t)
        storage = _storage_object(t)
        key = _key(t, storage)
        if key is not None and (seen := self._seen.get(key)) is not None and seen[0]() is storage:
            return _shared(seen[1])
        clock = link_clock()
        start = clock()
        try:
            packed = self._pack(t, storage)
        finally:
            self._stats["pack_s"] += clock() - start
        if key is not None:
            self._seen[key] = (weakref.ref(storage), packed)
        return packed

    @contextmanager
    def installed(self) -> Iterator[Packer]:
        """The pack and unpack hooks for the block call under way; the call's saves are
        forgotten as it ends (autograd holds the payloads from then on)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self, self.unpack):
                yield self
        finally:
            self._seen.clear()
            self._storages.clear()
            self._waiting.clear()

    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook: `payloads.restore`, timed."""
        if isinstance(packed, torch.Tensor) or torch.compiler.is_compiling():
            return restore(packed)
        clock = link_clock()
        start = clock()
        try:
            return restore(packed)
        finally:
            self._stats["unpack_s"] += clock() - start

    def _pack(self, t: torch.Tensor, storage: torch.UntypedStorage | None = None) -> Any:
        size = nbytes_of(t)
        self._stats["packed"] += size
        payload = None
        if self._compress is not None:
            payload = encode(t, self._compress)
        if self._offload is None or self._runtime is None:
            self._stats["on_device"] += payload.nbytes() if payload is not None else size
            return payload if payload is not None else t.detach()
        if payload is not None:
            self._stats["host"] += payload.nbytes()
            return payload.map_tensors(self._send)
        if size < self._offload.min_bytes:
            self._stats["on_device"] += size
            return t.detach()
        if torch.compiler.is_compiling() or storage is None:
            self._stats["host"] += size
            return self._send(t)
        return self._send_storage(t, size, storage)

    def _send_storage(self, t: torch.Tensor, size: int, storage: torch.UntypedStorage) -> Any:
        """`t` goes as its storage, once per storage and version, whichever of its views a
        block saves first. A tensor that is its storage comes back from the copy as it is;
        any other view comes back as a view of the copy, with its own strides and offset."""
        whole, item, is_whole = storage.nbytes(), t.element_size(), _whole(t, storage)
        key = (storage.data_ptr(), t._version, t.dtype)
        seen = self._storages.get(key)
        if seen is not None and seen[0]() is storage:
            seen[1].share()
            return Strided(seen[1], t.shape, t.stride(), t.storage_offset())
        if whole % item:
            self._stats["on_device"] += size
            return t.detach()
        if is_whole:
            copy = self._send(t)
        else:
            waiting = self._waiting.get(key)
            views = waiting[1] if waiting is not None and waiting[0]() is storage else []
            if whole > _VIEW_STORAGE_LIMIT * (size + sum(v.nbytes for v in views)):
                view = Waiting(t.detach(), size)  # a small part of a large storage: kept for now
                self._waiting[key] = (weakref.ref(storage), [*views, view])
                self._stats["on_device"] += size
                return view
            with torch.no_grad():
                flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (whole // item,), (1,))
            copy = self._send(flat)
            for view in views:  # the views kept so far go with it, and let go of the device
                view.send(copy)
                self._stats["on_device"] -= view.nbytes
            self._waiting.pop(key, None)
        self._stats["host"] += whole
        self._storages[key] = (weakref.ref(storage), copy)
        return copy if is_whole else Strided(copy, t.shape, t.stride(), t.storage_offset())

    def _send(self, t: torch.Tensor) -> Any:
        return self._runtime.offload(t, self._group, self._offload)


class State:
    """Tells a block's state among what it saves: parameters (or views of them, like
    ``weight.t()``, and their autocast copies) and the block's buffers, never packed."""

    __slots__ = ("_module", "_buffers")

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._buffers: set[int] | None = None

    def __call__(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or _is_cast_of_leaf(base):
            return True
        if self._buffers is None:
            self._buffers = {b.untyped_storage().data_ptr() for b in buffers_of(self._module)}
        return bool(self._buffers) and t.untyped_storage().data_ptr() in self._buffers


class Residue:
    """What OFFLOAD would leave on the device of what a block saves (`Packer._pack`): the tensors
    under its `min_bytes`, each saved tensor once, the block's state aside. A checkpoint's forward
    counts it in a step measured block by block (`BlockCall.measured`), so that OFFLOAD is planned
    with it before it has run: a recurrent layer's slow path saves a few small tensors a time
    step, and an RWKV block under OFFLOAD kept 3.3 of its 9.3 MiB on the device at 2 x 512
    tokens, where a fixed share of 2% had been assumed (a step planned with two such blocks at
    20.4 MiB peaked at 23.4)."""

    __slots__ = ("bytes", "_min", "_seen", "_is_state")

    def __init__(self, module: nn.Module, min_bytes: int) -> None:
        self.bytes = 0
        self._min = min_bytes
        self._seen: dict[tuple, weakref.ref] = {}
        self._is_state = State(module)

    def __call__(self, t: torch.Tensor) -> None:
        size = nbytes_of(t)
        if size >= self._min or self._is_state(t):
            return
        storage = _storage_object(t)
        key = _key(t, storage)
        if key is not None:
            # a checkpoint keeps none of what it saves: a tensor freed since may have left its
            # address to another, which is no second save of it
            seen = self._seen.get(key)
            if seen is not None and seen() is storage:
                return
            self._seen[key] = weakref.ref(storage)
        self.bytes += size


_VIEW_STORAGE_LIMIT = 4  # views of a storage more than this many times their bytes stay on the device


def _whole(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    """`t` is its storage, laid out contiguously from the start: a copy of it comes back the same."""
    return t.is_contiguous() and t.storage_offset() == 0 and nbytes_of(t) == storage.nbytes()


def _key(t: torch.Tensor, storage: torch.UntypedStorage | None) -> tuple | None:
    """What makes two saves the same tensor: storage, elements, dtype, version. None for
    tensors without a storage (wrapper subclasses), which are never matched."""
    if storage is None:
        return None
    try:
        return storage.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version
    except RuntimeError:  # no version counter (an inference tensor)
        return None


def _shared(packed: Any) -> Any:
    """A payload (or a part of one) handed to one more save: its host copies keep the tensor
    they bring back until every save has read it, so it comes back over the link once; a
    codec's payload keeps its decoded tensor so, and its codes come back once."""
    if isinstance(packed, HostCopy | Decoded):  # a decoded payload is read from the device once
        packed.share()
    elif isinstance(packed, Waiting) and isinstance(packed.part, torch.Tensor):
        packed.holders += 1  # its storage is not sent yet: the copy is shared when it is
    elif isinstance(packed, Payload):
        packed.map_tensors(_shared)
    return packed


def _storage_object(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
        return None


def _storage(t: torch.Tensor) -> int | None:
    storage = _storage_object(t)
    return storage.data_ptr() if storage is not None else None


def _is_cast_of_leaf(t: torch.Tensor) -> bool:
    """An autocast copy of a trainable parameter (``ToCopyBackward0`` straight onto its AccumulateGrad).

    Autocast saves the fp16/bf16 cast of a weight, not a view of it; offloading
    it would ship every weight over the bus each step, compressing it would
    quantize weights. Casts of frozen weights carry no grad_fn and cannot be
    told from activations here.
    """
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nexts = fn.next_functions
    return len(nexts) == 1 and nexts[0][0] is not None and type(nexts[0][0]).__name__ == "AccumulateGrad"
