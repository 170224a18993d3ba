"""One forward call of a managed block, as a strategy sees it.

The wrapper (`adaptmem.wrapping`) builds it; a strategy reads it and reports
back only through it: the bytes it packed (`stats`) and, for recomputing modes,
the start and end of each recompute (`on_recompute`). A strategy never sees the
handle or the manager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adaptmem.modes import Mode
from adaptmem.pytree import tensors_in
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import OffloadOptions
from adaptmem.strategies.offload_runtime import OffloadRuntime


def main_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A block's main input: its first floating tensor argument of two or more dimensions
    (positional, then keyword), the activations that flow from block to block."""
    for t in tensors_in((args, kwargs)):
        if t.is_floating_point() and t.dim() >= 2:
            return t
    return None


def _quiet(key: str, message: str) -> None:
    """The default `warn_once`: say nothing."""


@dataclass
class BlockCall:
    """The block, its own forward and arguments, the mode to run, and where to report."""

    module: nn.Module
    forward: Callable[..., Any]  # the block's own forward, never the adaptmem wrapper
    args: tuple
    kwargs: dict
    mode: Mode
    compress: CompressOptions = field(default_factory=CompressOptions)
    offload: OffloadOptions = field(default_factory=OffloadOptions)
    offload_runtime: OffloadRuntime = field(default_factory=OffloadRuntime)
    #: called with True as a recompute begins in backward, with False as it ends
    on_recompute: Callable[[bool], None] | None = None
    #: ``warn_once(key, message)``: logs a message once per instrumented model
    warn_once: Callable[[str, str], None] = _quiet
    #: what the strategy did, for the cost model: bytes handed to the pack hook
    #: ("packed"), left on the device ("on_device"), sent to the host ("host"), and in a step
    #: measured block by block, a checkpoint's "residue" (`measured`).
    stats: dict = field(default_factory=dict)
    #: where `forward` is compiled code (`adaptmem.compile_blocks`): given a checkpoint's
    #: ``context_fn`` (SELECTIVE's op policy, or None), the block's own forward under that
    #: checkpoint, compiled as one function, so the compiler partitions forward and recompute
    compiled_checkpoint: Callable[[Any], Callable[..., Any]] | None = None
    #: a step measured block by block: a checkpoint's forward counts what OFFLOAD would leave on
    #: the device of what the block saves (``stats["residue"]``, `packing.Residue`)
    measured: bool = False
