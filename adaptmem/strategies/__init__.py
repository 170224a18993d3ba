"""Ways of treating a block's saved activations: one strategy per `Mode`, in a table.

A strategy runs one block call in training, ``STRATEGIES[mode](call) -> output``
(no if/elif ladder). Modules:

  call.py       BlockCall: what a strategy is given and reports through
  payloads.py   Payload: a saved tensor in another form that restores itself
  packing.py    Packer: the one pack hook of OFFLOAD / COMPRESS (and combinations)
  recompute.py  CHECKPOINT, CHECKPOINT|OFFLOAD, and the checkpoint SELECTIVE runs in
  selective.py  SELECTIVE: weight layers' outputs held in forward, answered in the recompute
  offload.py    OffloadOptions, HostCopy, the host tier, prefetch order (PackGroup)
  cuda_offload.py  the CUDA tier: side streams, events, the window of copies in flight
  offload_runtime.py  OffloadRuntime: the host tier or a CUDA tier per device; the prefetch a block that
                      offloads nothing starts for the offloaded one before it
  pinned.py     the reusable pinned-buffer pool of the CUDA tier
  compress.py   int8 / fp8 / bf16 codecs, boolean bit-packing
  head.py       the loss head chunked: ChunkedLogits, logits that are never made whole
  chunked_loss.py  the fused linear cross-entropy ChunkedLogits hands the loss to, chunk by chunk
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaptmem.modes import Mode
from adaptmem.strategies.call import BlockCall
from adaptmem.strategies.compress import CompressOptions
from adaptmem.strategies.offload import OffloadOptions
from adaptmem.strategies.offload_runtime import OffloadRuntime
from adaptmem.strategies.packing import Packer
from adaptmem.strategies.recompute import (
    run_checkpoint,
    run_checkpoint_offloaded_input,
    run_selective,
)

__all__ = ["STRATEGIES", "BlockCall", "CompressOptions", "OffloadOptions", "OffloadRuntime"]


def run_plain(call: BlockCall) -> Any:
    return call.forward(*call.args, **call.kwargs)


def _run_packed(call: BlockCall, *, compress: bool, offload: bool) -> Any:
    packer = Packer(
        call.module,
        compress=call.compress if compress else None,
        offload=call.offload if offload else None,
        runtime=call.offload_runtime,
        stats=call.stats,
    )
    with packer.installed():
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
