"""Where one instrumented model's offloaded bytes go: the host tier, or a CUDA tier per device."""

from __future__ import annotations

from typing import Any

import torch

from adaptmem.devices.tiers import current_link
from adaptmem.strategies.cuda_offload import CudaTier
from adaptmem.strategies.offload import HostCopy, HostTier, OffloadOptions, PackGroup
from adaptmem.strategies.payloads import backward_entry
from adaptmem.strategies.pinned import PinnedPool


class OffloadRuntime:
    """Where one instrumented model's offloaded bytes go: a tier per device."""

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool if pool is not None else PinnedPool()
        self._host = HostTier()
        self._cuda: dict[int, CudaTier] = {}
        self._last_group: PackGroup | None = None
        self._call_bytes = 0  # bytes the block call under way has offloaded
        self.largest_call_bytes = 0  # the most one block call has offloaded

    def new_group(self, options: OffloadOptions) -> PackGroup | None:
        """A block call begins offloading: its copies' group (for prefetch in backward)."""
        if torch.compiler.is_compiling():  # no state for torch.compile to guard on
            return None
        self._call_bytes = 0
        if not options.prefetch:
            return None
        last = self._last_group
        group = PackGroup(prev=last if last is not None and not last.began else None)
        self._last_group = group
        return group

    def prefetch_when_reached(self, output: Any) -> None:
        """A block that offloads nothing has run after one that did: when backward reaches
        this block (its output's gradient is ready), the offloaded block's copies start back,
        so they travel while this block's gradients run, as an offloaded block starts the one
        before it. Without it they would start only when their own block's backward asks for
        them, and it would wait out the whole transfer."""
        last = self._last_group
        if last is None or torch.compiler.is_compiling():
            return
        self._last_group = None
        if not last.began and (reached := backward_entry(output)) is not None:
            reached.register_hook(_Prefetch(last))

    def offload(self, t: torch.Tensor, group: PackGroup | None, options: OffloadOptions) -> HostCopy:
        limit = self.window(options, t.untyped_storage().nbytes())
        if t.device.type == "cuda":
            return self.tier_for(t.device).pack(t, group, limit)
        return self._host.pack(t, group, limit)

    def window(self, options: OffloadOptions, nbytes: int) -> int:
        """Device bytes that may be in flight once a copy of `nbytes` is sent: the options'
        window, or (None) the most one block call has offloaded, this one included."""
        if options.max_in_flight_bytes is not None:
            return options.max_in_flight_bytes
        if torch.compiler.is_compiling():
            return max(self.largest_call_bytes, nbytes)
        self._call_bytes += nbytes
        self.largest_call_bytes = max(self.largest_call_bytes, self._call_bytes)
        return self.largest_call_bytes

    def tier_for(self, device: torch.device) -> CudaTier:
        """The CUDA tier (side streams, copy window) of `device`."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        tier = self._cuda.get(index)
        if tier is None:
            tier = self._cuda[index] = CudaTier(torch.device("cuda", index), self.pool)
        return tier

    def settle(self) -> None:
        """After a failed attempt, before its retry: its copies to the host still in flight keep their
        device tensors alive (on CUDA, in the window; on the stand-in, until its link delivers them),
        which the retry's plan would count as allocated before it starts. Let go of them, and of the
        group the next block would have started back."""
        for tier in self._cuda.values():
            tier.settle()
        link = current_link()
        if link is not None:
            link.settle()
        self._last_group, self._call_bytes = None, 0

    def in_flight_bytes(self) -> int:
        """Device bytes whose copies to the host have not arrived yet (CUDA tiers, or the stand-in's link)."""
        link = current_link()
        return sum(t.window.bytes for t in self._cuda.values()) + (link.in_flight_bytes if link is not None else 0)

    def __deepcopy__(self, memo: dict) -> OffloadRuntime:
        return OffloadRuntime(self.pool.empty_like())

    def __getstate__(self) -> dict:
        return {"pool": self.pool.settings()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(PinnedPool(**state["pool"]))


class _Prefetch:
    """A gradient hook that starts an offloaded block's copies back and leaves the gradient as it is."""

    __slots__ = ("group",)

    def __init__(self, group: PackGroup) -> None:
        self.group = group

    def __call__(self, grad: torch.Tensor) -> None:
        group, self.group = self.group, None  # once: a tensor used twice gets two gradients
        if group is not None and not group.began:
            group.prefetch()
