"""A CPU stand-in for a GPU: a capacity, exact byte counts, and real OOMs.

`SimulatedDevice` watches every tensor storage that is allocated while it is
active (through a `TorchDispatchMode`, the same way
`torch.distributed._tools.mem_tracker.MemTracker` does) and forgets it when the
storage is freed. A storage resized in place (`untyped_storage().resize_()`,
which no dispatch mode sees: FSDP2 frees a block's gathered parameters with
`resize_(0)` and grows them again for the next gather) is counted at its new
size, and a growth past the capacity raises as an allocation does. A wrapper
subclass (a DTensor) is counted by the tensors inside it. Copies made by the OFFLOAD strategy (inside
`adaptmem.devices.tiers.host_allocations()`) are host bytes, everything else device
bytes. An allocation that would take the device past its capacity raises a real
`torch.OutOfMemoryError`, so out-of-memory handling is tested on machines
without a GPU.

Peaks are read through windows: the user's `peak_bytes` / `reset_peak()` are
one window, and each probe (the manager's) opens its own with `open_window()`,
so the manager cutting a step at block boundaries never disturbs what the user
measures.

Interception costs time: never compare a step timed under a SimulatedDevice
with one timed without it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from adaptmem.config.units import format_bytes
from adaptmem.devices.link import SimulatedLink
from adaptmem.devices.probe import HostClock
from adaptmem.devices.tiers import allocating_on_host, using_link
from adaptmem.pytree import tensors_in

__all__ = ["PeakWindow", "SimulatedDevice", "SimulatedProbe"]

_DEVICE, _HOST = 0, 1


class _Entry:
    """What the stand-in knows of one live storage."""

    __slots__ = ("nbytes", "tier", "ref")

    def __init__(self, nbytes: int, tier: int) -> None:
        self.nbytes = nbytes
        self.tier = tier
        self.ref: weakref.ref | None = None


class PeakWindow:
    """A peak reading of its own over a `SimulatedDevice`: reset and read it without
    disturbing any other window (the user's, or another manager's)."""

    __slots__ = ("_device", "peaks", "__weakref__")

    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device
        self.peaks = list(device._bytes)  # device, host

    @property
    def peak_bytes(self) -> int:
        return self.peaks[_DEVICE]

    @property
    def host_peak_bytes(self) -> int:
        return self.peaks[_HOST]

    def reset(self) -> None:
        """Start a new window at the current allocation."""
        with self._device._lock:
            self.peaks = list(self._device._bytes)


class _Resizes:
    """`torch.UntypedStorage.resize_`, watched while any SimulatedDevice is active: each device
    that counts the storage (or, for one it does not, each active device, where it grows)
    checks a growth against its capacity first and counts the new size after."""

    lock = threading.Lock()
    devices: list[SimulatedDevice] = []  # entered and not yet left, with repeats for nesting
    original: Any = None

    @classmethod
    def enter(cls, device: SimulatedDevice) -> None:
        with cls.lock:
            if not cls.devices:
                cls.original = torch.UntypedStorage.resize_
                torch.UntypedStorage.resize_ = _resize
            cls.devices.append(device)

    @classmethod
    def leave(cls, device: SimulatedDevice) -> None:
        with cls.lock:
            cls.devices.remove(device)
            if not cls.devices:
                torch.UntypedStorage.resize_ = cls.original
                cls.original = None


def _resize(storage: Any, size: int) -> Any:
    devices = list(dict.fromkeys(_Resizes.devices))
    nbytes = int(size)
    for device in devices:
        device._check_resize(storage, nbytes)
    out = _Resizes.original(storage, size)
    for device in devices:
        device._resized(storage, nbytes)
    return out


class _CountingMode(TorchDispatchMode):
    def __init__(self, device: SimulatedDevice) -> None:
        super().__init__()
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._device._account(out, (args, kwargs) if _aliases(func) else None)
        return out


_ALIASING: dict[Any, bool] = {}


def _aliases(func: Any) -> bool:
    """Whether `func` may return one of its inputs' storages (a view, an in-place or `out=` op)."""
    found = _ALIASING.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = schema is None or any(r.alias_info is not None for r in schema.returns)
        _ALIASING[func] = found
    return found


def _storages_in(inputs: Any) -> set[int]:
    """The storages (their `_cdata`) of the tensors in `inputs`, inner ones included."""
    storages = (_storage_of(t) for t in _with_inner(tensors_in(inputs)))
    return {st._cdata for st in storages if st is not None}


