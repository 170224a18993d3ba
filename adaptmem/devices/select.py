"""Choosing the probe for what the user passed as `device`."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from adaptmem.devices.cuda import CudaProbe
from adaptmem.devices.host import HostProbe
from adaptmem.devices.probe import MemoryProbe
from adaptmem.devices.simulated import SimulatedDevice, SimulatedProbe

log = logging.getLogger("adaptmem")


def make_probe(device: Any = None, model: torch.nn.Module | None = None) -> MemoryProbe:
    """The probe for `device`: None, "cuda", "cuda:N", "cpu", a SimulatedDevice, or a probe.

    With `device=None` (or "cuda") and a model on a CUDA device, that device is
    measured, whichever is current. A model spread over several CUDA devices is
    refused: one manager measures one device.
    """
    if isinstance(device, SimulatedDevice):
        return SimulatedProbe(device)
    if isinstance(device, MemoryProbe):
        return device
    home = cuda_home(model) if model is not None else None
    if device is None:
        if torch.cuda.is_available():
            return CudaProbe(home)
        log.warning(
            "adaptmem: no CUDA device found; managing host memory through psutil "
            "(peak sampled at block boundaries, coarse)"
        )
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
                raise ValueError(
                    f"device={device!r} but no CUDA device is available; pass device=None or a SimulatedDevice"
                )
            if home is not None and dev.index is not None and dev != home:
                raise ValueError(
                    f"device={device!r} but the model's parameters are on {home}; "
                    f"pass device={str(home)!r} (or None: the model's own device)"
                )
            return CudaProbe(home if dev.index is None and home is not None else dev)
        if dev.type == "cpu":
            return HostProbe()
    raise ValueError(
        f"device must be None, 'cuda', 'cuda:N', 'cpu', a SimulatedDevice or a MemoryProbe; got {device!r}"
    )


def cuda_home(model: torch.nn.Module) -> torch.device | None:
    """The CUDA device the model's parameters and buffers live on; None when none is on CUDA."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return one_device({t.device for t in tensors if t.device.type == "cuda"})


def one_device(devices: set[torch.device]) -> torch.device | None:
    """The one device in `devices` (None when empty); several are refused with what to do instead."""
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"the model's parameters are spread over {names}; adaptmem measures one device per manager. "
            "Put the model on one device, or manage each device's part (a pipeline stage) on its own: "
            "adaptmem.manage(stage, device='cuda:N')"
        )
    return next(iter(devices), None)
