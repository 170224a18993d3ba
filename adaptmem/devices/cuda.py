"""One CUDA device: the caching allocator's figures, cudaMemGetInfo, and NVML when present."""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil
import torch

from adaptmem.config.units import format_bytes

log = logging.getLogger("adaptmem")


class CudaProbe:
    """One CUDA device: the caching allocator's figures, cudaMemGetInfo, and NVML when present."""

    asynchronous = True  # kernels run after the host issues them: a light step is not waited for

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaProbe needs a CUDA device; none is available")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = f"cuda:{self.device.index}"
        self._total = torch.cuda.get_device_properties(self.device).total_memory
        self._nvml = _nvml_handle(nvml_index(self.device.index))
        self._hinted = False
        self._retries: int | None = None  # the allocator's retry count at the last reading

    def capacity(self) -> int:
        """The device's memory, or the share `torch.cuda.set_per_process_memory_fraction` leaves
        this process: past it the allocator raises out-of-memory as on a full device."""
        fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        return self._total if fraction >= 1 else int(self._total * fraction)

    def _counters(self, name: str) -> dict:
        """One family of the caching allocator's counters, e.g. "allocated_bytes": its "current"
        and "peak" bytes, and the bytes it ever took ("allocated") and gave back ("freed").

        Read from the allocator's nested statistics in one call. `torch.cuda.memory_allocated()`
        and its kin flatten and sort every counter on each call, about 0.4 ms each; the manager
        reads them at every block boundary of a step it measures block by block, and on an
        H100 such a step took 70 ms longer than a plain one with them, 20 to 35 ms with this."""
        return _family(torch.cuda.memory_stats_as_nested_dict(self.device), name)

    def allocated(self) -> int:
        return self._counters("allocated_bytes").get("current", 0)

    def peak(self) -> int:
        return self._counters("allocated_bytes").get("peak", 0)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def take_peak(self) -> tuple[int, int]:
        """(peak, allocated) from one reading of the counters, then the peak reset: what a step
        measured block by block reads at each boundary, in half the readings."""
        c = self._counters("allocated_bytes")
        torch.cuda.reset_peak_memory_stats(self.device)
        return c.get("peak", 0), c.get("current", 0)

    def external(self) -> int:
        """Device bytes not held by PyTorch's allocator: other processes, the context, libraries.

        cudaMemGetInfo and the allocator's reserved bytes are two reads; a segment freed
        (or reserved) between them would read as others' memory. So the reserved bytes
        are read on both sides of it, and the pair is taken only when nothing was reserved
        or released in between: the bytes ever reserved and ever released agree too, not
        only the bytes reserved now, which a segment taken and given back (another thread
        churning the allocator) leaves as they were.

        Under a per-process memory fraction, what others hold takes from this process's
        share only past the part of the device the fraction leaves out, so that part is
        taken off: a process capped at 8 GiB of 80 loses nothing to a 1 GiB context."""
        for _ in range(4):
            before = self._reserved()
            free, total = torch.cuda.mem_get_info(self.device)
            after = self._reserved()
            if after == before:
                break
        others = max(0, total - free - max(before[0], after[0]))
        return max(0, others - (self._total - self.capacity()))

    def _reserved(self) -> tuple[int, int, int]:
        """Bytes reserved now, ever reserved, and ever released."""
        c = self._counters("reserved_bytes")
        return c.get("current", 0), c.get("allocated", 0), c.get("freed", 0)

    def processes(self) -> list[dict] | None:
        """The other processes holding memory on this device, largest first, as
        ``{"pid", "name", "bytes"}`` (NVML's per-process usage); None without NVML."""
        if self._nvml is None:
            return None
        import pynvml

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml)
        except pynvml.NVMLError:
            return None
        me = os.getpid()
        found = [
            {"pid": int(p.pid), "name": _process_name(p.pid), "bytes": int(p.usedGpuMemory or 0)}
            for p in procs
            if p.pid != me
        ]
        return sorted(found, key=lambda r: -r["bytes"])

    def host_available(self) -> int:
        return psutil.virtual_memory().available

    def signals(self) -> dict:
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        reserved = _family(stats, "reserved_bytes").get("current", 0)
        allocated = _family(stats, "allocated_bytes").get("current", 0)
        retries, cached = stats.get("num_alloc_retries", 0), reserved - allocated
        self._hint_fragmentation(retries, cached)
        return {
            "alloc_retries": retries,
            "device_ooms": stats.get("num_ooms", 0),
            "reserved": reserved,
            "fragmented": cached,
        }

    def _hint_fragmentation(self, retries: int, cached: int) -> None:
        """One warning the first time the allocator had to free its cache and retry since the last
        reading: a request that none of the blocks it held fitted, memory split into pieces of the
        wrong sizes. Bytes reserved and not allocated at the end of a step are no such sign: they
        are the blocks the step's activations freed, kept for the next step."""
        before, self._retries = self._retries, retries
        if self._hinted or before is None or retries <= before or _expandable_segments():
            return
        self._hinted = True
        log.warning(
            "adaptmem: PyTorch's caching allocator on %s freed its cache to retry an allocation (%d time%s "
            "since the last step; %s reserved and not allocated now): memory split into blocks of the wrong "
            "sizes, which no plan of modes fixes. Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            self.name,
            retries - before,
            "" if retries - before == 1 else "s",
            format_bytes(cached),
        )

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return max(0.0, start.elapsed_time(end) / 1000.0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _family(stats: dict, name: str) -> dict:
    """One family of counters of `torch.cuda.memory_stats_as_nested_dict()`, over every pool."""
    return stats.get(name, {}).get("all", {})


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):  # gone, or another user's (inside a container, say)
        return "?"


def nvml_index(cuda_index: int) -> int:
    """NVML's index of CUDA device `cuda_index`: NVML ignores CUDA_VISIBLE_DEVICES, so
    with CUDA_VISIBLE_DEVICES=2,3 the process's cuda:0 is NVML's device 2."""
    try:
        return torch.cuda._get_nvml_device_index(cuda_index)
    except Exception:  # a private helper: missing, or the UUIDs unreadable
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ordinals = [v.strip() for v in visible.split(",") if v.strip()]
        if ordinals and all(v.isdigit() for v in ordinals) and cuda_index < len(ordinals):
            return int(ordinals[cuda_index])
        return cuda_index


def _nvml_handle(index: int) -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as err:  # no driver library, no permission, MIG, a container...
        log.info(
            "adaptmem: NVML unavailable (%s); memory of other processes is read as "
            "total - free - reserved from cudaMemGetInfo",
            err,
        )
        return None


def _expandable_segments() -> bool:
    """Whether the allocator is set to grow its segments in place (set before CUDA starts)."""
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
    return "expandable_segments:true" in conf.replace(" ", "")