class SimulatedDevice:
    """A CPU stand-in for a GPU with a capacity and real `torch.OutOfMemoryError`s.

    Use as a context manager around the work to measure::

        with SimulatedDevice(capacity_bytes=2 * 2**30) as dev:
            loss = model(x).sum(); loss.backward()
        dev.peak_bytes

    Args:
        capacity_bytes: device size in bytes; ``None`` means unlimited (count only).
        name: shown in error messages.
        host_capacity_bytes: host RAM the probes report for offloading (bytes);
            ``None`` reports the real machine's available RAM. Host copies past
            it are not refused: a probe reads it to keep offload under a ceiling.
        link_bytes_per_s: speed of the host link offloaded copies travel over
            (bytes/s, each way). ``None``: copies are instant. With a link a copy
            takes time as on PCIe: its device bytes stay counted until it has
            arrived, and backward waits for the copy back (see `devices.link`).
        link_latency_s: time added to every copy on the link (seconds).
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        name: str = "sim",
        host_capacity_bytes: int | None = None,
        link_bytes_per_s: float | None = None,
        link_latency_s: float = 0.0,
    ) -> None:
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise TypeError(f"capacity_bytes must be an int number of bytes or None, got {capacity_bytes!r}")
            if capacity_bytes <= 0:
                raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.link = SimulatedLink(link_bytes_per_s, link_latency_s) if link_bytes_per_s is not None else None
        self.name = name
        self.host_capacity_bytes = host_capacity_bytes
        # Re-entrant: a storage freed by a garbage collection that runs while the
        # lock is held calls `release` on the same thread.
        self._lock = threading.RLock()
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._bytes = [0, 0]  # device, host
        self._windows: tuple[PeakWindow, ...] = ()  # a tuple: cheap to walk at every allocation
        self._user = self.open_window()  # what peak_bytes / reset_peak() read
        self._external = 0
        self._modes: list[tuple[_CountingMode, Any]] = []  # (counting mode, link context) per entry
        self.num_ooms = 0

    # ------------------------------------------------------------ figures
    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def allocated_bytes(self) -> int:
        """Device bytes held by live storages allocated while active."""
        return self._bytes[_DEVICE]

    @property
    def peak_bytes(self) -> int:
        """Highest `allocated_bytes` since creation or the last `reset_peak()`."""
        return self._user.peaks[_DEVICE]

    @property
    def host_bytes(self) -> int:
        """Host bytes held by offloaded copies (live now)."""
        return self._bytes[_HOST]

    @property
    def host_peak_bytes(self) -> int:
        return self._user.peaks[_HOST]

    @property
    def external_bytes(self) -> int:
        """Bytes taken by 'other processes' (see `occupy`)."""
        return self._external

    @property
    def free_bytes(self) -> int | None:
        """Capacity less what tensors and other processes hold; None when unlimited."""
        if self._capacity is None:
            return None
        return self._capacity - self._bytes[_DEVICE] - self._external

    def reset_peak(self) -> None:
        """Start a new peak window at the current allocation (like torch.cuda.reset_peak_memory_stats)."""
        self._user.reset()

    def open_window(self) -> PeakWindow:
        """A peak window of its own, updated until `close_window(window)`."""
        with self._lock:
            window = PeakWindow(self)
            self._windows = (*self._windows, window)
            return window

    def close_window(self, window: PeakWindow) -> None:
        with self._lock:
            self._windows = tuple(w for w in self._windows if w is not window)

    # ------------------------------------------------------------ control
    def set_capacity(self, capacity_bytes: int | None) -> None:
        """Change the device size (a smaller card, or a partition taken away)."""
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes

    def occupy(self, nbytes: int) -> None:
        """Pretend another process took `nbytes` of the device (negative gives them back)."""
        with self._lock:
            if self._external + nbytes < 0:
                raise ValueError(f"cannot release {-nbytes} bytes: other processes hold only {self._external}")
            self._external += nbytes

    def track(self, *objs: Any) -> int:
        """Count storages that already exist (a model's weights, an optimizer's state) as device bytes.

        Accepts tensors, modules (parameters and buffers) and optimizers (their
        state). Returns the bytes added. Storages already counted are skipped.
        """
        tensors: list[torch.Tensor] = []
        for obj in objs:
            tensors.extend(_tensors_of(obj))
        return self._register(tensors, tier=_DEVICE, check=False)

    # ------------------------------------------------------------ context
    def __enter__(self) -> SimulatedDevice:
        mode = _CountingMode(self)
        mode.__enter__()
        link = using_link(self.link) if self.link is not None else contextlib.nullcontext()
        link.__enter__()
        self._modes.append((mode, link))
        _Resizes.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _Resizes.leave(self)
        mode, link = self._modes.pop()
        link.__exit__(*exc)
        mode.__exit__(*exc)

    @property
    def active(self) -> bool:
        return bool(self._modes)

    def __repr__(self) -> str:
        cap = "unlimited" if self._capacity is None else format_bytes(self._capacity)
        return (
            f"SimulatedDevice(name={self.name!r}, capacity={cap}, "
            f"allocated={format_bytes(self.allocated_bytes)}, peak={format_bytes(self.peak_bytes)}, "
            f"host={format_bytes(self.host_bytes)})"
        )

    # ------------------------------------------------------------ internals
    def _account(self, out: Any, inputs: Any = None) -> None:
        """Count what an op returned. Where it may return an input's storage (`inputs`, its
        arguments: a view, an in-place op), such a storage is no allocation: one the stand-in does
        not count (made before it was active, as a model's weights are) stays uncounted, where
        counting it at its first view would charge a step for weights a GPU holds before it starts."""
        if self.link is not None:
            self.link.poll()  # copies that have reached the host free their device bytes
        tensors = _with_inner(tensors_in(out))
        if tensors:
            tier = _HOST if allocating_on_host() else _DEVICE
            self._register(tensors, tier=tier, check=True, existing=inputs)

    def _register(self, tensors: Iterable[torch.Tensor], *, tier: int, check: bool, existing: Any = None) -> int:
        """Count the storages of `tensors` not counted yet, leaving out those of `existing` (an op's
        arguments), read only where an output's storage is not counted (most are)."""
        fresh: dict[int, tuple[Any, int]] = {}
        inputs: set[int] | None = None
        with self._lock:
            for t in tensors:
                st = _storage_of(t)
                if st is None:
                    continue
                nbytes = st.nbytes()
                entry = self._live.get(st)
                if entry is not None:
                    self._recount(entry, nbytes)  # resized in place since it was counted
                    continue
                if existing is not None:
                    inputs = _storages_in(existing) if inputs is None else inputs
                    if st._cdata in inputs:
                        continue
                fresh.setdefault(id(st), (st, nbytes))
            added = sum(n for _, n in fresh.values())
            if check and tier == _DEVICE:
                self._refuse_past_capacity(added)
            for st, nbytes in fresh.values():
                self._count(st, nbytes, tier)
        return added

    def _count(self, storage: Any, nbytes: int, tier: int) -> None:
        """Count a storage not counted before, until it is freed."""
        entry = _Entry(nbytes, tier)
        entry.ref = weakref.ref(storage, self._make_release(entry))
        self._live[storage] = entry
        self._add(tier, nbytes)

    def _recount(self, entry: _Entry, nbytes: int) -> None:
        """A counted storage now holds `nbytes`."""
        if nbytes != entry.nbytes:
            delta, entry.nbytes = nbytes - entry.nbytes, nbytes
            self._add(entry.tier, delta)

    def _refuse_past_capacity(self, wanted: int) -> None:
        """Raise out-of-memory where `wanted` more device bytes would not fit."""
        if self._capacity is None:
            return
        free = self._capacity - self._bytes[_DEVICE] - self._external
        if wanted > free:
            self.num_ooms += 1
            raise torch.OutOfMemoryError(self._oom_message(wanted, free))

    def _check_resize(self, storage: Any, nbytes: int) -> None:
        """Before `storage` is resized to `nbytes`: a growth of device bytes past the capacity
        raises, as an allocation would."""
        with self._lock:
            entry = self._live.get(storage)
            tier = entry.tier if entry is not None else (_HOST if allocating_on_host() else _DEVICE)
            growth = nbytes - (entry.nbytes if entry is not None else 0)
            if growth > 0 and tier == _DEVICE:
                self._refuse_past_capacity(growth)

    def _resized(self, storage: Any, nbytes: int) -> None:
        """`storage` now holds `nbytes`: counted at that size (a storage not counted before, at
        its first growth)."""
        with self._lock:
            entry = self._live.get(storage)
            if entry is not None:
                self._recount(entry, nbytes)
            elif nbytes > 0:
                self._count(storage, nbytes, _HOST if allocating_on_host() else _DEVICE)

    def _add(self, tier: int, nbytes: int) -> None:
        self._bytes[tier] += nbytes
        now = self._bytes[tier]
        for window in self._windows:
            if now > window.peaks[tier]:
                window.peaks[tier] = now

    def _make_release(self, entry: _Entry):
        def release(_ref: weakref.ref) -> None:
            with self._lock:
                self._bytes[entry.tier] -= entry.nbytes

        return release

    def _oom_message(self, wanted: int, free: int) -> str:
        return (
            f"SimulatedDevice out of memory. Tried to allocate {format_bytes(wanted)}. "
            f"Simulated device {self.name!r} has a total capacity of {format_bytes(self._capacity or 0)} "
            f"of which {format_bytes(max(free, 0))} is free. "
            f"Of the allocated memory {format_bytes(self._bytes[_DEVICE])} is allocated by tensors "
            f"and {format_bytes(self._external)} by other processes. "
            "(Raised by adaptmem.testing.SimulatedDevice where a CUDA allocation would fail.)"
        )


def _storage_of(t: torch.Tensor):
    """The storage holding `t`'s values, or None where it holds none: a meta tensor, or a wrapper
    subclass (a DTensor), whose storage has a size but no data (its inner tensors hold the bytes)."""
    if t.device.type == "meta" or (type(t) is not torch.Tensor and hasattr(type(t), "__tensor_flatten__")):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # other wrapper subclasses without storage
        return None


def _with_inner(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` and, for each wrapper subclass among them (a DTensor, a quantized tensor), the
    tensors inside it, at any depth: a wrapper's own ops run inside the counting mode's handler,
    where the mode sees none of them, so what they allocate is found in what they return."""
    if all(type(t) is torch.Tensor for t in tensors):
        return tensors
    found: list[torch.Tensor] = []
    stack = list(reversed(tensors))
    while stack:
        t = stack.pop()
        found.append(t)
        if type(t) is not torch.Tensor and hasattr(type(t), "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            stack.extend(v for v in (getattr(t, name) for name in reversed(names)) if isinstance(v, torch.Tensor))
    return found


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return _with_inner([obj])
    if isinstance(obj, torch.nn.Module):
        return _with_inner([*obj.parameters(), *obj.buffers()])
    if isinstance(obj, torch.optim.Optimizer):
        found: list[torch.Tensor] = []
        for group in obj.param_groups:
            # a step count is kept on the host unless the group is capturable or fused (PyTorch's rule,
            # in `Optimizer.load_state_dict` too): on a GPU it takes no device memory
            host_step = not (group.get("capturable") or group.get("fused"))
            for p in group["params"]:
                found.extend(
                    v
                    for k, v in obj.state.get(p, {}).items()
                    if isinstance(v, torch.Tensor) and not (k == "step" and host_step and v.dim() == 0)
                )
        return _with_inner(found)
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_of(item)]
    raise TypeError(f"SimulatedDevice.track takes tensors, modules or optimizers, got {type(obj).__name__}")


class SimulatedProbe(HostClock):
    """Reads a `SimulatedDevice` through a peak window of its own."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.name = f"simulated:{device.name}"
        self.link_bytes_per_s = device.link.bytes_per_s if device.link is not None else None
        self._window = device.open_window()
        self._closer = weakref.finalize(self, device.close_window, self._window)

    def close(self) -> None:
        """Stop updating this probe's peak window (also done when the probe is collected)."""
        self._closer()

    def capacity(self) -> int:
        cap = self.device.capacity_bytes
        if cap is None:
            raise ValueError(
                "the SimulatedDevice has no capacity; create it with capacity_bytes=... or pass budget= in bytes"
            )
        return cap

    def mark(self) -> float:
        """The time now on the link's clock, which its waits are on (a benchmark's virtual
        clock, or the host's): the manager sees what a slow link costs where it is paid."""
        link = self.device.link
        return link.clock() if link is not None else super().mark()

    def allocated(self) -> int:
        return self.device.allocated_bytes

    def peak(self) -> int:
        return self._window.peak_bytes

    def reset_peak(self) -> None:
        self._window.reset()

    def external(self) -> int:
        return self.device.external_bytes

    def host_available(self) -> int:
        cap = self.device.host_capacity_bytes
        if cap is None:
            return super().host_available()
        return max(0, cap - self.device.host_bytes)
