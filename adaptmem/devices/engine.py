"""What a backward that raised leaves in PyTorch's autograd engine, and how to let it go.

The engine runs a backward's nodes from ready queues: the calling thread's for CPU work,
which it serves only while it runs a backward, and one per GPU, served by that device's own
thread. Where a node raises (an out-of-memory error) while another
was ready beside it (a block with two branches, attention beside its MLP: one runs while the
other waits), the waiting one stays queued after the error, holding the failed step's graph
and every tensor it saved, until that thread runs its next backward. On a 3-layer Cohere at
4 x 512 tokens that was 115 MiB on the stand-in, and the step after it was planned from
there. PyTorch keeps the calling thread's queue from one backward to the next, with whatever a
failed one left in it (pytorch/pytorch#33157 chose not to clear it). One backward of nothing
drains it; one runs on each of the model's devices too, for a device thread's queue (on an
H200 a failed CUDA recompute left nothing there: a device's thread serves its queue without
a backward of the caller's, and lets a failed task's nodes go).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def release_failed_backward(devices: Iterable[torch.device | str] = ()) -> None:
    """Let go of what a backward that raised left queued in PyTorch's autograd engine: a
    backward of nothing runs on the CPU and on each of `devices` (a model's). Call it after
    catching an out-of-memory error from a backward yourself; `run_step` and `step()` call it
    after every out-of-memory error they see."""
    places = {torch.device("cpu")} | {torch.device(d) for d in devices}
    with torch.enable_grad():
        for place in sorted(places, key=str):
            try:
                seed = torch.zeros((), device=place, requires_grad=True)
                torch.autograd.backward(seed * 1.0)
            except RuntimeError:  # a device with no backward of its own (parameters on "meta"): nothing queued
                continue
