"""OFFLOAD: saved tensors wait out the forward in host memory.

A saved tensor is copied to the host while compute goes on; its device copy is
let go of once the copy has arrived, and at most `OffloadOptions.max_in_flight_bytes`
of such copies are in flight at once (past it, the next pack waits for the
oldest), so the memory they hold is bounded and counted as allocated. During
backward, the tensor needed now is fetched first; then the block backward
reaches next (the one before it in forward order) is prefetched, so its copies
overlap with this block's gradient kernels. A block that offloads nothing does
the same for an offloaded block right before it, from a hook on its output's
gradient (`OffloadRuntime.prefetch_when_reached`).

On CUDA the copies run on side streams into pinned buffers
(`adaptmem.strategies.cuda_offload`). On the CPU the host tier is a plain copy
made inside `adaptmem.devices.tiers.host_allocations()`; under a stand-in with a
link (`SimulatedDevice(link_bytes_per_s=...)`) the copies take time each way,
as on PCIe (`adaptmem.devices.link`).

Fetch state (`PackGroup.began`, `HostCopy.fetched`) is read and set under one
lock: autograd runs a backward thread per device.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from adaptmem.devices.tiers import current_link, host_allocations
from adaptmem.strategies.payloads import Payload, nbytes_of
from adaptmem.strategies.pinned import PinnedBlock

_FETCH = threading.RLock()  # guards PackGroup.began / HostCopy.fetched across backward threads


@dataclass(frozen=True)
class OffloadOptions:
    """How a block offloads.

    min_bytes: saved tensors smaller than this stay on the device (bytes);
        moving many tiny tensors costs more in launches than it saves.
    prefetch: in backward, start bringing back the next block's tensors while
        this block's gradients are computed. Costs one block's saved bytes of
        device memory ahead of time.
    max_in_flight_bytes: device bytes whose copies to the host may be in flight
        at once (the window of copies not yet arrived, across blocks); past it the
        next pack waits for the oldest copy. Larger hides more of a slow link
        behind compute, at that many device bytes. None (the default): one block's
        worth, the most one block call has offloaded so far: a block's copies
        travel while it and the start of the next compute, and a link too slow to
        keep up holds at most that, which keeps the peak predictable.
    """

    min_bytes: int = 16 * 1024
    prefetch: bool = True
    max_in_flight_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("min_bytes", "max_in_flight_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_in_flight_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OffloadOptions.{name} must be a non-negative int of bytes, got {value!r}")


class HostCopy(Payload):
    """A saved tensor's bytes on the host, and the tier that brings them back.

    ready: when the copy to the host is complete (a CUDA event, or an arrival time
    on a stand-in's link). fetched: the copy back, once started.
    """

    __slots__ = ("host", "tier", "group", "block", "ready", "fetched", "used", "users", "back", "left", "__weakref__")

    def __init__(
        self,
        host: torch.Tensor,
        tier: Any,
        group: PackGroup | None = None,
        block: PinnedBlock | None = None,
        ready: Any = None,
    ) -> None:
        self.host = host
        self.tier = tier
        self.group = group
        self.block = block
        self.ready = ready
        self.fetched: Any = None
        self.used = False  # restored once: a late prefetch would fetch it for nobody
        self.users = 1  # saves that hold this copy (a tensor several ops saved is copied once)
        self.back: torch.Tensor | None = None  # brought back, kept for the saves yet to read it
        self.left = 0

    def share(self) -> None:
        """One more save holds this copy."""
        self.users += 1

    def restore(self) -> torch.Tensor:
        with _FETCH:  # the copy needed now goes first, then the next block's prefetch
            if self.back is not None:  # brought back for an earlier save of the same tensor
                back, self.left = self.back, self.left - 1
                if self.left <= 0:
                    self.back = None
                return back
            fetched, self.fetched, self.used = self.fetched, None, True
            if fetched is None:
                fetched = self.tier.fetch(self)
        if self.group is not None:
            self.group.begin_restore()
        back = self.tier.finish(self, fetched)
        if self.users > 1:
            with _FETCH:
                self.back, self.left = back, self.users - 1
        return back

    def prefetch(self) -> None:
        with _FETCH:
            if self.fetched is None and not self.used:
                self.fetched = self.tier.fetch(self)

    def __del__(self) -> None:
        fetched = self.fetched
        if fetched is not None:  # prefetched, never used (a step cut short)
            try:
                self.tier.abandon(fetched)
            except Exception:  # at interpreter exit the CUDA runtime may be gone already
                pass


class HostTier:
    """CPU fallback: a copy marked as host memory. Over a stand-in's link (`SimulatedDevice`
    with `link_bytes_per_s`) the copy takes time each way: the device tensor stays allocated
    until it has arrived (at most `max_in_flight_bytes` in flight), and backward waits for
    the copy back, which a prefetch starts early."""

    def pack(self, t: torch.Tensor, group: PackGroup | None, limit: int) -> HostCopy:
        with torch.no_grad(), host_allocations():
            host = t.detach().clone()
        link = current_link()
        ready = link.send(t.detach(), limit=limit) if link is not None else None
        copy = HostCopy(host, self, group=group, ready=ready)
        if group is not None and link is not None:
            group.add(copy)
        return copy

    def fetch(self, copy: HostCopy) -> Any:
        link = current_link()
        # the copy back starts once the copy out has reached the host
        return link.fetch(nbytes_of(copy.host), after=copy.ready) if link is not None else 0.0

    def finish(self, copy: HostCopy, fetched: Any) -> torch.Tensor:
        link = current_link()
        if link is not None:
            link.wait(fetched)
        with torch.no_grad():
            return copy.host.clone()

    def abandon(self, fetched: Any) -> None:
        pass


class PackGroup:
    """The offloaded tensors of one block call, linked to the block before it.

    When backward first restores one of this group's tensors, the previous
    group's copies are started, so they arrive while this block's gradients run.
    Copies are held weakly: autograd owns them.
    """

    __slots__ = ("_copies", "prev", "began", "__weakref__")

    def __init__(self, prev: PackGroup | None) -> None:
        self._copies: list[weakref.ref] = []
        self.prev = prev
        self.began = False

    def add(self, copy: HostCopy) -> None:
        self._copies.append(weakref.ref(copy))

    def begin_restore(self) -> None:
        with _FETCH:
            if self.began:
                return
            self.began = True
            prev, self.prev = self.prev, None
        if prev is not None:
            prev.prefetch()

    def prefetch(self) -> None:
        for ref in self._copies:
            copy = ref()
            if copy is not None:
                copy.prefetch()
