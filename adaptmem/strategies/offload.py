"""OFFLOAD: saved tensors wait out the forward in host memory.

On CUDA a tensor is copied device-to-host on a side stream into a pinned buffer
taken from a reusable pool; the compute stream goes on at once. During backward,
the first restore of a block's tensors starts the host-to-device copies of the
block that backward reaches next (the one before it in forward order), so those
copies overlap with this block's gradient kernels.

Lifetimes across streams, the part that is easy to get wrong:
  - the device tensor read by the D2H copy is `record_stream`-ed on the side
    stream, so the caching allocator does not hand its memory out before the
    copy has read it;
  - the device tensor written by the H2D copy is allocated on the H2D stream and
    `record_stream`-ed on the compute stream that uses it;
  - a pinned buffer returns to the pool only when its payload is gone, and is
    reused only after the last copy touching it has completed (its event).

On the CPU (and under `adaptmem.testing.SimulatedDevice`) the host tier is a
plain copy made inside `adaptmem.devices.tiers.host_allocations()`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from adaptmem.devices.tiers import current_link, host_allocations
from adaptmem.strategies.payloads import Payload, nbytes_of
from adaptmem.strategies.pinned import PinnedBlock, PinnedPool, host_view


@dataclass(frozen=True)
class OffloadOptions:
    """How a block offloads.

    min_bytes: saved tensors smaller than this stay on the device (bytes);
        moving many tiny tensors costs more in launches than it saves.
    prefetch: in backward, start bringing back the next block's tensors while
        this block's gradients are computed (CUDA only). Costs one block's saved
        bytes of device memory ahead of time.
    """

    min_bytes: int = 16 * 1024
    prefetch: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"OffloadOptions.min_bytes must be a non-negative int, got {self.min_bytes!r}")


class HostCopy(Payload):
    """A saved tensor's bytes on the host, and the tier that brings them back."""

    __slots__ = ("host", "tier", "group", "block", "ready", "fetched", "__weakref__")

    def __init__(self, host: torch.Tensor, tier: Any, group: "PackGroup | None" = None,
                 block: "PinnedBlock | None" = None, ready: Any = None) -> None:
        self.host = host
        self.tier = tier
        self.group = group
        self.block = block
        self.ready = ready
        self.fetched: tuple[torch.Tensor, Any] | None = None

    def restore(self) -> torch.Tensor:
        if self.group is not None:
            self.group.begin_restore()
        return self.tier.restore(self)


class HostTier:
    """CPU fallback: a copy marked as host memory. Over a stand-in's link (`SimulatedDevice`
    with `link_bytes_per_s`) the copy takes time each way: the device tensor stays allocated
    until it has arrived, and backward waits for the copy back, which a prefetch starts early."""

    def pack(self, t: torch.Tensor, group: "PackGroup | None") -> HostCopy:
        with torch.no_grad(), host_allocations():
            host = t.detach().clone()
        link = current_link()
        copy = HostCopy(host, self, group=group, ready=link.send(t.detach()) if link is not None else None)
        if group is not None and link is not None:
            group.add(copy)
        return copy

    def prefetch(self, copy: HostCopy) -> None:
        link = current_link()
        if link is not None and copy.fetched is None:  # starts once the copy has reached the host
            copy.fetched = (None, link.fetch(nbytes_of(copy.host), after=copy.ready))

    def restore(self, copy: HostCopy) -> torch.Tensor:
        link = current_link()
        if link is not None:
            fetched, copy.fetched = copy.fetched, None
            if fetched is None:
                fetched = (None, link.fetch(nbytes_of(copy.host), after=copy.ready))
            link.wait(fetched[1])
        with torch.no_grad():
            return copy.host.clone()


class CudaTier:
    """Pinned pool + one D2H and one H2D side stream for one CUDA device."""

    def __init__(self, device: torch.device, pool: PinnedPool) -> None:
        self.device = device
        self.pool = pool
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def pack(self, t: torch.Tensor, group: "PackGroup | None") -> HostCopy:
        t = t.detach()
        block = self.pool.acquire(nbytes_of(t))  # idle: no copy still touches it
        host = host_view(block, t)
        main = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(main)  # t is fully written before we read it
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.d2h)
        t.record_stream(self.d2h)
        block.busy_until = ready
        copy = HostCopy(host, self, group=group, block=block, ready=ready)
        weakref.finalize(copy, self.pool.release, block)
        if group is not None:
            group.add(copy)
        return copy

    def prefetch(self, copy: HostCopy) -> None:
        if copy.fetched is None:
            copy.fetched = self._start_h2d(copy)

    def restore(self, copy: HostCopy) -> torch.Tensor:
        fetched, copy.fetched = copy.fetched, None
        dev, done = fetched if fetched is not None else self._start_h2d(copy)
        main = torch.cuda.current_stream(self.device)
        main.wait_event(done)
        dev.record_stream(main)
        return dev

    def _start_h2d(self, copy: HostCopy) -> tuple[torch.Tensor, Any]:
        host = copy.host
        self.h2d.wait_event(copy.ready)
        with torch.cuda.stream(self.h2d):
            dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        if copy.block is not None:
            copy.block.busy_until = done
        return dev, done


class PackGroup:
    """The offloaded tensors of one block call, linked to the block before it.

    When backward first restores one of this group's tensors, the previous
    group's copies are started, so they arrive while this block's gradients run.
    Copies are held weakly: autograd owns them.
    """

    __slots__ = ("_copies", "prev", "began", "__weakref__")

    def __init__(self, prev: "PackGroup | None") -> None:
        self._copies: list[weakref.ref] = []
        self.prev = prev
        self.began = False

    def add(self, copy: HostCopy) -> None:
        self._copies.append(weakref.ref(copy))

    def begin_restore(self) -> None:
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
                copy.tier.prefetch(copy)


class OffloadRuntime:
    """Where one instrumented model's offloaded bytes go: a tier per device."""

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool if pool is not None else PinnedPool()
        self._host = HostTier()
        self._cuda: dict[int, CudaTier] = {}
        self._last_group: PackGroup | None = None

    def new_group(self, options: OffloadOptions) -> PackGroup | None:
        if not options.prefetch or torch.compiler.is_compiling():  # no state for torch.compile to guard on
            return None
        last = self._last_group
        group = PackGroup(prev=last if last is not None and not last.began else None)
        self._last_group = group
        return group

    def offload(self, t: torch.Tensor, group: PackGroup | None) -> HostCopy:
        if t.device.type == "cuda":
            return self._tier_for(t.device).pack(t, group)
        return self._host.pack(t, group)

    def _tier_for(self, device: torch.device) -> CudaTier:
        index = device.index if device.index is not None else torch.cuda.current_device()
        tier = self._cuda.get(index)
        if tier is None:
            tier = self._cuda[index] = CudaTier(torch.device("cuda", index), self.pool)
        return tier

    def __deepcopy__(self, memo: dict) -> "OffloadRuntime":
        return OffloadRuntime(PinnedPool(self.pool.max_cached_bytes))

    def __getstate__(self) -> dict:
        return {"max_cached_bytes": self.pool.max_cached_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(PinnedPool(state["max_cached_bytes"]))
