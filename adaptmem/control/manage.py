"""`adaptmem.manage`: the one call that puts a model under adaptive activation memory."""

from __future__ import annotations

from typing import Any

from torch import nn

from adaptmem.config.budget import Budget
from adaptmem.config.policy import Policy
from adaptmem.control.manager import MemoryManager
from adaptmem.wrapping import BlockSelection, HeadSelection


def manage(
    model: nn.Module,
    policy: str | Policy | None = None,
    budget: Budget = None,
    device: Any = None,
    blocks: BlockSelection = "auto",
    log: str | None = None,
    head: HeadSelection = "auto",
) -> MemoryManager:
    """Manage `model`'s activation memory; use it as ``with adaptmem.manage(model) as mem:``
    (the model is restored on exit) or keep it and `close()` it.

    Args:
        model: the model to train.
        policy: a preset name ("balanced", the default; "max-savings", "long-context", "every-2",
            "sqrt-n"), a path to a TOML policy, or a `Policy`. ADAPTMEM_POLICY overrides.
        budget: ceiling for the device's peak allocated bytes in a step: bytes, "12GiB",
            "80%" of capacity, or None for the policy's share of what others leave free.
            ADAPTMEM_BUDGET overrides.
        device: None (the current CUDA device, or the host), "cuda:N", or a SimulatedDevice.
        blocks: which submodules are blocks (see `adaptmem.instrument`); with a model you
            instrumented yourself, "auto" keeps your blocks and your modes as the starting plan.
        log: path of a JSONL decision log (appended to), or None.
        head: the loss head ("auto": a Hugging Face language model's output projection, chunked in
            calls with labels= when the budget needs it; the name of an nn.Linear, or the module, for
            a model of one's own; None: not managed). See `adaptmem.wrapping.head`.
    """
    return MemoryManager(model, policy=policy, budget=budget, device=device, blocks=blocks, log=log, head=head)
