"""Handles: one per managed block, and what the blocks of one model share.

Ownership is one-way so that no reference cycle keeps a model's memory alive
after the user drops it: the root model holds the `Instrumentation`, which
holds the handles, which hold their modules; a block's wrapper holds its module
and handle only weakly, and the runtime holds its observer (the manager)
weakly, so a manager nobody holds is not kept alive by the model it watches.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from adaptmem.modes import Mode
from adaptmem.strategies import BlockCall, CompressOptions, OffloadOptions, OffloadRuntime

log = logging.getLogger("adaptmem")


class BlockObserver(Protocol):
    """Who watches managed blocks run in training (the memory manager)."""

    def block_start(self, handle: BlockHandle, args: tuple, kwargs: dict) -> None: ...

    def block_end(self, handle: BlockHandle, call: BlockCall, output: Any) -> None: ...

    def recompute(self, handle: BlockHandle, begin: bool) -> None: ...


def tell_observer(observer: BlockObserver, event: str, *args: Any) -> None:
    """Call the observer's `event` method. A manager replaces it, on its model's runtime, by a
    version torch.compile never traces (`torch.compiler.disable`): the controller, the planner
    and the recorder run eagerly, between the compiled pieces of a block."""
    getattr(observer, event)(*args)


class BlockRuntime:
    """What the blocks of one instrumented model share: offload tiers, the observer, warnings said."""

    def __init__(self) -> None:
        self.offload = OffloadRuntime()
        self._observer: Callable[[], BlockObserver | None] = _nobody
        self.tell: Callable[..., None] = tell_observer
        self._warned: set[str] = set()
        # a step read for its peak only: the blocks not in `watched` append (index, mode, stats) of
        # each call to `quiet` in place of calling the observer, which reads the list when it needs
        # to (None: every block calls it)
        self.quiet: list[tuple[int, Mode, dict]] | None = None
        self.watched: frozenset[int] = frozenset()
        # in such a step, the blocks (indices) that give their output to `mark` after they run
        self.marked: frozenset[int] = frozenset()
        self.mark: Callable[[int, Any], None] = _ignore
        # counts the steps begun (the manager's): a block called more than once in a forward counts its
        # calls from there, and takes the handle of each call in turn (`repeat_calls`)
        self.epoch = 0
        # a loop run longer than when its calls were given handles (`loop_owner`): the most calls of
        # each such block (by its order) in one forward since `longer` was last cleared
        self.longer: dict[int, int] = {}
        self.past: BlockHandle | None = None  # the handle a call past them took, until the observer sees it
        self.measuring = False  # the step is measured block by block (the observer's): `BlockCall.measured`

    @property
    def observer(self) -> BlockObserver | None:
        return self._observer()

    @observer.setter
    def observer(self, value: BlockObserver | None) -> None:
        self._observer = _nobody if value is None else weakref.ref(value)
        if value is None:
            self.tell = tell_observer

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def __deepcopy__(self, memo: dict) -> BlockRuntime:
        return BlockRuntime()  # the observer belongs to whoever manages the original

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def _nobody() -> None:
    return None


def _ignore(index: int, output: Any) -> None:
    return None


class BlockHandle:
    """One managed block: its qualified name, the module, and the mode it runs in.

    Setting `mode` takes effect at the block's next forward, also in the middle
    of a model's forward for blocks that have not run yet. Tensors saved under
    the previous mode still restore correctly.

    A block whose module the model calls more than once in one forward (shared layers:
    ALBERT's one layer, a recurrent-depth model's core) has one handle per call, with its
    own mode and index (its place among the calls of a forward; `order` is the module's
    among the blocks selected): `call` is which call of the module it is (0 for the first), and
    its `name` is the module's with `#<call + 1>` after it from the second call on.

    Counters, for the curious and for tests that a mode really ran: `calls`
    (forwards on the managed path), `recomputes` (recomputes finished in
    backward), `packed_bytes` (bytes handed to a pack hook), `host_bytes` (of
    those, sent to the host). Calls traced by torch.compile are not counted.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        index: int,
        runtime: BlockRuntime,
        mode: Mode,
        compress: CompressOptions,
        offload: OffloadOptions,
    ) -> None:
        self.name = name
        self.module = module
        self.index = index
        self.order = index  # the module's place among the blocks selected (`index` counts calls)
        self.runtime = runtime
        self._mode = Mode.parse(mode)
        self.compress_options = compress
        self.offload_options = offload
        self.calls = 0
        self.recomputes = 0
        self.packed_bytes = 0
        self.host_bytes = 0
        self.call = 0

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, value: Mode | str) -> None:
        self._mode = Mode.parse(value)

    def make_call(
        self,
        forward: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        compiled_checkpoint: Callable[[Any], Callable[..., Any]] | None = None,
    ) -> BlockCall:
        """The strategy's view of one forward call of this block, in its current mode."""
        if not torch.compiler.is_compiling():  # a counter torch.compile would guard on, recompiling each step
            self.calls += 1
        return BlockCall(
            self.module,
            forward,
            args,
            kwargs,
            self._mode,
            self.compress_options,
            self.offload_options,
            self.runtime.offload,
            on_recompute=_RecomputeListener(self),
            warn_once=self.runtime.warn_once,
            compiled_checkpoint=compiled_checkpoint,
            measured=self.runtime.measuring,
        )

    def finished(self, call: BlockCall) -> None:
        if torch.compiler.is_compiling():
            return
        self.packed_bytes += call.stats.get("packed", 0)
        self.host_bytes += call.stats.get("host", 0)

    def __repr__(self) -> str:
        return f"BlockHandle(name={self.name!r}, mode={self._mode.label}, module={type(self.module).__name__})"


def checkpoints_itself(module: nn.Module) -> bool:
    """The model's own gradient checkpointing (Hugging Face's `gradient_checkpointing`) is on for it.
    Read from the instance, then its class: a missing attribute through `nn.Module.__getattr__`
    raises and is caught, about 1 us a block at every step."""
    flag = module.__dict__.get("gradient_checkpointing")
    if flag is None:
        flag = getattr(type(module), "gradient_checkpointing", False)
    return flag is True


class _RecomputeListener:
    """Counts a block's recomputes and tells the observer (if any) when one begins and ends."""

    __slots__ = ("handle",)

    def __init__(self, handle: BlockHandle) -> None:
        self.handle = handle

    def __call__(self, begin: bool) -> None:
        handle = self.handle
        if not begin:
            handle.recomputes += 1
        observer = handle.runtime.observer
        if observer is not None:
            handle.runtime.tell(observer, "recompute", handle, begin)


class Instrumentation:
    """The record `instrument` keeps on a root model; `restore` removes it."""

    def __init__(self, handles: list[BlockHandle], runtime: BlockRuntime, head: Any = None) -> None:
        self.handles = handles
        self.runtime = runtime
        self.head = head  # the loss head's HeadHandle, or None

    @property
    def primary(self) -> list[BlockHandle]:
        """The handles of the modules' first calls, in the order the blocks were selected."""
        return sorted((h for h in self.handles if h.call == 0), key=lambda h: h.order)

    @property
    def modules(self) -> list[nn.Module]:
        """The blocks' modules, each once, in the order they were selected."""
        return [h.module for h in self.primary]
