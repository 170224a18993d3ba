"""One-off measurements on the stand-in: the peak of a training step with every block in one mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptmem.devices.simulated import SimulatedDevice
from adaptmem.modes import Mode
from adaptmem.wrapping import get_instrumentation, instrument, restore


def measure_peak(
    model: torch.nn.Module,
    make_batch: Callable[[], dict] | None = None,
    *,
    step: Callable[[], Any] | None = None,
    mode: Mode | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 1,
) -> int:
    """Peak device bytes of a training step of `model`, weights counted, on a fresh stand-in.

    `make_batch()` returns the keyword arguments of one forward, whose output
    has a `.loss`; or `step()` runs a forward and backward of your own (two
    forwards for a contrastive loss, say): one of the two. With `mode`, every block runs in it (a plain model is
    instrumented with the automatic blocks for the measurement and restored
    after; an instrumented one keeps its blocks and gets its own modes back).
    With `optimizer`, each step also steps it, so after the first step its
    state is counted too (from the start where it has state already). The peak of the last of `steps`
    steps is returned; gradients are cleared after.
    """
    if (make_batch is None) == (step is None):
        raise ValueError(
            "measure_peak: give either make_batch (a function returning one forward's keyword "
            "arguments, whose output has a .loss) or step= (a function running a forward and "
            f"backward of your own), not {'both' if step is not None else 'neither'}"
        )
    if step is None:

        def step() -> None:
            model(**make_batch()).loss.backward()

    existing = get_instrumentation(model)
    owned = mode is not None and existing is None
    # a model instrumented already keeps its own blocks (its `blocks=` choice, not the automatic one)
    handles = [] if mode is None else list(existing.handles) if existing is not None else instrument(model)
    before = [h.mode for h in handles]
    for handle in handles:
        handle.mode = mode
    dev = SimulatedDevice()
    dev.track(model)
    if optimizer is not None:  # one that has stepped before holds its state already: counted as the weights
        # are, less its step counters, host scalars as on a GPU (the stand-in leaves them out where made)
        dev.track(*(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0))
    try:
        with dev:
            for _ in range(steps):
                dev.reset_peak()
                step()
                if optimizer is not None:
                    optimizer.step()
                model.zero_grad(set_to_none=True)
    finally:
        if owned:
            restore(model)
        else:
            for handle, previous in zip(handles, before):
                handle.mode = previous
    return dev.peak_bytes
