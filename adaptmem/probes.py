"""Reading device memory: one interface over CUDA, the host, and the CPU stand-in.

A probe answers, in bytes: how big the device is (`capacity`), what this
process's tensors hold now (`allocated`) and at most since the last reset
(`peak`), and what is taken outside them (`external`: other processes, the CUDA
context, non-PyTorch libraries). It also marks time, so block timings on CUDA
come from events rather than host clocks.

`make_probe(device)` picks one: ``None`` is the current CUDA device, or the
host when there is none; ``"cuda:N"``; a `SimulatedDevice`; or any object with
this interface (tests pass scripted ones).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol, runtime_checkable

import psutil
import torch

from adaptmem.units import format_bytes

log = logging.getLogger("adaptmem")


@runtime_checkable
class MemoryProbe(Protocol):
    name: str

    def capacity(self) -> int: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...

    def external(self) -> int: ...

    def host_available(self) -> int: ...

    def signals(self) -> dict: ...

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def synchronize(self) -> None: ...


class HostClock:
    """Host-clock timing, for devices that run synchronously."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)

    def synchronize(self) -> None:
        pass

    def host_available(self) -> int:
        return psutil.virtual_memory().available

    def signals(self) -> dict:
        return {}


class SimulatedProbe(HostClock):
    """Reads an `adaptmem.testing.SimulatedDevice`."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.name = f"simulated:{device.name}"

    def capacity(self) -> int:
        cap = self.device.capacity_bytes
        if cap is None:
            raise ValueError(
                "the SimulatedDevice has no capacity; create it with capacity_bytes=... "
                "or pass budget= in bytes"
            )
        return cap

    def allocated(self) -> int:
        return self.device.allocated_bytes

    def peak(self) -> int:
        return self.device.peak_bytes

    def reset_peak(self) -> None:
        self.device.reset_peak()

    def external(self) -> int:
        return self.device.external_bytes

    def host_available(self) -> int:
        cap = getattr(self.device, "host_capacity_bytes", None)
        if cap is None:
            return super().host_available()
        return max(0, cap - self.device.host_bytes)


class HostProbe(HostClock):
    """CPU training: process RSS through psutil (coarse: a sampled peak, not every allocation)."""

    def __init__(self) -> None:
        self.name = "host"
        self._process = psutil.Process(os.getpid())
        self._peak = 0
        self._lock = threading.Lock()

    def capacity(self) -> int:
        return psutil.virtual_memory().total

    def allocated(self) -> int:
        rss = self._process.memory_info().rss
        with self._lock:
            self._peak = max(self._peak, rss)
        return rss

    def peak(self) -> int:
        self.allocated()
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = 0
        self.allocated()

    def external(self) -> int:
        vm = psutil.virtual_memory()
        return max(0, vm.total - vm.available - self._process.memory_info().rss)


class CudaProbe:
    """One CUDA device: the caching allocator's figures, cudaMemGetInfo, and NVML when present."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaProbe needs a CUDA device; none is available")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = f"cuda:{self.device.index}"
        self._total = torch.cuda.get_device_properties(self.device).total_memory
        self._nvml = _nvml_handle(self.device.index)
        self._hinted = False

    def capacity(self) -> int:
        return self._total

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def external(self) -> int:
        """Device bytes not held by PyTorch's allocator: other processes, the context, libraries."""
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))

    def other_processes(self) -> int | None:
        """Bytes NVML reports for other processes on this device (None without NVML)."""
        if self._nvml is None:
            return None
        import pynvml

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml)
        except pynvml.NVMLError:
            return None
        me = os.getpid()
        return sum((p.usedGpuMemory or 0) for p in procs if p.pid != me)

    def host_available(self) -> int:
        return psutil.virtual_memory().available

    def signals(self) -> dict:
        stats = torch.cuda.memory_stats(self.device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        allocated = stats.get("allocated_bytes.all.current", 0)
        fragmented = reserved - allocated
        if not self._hinted and reserved > 0 and fragmented > 0.3 * reserved and fragmented > 2**30:
            self._hinted = True
            log.warning(
                "adaptmem: %s is reserved by PyTorch but not allocated (%s); that is fragmentation, "
                "which no plan of modes fixes. Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                format_bytes(fragmented), self.name,
            )
        return {
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "device_ooms": stats.get("num_ooms", 0),
            "reserved": reserved,
            "fragmented": fragmented,
        }

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return max(0.0, start.elapsed_time(end) / 1000.0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _nvml_handle(index: int) -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as err:  # no driver library, no permission, MIG, a container...
        log.info("adaptmem: NVML unavailable (%s); memory of other processes is read as "
                 "total - free - reserved from cudaMemGetInfo", err)
        return None


def make_probe(device: Any = None) -> MemoryProbe:
    """The probe for `device`: None, "cuda", "cuda:N", "cpu", a SimulatedDevice, or a probe."""
    from adaptmem.testing import SimulatedDevice

    if isinstance(device, SimulatedDevice):
        return SimulatedProbe(device)
    if isinstance(device, MemoryProbe):
        return device
    if device is None:
        if torch.cuda.is_available():
            return CudaProbe()
        log.warning("adaptmem: no CUDA device found; managing host memory through psutil "
                    "(peak sampled at block boundaries, coarse)")
        return HostProbe()
    if isinstance(device, (str, torch.device, int)):
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r} but no CUDA device is available; "
                                 "pass device=None or a SimulatedDevice")
            return CudaProbe(dev)
        if dev.type == "cpu":
            return HostProbe()
    raise ValueError(
        f"device must be None, 'cuda', 'cuda:N', 'cpu', a SimulatedDevice or a MemoryProbe; got {device!r}"
    )
