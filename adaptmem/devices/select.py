"""Choosing the probe for what the user passed as `device`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from adaptmem.devices.cuda import CudaProbe
from adaptmem.devices.host import HostProbe
from adaptmem.devices.probe import MemoryProbe
from adaptmem.devices.simulated import SimulatedDevice, SimulatedProbe

log = logging.getLogger("adaptmem")


def make_probe(device: Any = None) -> MemoryProbe:
    """The probe for `device`: None, "cuda", "cuda:N", "cpu", a SimulatedDevice, or a probe."""
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
    if isinstance(device, (str, torch.device, int)) and not isinstance(device, bool):
        try:
            dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        except RuntimeError:
            raise ValueError(
                f"device={device!r} is not a device adaptmem can manage: pass None (the current CUDA "
                "device, or the host), 'cuda', 'cuda:N', 'cpu', or a SimulatedDevice"
            ) from None
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
