"""A CPU stand-in for a GPU: a capacity, exact byte counts, and real OOMs.

`SimulatedDevice` watches every tensor storage that is allocated while it is
active (through a `TorchDispatchMode`, the same way
`torch.distributed._tools.mem_tracker.MemTracker` does) and forgets it when the
storage is freed. Copies made by the OFFLOAD strategy (inside
`adaptmem.tiers.host_allocations()`) are host bytes, everything else device
bytes. An allocation that would take the device past its capacity raises a real
`torch.OutOfMemoryError`, so out-of-memory handling is tested on machines
without a GPU.

Interception costs time: never compare a step timed under a SimulatedDevice
with one timed without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from adaptmem.probes import HostClock
from adaptmem.tiers import allocating_on_host
from adaptmem.units import format_bytes

__all__ = ["ScriptedProbe", "SimulatedDevice", "measure_peak"]

_DEVICE, _HOST = 0, 1


class _Entry:
    """What the stand-in knows of one live storage."""

    __slots__ = ("nbytes", "tier", "ref")

    def __init__(self, nbytes: int, tier: int) -> None:
        self.nbytes = nbytes
        self.tier = tier
        self.ref: weakref.ref | None = None


class _CountingMode(TorchDispatchMode):
    def __init__(self, device: "SimulatedDevice") -> None:
        super().__init__()
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._device._account(out)
        return out


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
    """

    def __init__(self, capacity_bytes: int | None = None, *, name: str = "sim",
                 host_capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise TypeError(
                    f"capacity_bytes must be an int number of bytes or None, got {capacity_bytes!r}"
                )
            if capacity_bytes <= 0:
                raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.name = name
        self.host_capacity_bytes = host_capacity_bytes
        # Re-entrant: a storage freed by a garbage collection that runs while the
        # lock is held calls `release` on the same thread.
        self._lock = threading.RLock()
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._bytes = [0, 0]  # device, host
        self._peaks = [0, 0]
        self._external = 0
        self._modes: list[_CountingMode] = []
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
        return self._peaks[_DEVICE]

    @property
    def host_bytes(self) -> int:
        """Host bytes held by offloaded copies (live now)."""
        return self._bytes[_HOST]

    @property
    def host_peak_bytes(self) -> int:
        return self._peaks[_HOST]

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
        with self._lock:
            self._peaks = list(self._bytes)

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
                raise ValueError(
                    f"cannot release {-nbytes} bytes: other processes hold only {self._external}"
                )
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
    def __enter__(self) -> "SimulatedDevice":
        mode = _CountingMode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        mode = self._modes.pop()
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
    def _account(self, out: Any) -> None:
        leaves, _ = tree_flatten(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if tensors:
            tier = _HOST if allocating_on_host() else _DEVICE
            self._register(tensors, tier=tier, check=True)

    def _register(self, tensors: Iterable[torch.Tensor], *, tier: int, check: bool) -> int:
        fresh: dict[int, tuple[Any, int]] = {}
        with self._lock:
            for t in tensors:
                st = _storage_of(t)
                if st is None:
                    continue
                nbytes = st.nbytes()
                entry = self._live.get(st)
                if entry is not None:
                    if entry.nbytes != nbytes:  # resized in place
                        self._add(entry.tier, nbytes - entry.nbytes)
                        entry.nbytes = nbytes
                    continue
                fresh.setdefault(id(st), (st, nbytes))
            added = sum(n for _, n in fresh.values())
            if check and tier == _DEVICE and self._capacity is not None:
                free = self._capacity - self._bytes[_DEVICE] - self._external
                if added > free:
                    self.num_ooms += 1
                    raise torch.OutOfMemoryError(self._oom_message(added, free))
            for st, nbytes in fresh.values():
                entry = _Entry(nbytes, tier)
                entry.ref = weakref.ref(st, self._make_release(entry))
                self._live[st] = entry
                self._add(tier, nbytes)
        return added

    def _add(self, tier: int, nbytes: int) -> None:
        self._bytes[tier] += nbytes
        if self._bytes[tier] > self._peaks[tier]:
            self._peaks[tier] = self._bytes[tier]

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
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
        return None


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        found: list[torch.Tensor] = []
        for state in obj.state.values():
            found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return found
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_of(item)]
    raise TypeError(
        f"SimulatedDevice.track takes tensors, modules or optimizers, got {type(obj).__name__}"
    )


class ScriptedProbe(HostClock):
    """A memory probe whose readings follow a script, to test decisions exactly.

    Each step's peak is ``peaks[i]`` (a sequence, the last value repeating) or
    ``peaks(i)`` (a callable of the step index, counted from 0); likewise the
    allocator's retry count, ``retries``. Allocation and outside memory are
    constants you may change between steps.
    """

    def __init__(self, capacity_bytes: int, peaks, *, allocated: int = 0, external: int = 0,
                 retries=None) -> None:
        self.name = "scripted"
        self._capacity = capacity_bytes
        self._peaks = peaks
        self._retries = retries
        self.allocated_bytes = allocated
        self.external_bytes = external
        self.step = -1

    def step_started(self) -> None:
        self.step += 1

    def _at(self, script) -> int:
        if callable(script):
            return int(script(self.step))
        return int(script[min(max(self.step, 0), len(script) - 1)])

    def capacity(self) -> int:
        return self._capacity

    def allocated(self) -> int:
        return self.allocated_bytes

    def peak(self) -> int:
        return max(self.allocated_bytes, self._at(self._peaks))

    def reset_peak(self) -> None:
        pass

    def external(self) -> int:
        return self.external_bytes

    def host_available(self) -> int:
        return 1 << 40

    def signals(self) -> dict:
        return {} if self._retries is None else {"alloc_retries": self._at(self._retries)}


def measure_peak(model: torch.nn.Module, make_batch, *, mode=None, optimizer=None, steps: int = 1) -> int:
    """Peak device bytes of a training step of `model`, weights counted, on a fresh stand-in.

    With `mode`, every block runs in it (the model is instrumented for the
    measurement and restored after). With `optimizer`, each step also steps it,
    so after the first step its state is counted too. The peak of the last of
    `steps` steps is returned; gradients are cleared after.
    """
    from adaptmem.wrap import get_instrumentation, instrument, restore

    owned = mode is not None and get_instrumentation(model) is None
    if mode is not None:
        for handle in instrument(model):
            handle.mode = mode
    dev = SimulatedDevice()
    dev.track(model)
    try:
        with dev:
            for _ in range(steps):
                dev.reset_peak()
                model(**make_batch()).loss.backward()
                if optimizer is not None:
                    optimizer.step()
                model.zero_grad(set_to_none=True)
    finally:
        if owned:
            restore(model)
    return dev.peak_bytes
