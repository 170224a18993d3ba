"""Finding a model's blocks and wrapping them so each can switch mode on the fly.

  selection.py  which submodules are blocks ("auto", classes, regexes, filters, lists)
  handles.py    BlockHandle (name, module, mode), the shared runtime, the observer interface
  attach.py     instrument / restore: an instance-level forward, attached and detached exactly
  head.py       the loss head: finding the output projection, HeadHandle, chunked logits on demand

The wrapper hands each training call to the strategy of the block's mode
(`adaptmem.strategies`) and tells an observer, if one is set, that the block
started and ended; the observer (the manager) lives in the layer above.
"""

from adaptmem.wrapping.attach import (
    compile_blocks,
    get_handles,
    get_head,
    get_instrumentation,
    instrument,
    loop_owner,
    repeat_calls,
    restore,
    unwrap,
)
from adaptmem.wrapping.handles import (
    BlockHandle,
    BlockObserver,
    BlockRuntime,
    Instrumentation,
    checkpoints_itself,
    tell_observer,
)
from adaptmem.wrapping.head import DEFAULT_CHUNK_TOKENS, HeadHandle, HeadSelection, find_head
from adaptmem.wrapping.selection import BlockSelection, describe_model, find_blocks

__all__ = [
    "BlockHandle",
    "BlockObserver",
    "BlockRuntime",
    "BlockSelection",
    "DEFAULT_CHUNK_TOKENS",
    "HeadHandle",
    "HeadSelection",
    "Instrumentation",
    "checkpoints_itself",
    "compile_blocks",
    "describe_model",
    "find_blocks",
    "find_head",
    "get_handles",
    "get_head",
    "get_instrumentation",
    "instrument",
    "loop_owner",
    "repeat_calls",
    "restore",
    "tell_observer",
    "unwrap",
]
