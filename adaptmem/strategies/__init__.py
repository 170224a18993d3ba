"""One strategy per `Mode`, looked up in a table (no if/elif ladder).

A strategy runs one block call in training: ``strategy(call) -> output``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from adaptmem.modes import Mode
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import OffloadOptions
from adaptmem.strategies.recompute import (
    run_checkpoint,
    run_checkpoint_offloaded_input,
    run_selective,
)
from adaptmem.strategies.saved import Packer, restore

if TYPE_CHECKING:
    from adaptmem.wrap import BlockHandle, BlockRuntime

__all__ = ["BlockCall", "STRATEGIES", "CompressOptions", "OffloadOptions"]


@dataclass
class BlockCall:
    """One forward call of a managed block, as a strategy sees it."""

    handle: "BlockHandle"
    forward: Callable[..., Any]  # the block's own forward, never the adaptmem wrapper
    args: tuple
    kwargs: dict
    runtime: "BlockRuntime"
    mode: Mode
    #: what the strategy did, for the cost model: bytes handed to the pack hook
    #: ("packed"), kept on the device ("kept"), sent to the host ("host").
    stats: dict = field(default_factory=dict)


def run_plain(call: BlockCall) -> Any:
    return call.forward(*call.args, **call.kwargs)


def _run_packed(call: BlockCall, *, compress: bool, offload: bool) -> Any:
    handle = call.handle
    packer = Packer(
        handle.module,
        compress=handle.compress_options if compress else None,
        offload=handle.offload_options if offload else None,
        runtime=call.runtime.offload,
        stats=call.stats,
    )
    with torch.autograd.graph.saved_tensors_hooks(packer, restore):
        return call.forward(*call.args, **call.kwargs)


def run_offload(call: BlockCall) -> Any:
    return _run_packed(call, compress=False, offload=True)


def run_compress(call: BlockCall) -> Any:
    return _run_packed(call, compress=True, offload=False)


def run_compress_offload(call: BlockCall) -> Any:
    return _run_packed(call, compress=True, offload=True)


STRATEGIES: dict[Mode, Callable[[BlockCall], Any]] = {
    Mode.NONE: run_plain,
    Mode.SELECTIVE: run_selective,
    Mode.CHECKPOINT: run_checkpoint,
    Mode.OFFLOAD: run_offload,
    Mode.COMPRESS: run_compress,
    Mode.CHECKPOINT | Mode.OFFLOAD: run_checkpoint_offloaded_input,
    Mode.COMPRESS | Mode.OFFLOAD: run_compress_offload,
}
