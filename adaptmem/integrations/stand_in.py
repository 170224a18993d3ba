"""What the integrations share with the CPU stand-in: the state a resume loads, counted."""

from __future__ import annotations

from typing import Any


def count_loaded(device: Any, *objs: Any) -> None:
    """On the CPU stand-in (`SimulatedDevice`), count what a resume loaded outside it: an optimizer's
    state from a checkpoint, which `load_state_dict` keeps as loaded and the stand-in never saw made
    (a framework builds the optimizer inside its `fit()` or `train()`, where a user cannot `track`
    it). Storages counted already are skipped. On a GPU nothing: its allocator counted them."""
    from adaptmem.devices.simulated import SimulatedDevice

    if isinstance(device, SimulatedDevice):
        device.track(*(obj for obj in objs if obj is not None))
