"""Hot-swappable per-block wrappers: `instrument` and its exact inverse `restore`.

A block is wrapped by setting an instance attribute ``forward`` (the way
accelerate's `add_hook_to_module` does), never by replacing the module: names,
parameters, `state_dict` keys, classes and repr stay as they were, and the
user's own hooks run as before. `restore` deletes the attribute again (or puts
back an instance-level forward that was there first).
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from adaptmem.modes import Mode
from adaptmem.strategies import STRATEGIES, CompressOptions, OffloadOptions
from adaptmem.strategies.recompute import compiled_checkpoint
from adaptmem.wrapping.handles import BlockHandle, BlockRuntime, Instrumentation, checkpoints_itself
from adaptmem.wrapping.head import HeadHandle, HeadSelection, attach_head, detach_head, find_head, likely_head
from adaptmem.wrapping.selection import BlockSelection, find_blocks

log = logging.getLogger("adaptmem")

_ATTR = "_adaptmem_instrumentation"


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside `DistributedDataParallel`, `DataParallel` or `torch.compile`'s wrapper:
    blocks are named relative to it, so `manage(ddp)` and `manage(ddp.module)` agree and
    their state loads into the other."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


class _BlockForward:
    """The instance-level `forward` adaptmem installs on a block."""

    def __init__(self, module: nn.Module, handle: BlockHandle, previous: Callable | None) -> None:
        self._module = weakref.ref(module)
        self._handle = weakref.ref(handle)
        self.previous = previous  # an instance-level forward that was there before us
        self.compiled: Callable[..., Any] | None = None  # the block's own forward, compiled (compile_blocks)
        self.compile_options: dict = {}  # compile_blocks' options, for the compiled checkpoints too
        self.checkpoints: dict = {}  # context_fn -> the forward under that checkpoint, compiled (lazily)
        # a module called more than once in a forward: the handle of each call, in turn (`repeat_calls`)
        self.calls: tuple[weakref.ref, ...] | None = None
        self._epoch = -1  # the runtime's epoch at the calls counted in `_count`
        self._count = 0
        # its calls are counted from each call of the module whose forward runs them (`loop_owner`):
        # a call past its handles is the loop run longer, not a second forward
        self.owned = False

    def original(self, module: nn.Module) -> Callable[..., Any]:
        if self.compiled is not None:
            return self.compiled
        return self.uncompiled(module)

    def compiled_here(self) -> Callable[..., Any] | None:
        """The compiled forward, where compiled code can run: not under a torch dispatch mode
        (the stand-in's, a FLOP counter's), which torch.compile does not trace through (with
        `fullgraph=True` it raises), so there the block runs uncompiled."""
        if self.compiled is None or _get_current_dispatch_mode() is not None:
            return None
        return self.compiled

    def uncompiled(self, module: nn.Module) -> Callable[..., Any]:
        if self.previous is not None:
            return self.previous
        # a partial, not types.MethodType: torch.compile traces through it without a graph break
        return functools.partial(type(module).forward, module)

    def compile(self, module: nn.Module, options: dict) -> None:
        """Compile the block's own forward (compile_blocks); the recomputing modes' checkpoints are
        compiled around it the first time a block runs in each."""
        self.compiled = torch.compile(self.uncompiled(module), **options)
        self.compile_options, self.checkpoints = options, {}

    def drop_compiled(self) -> None:
        self.compiled, self.compile_options, self.checkpoints = None, {}, {}

    def compiled_checkpoint(self, context_fn: Any) -> Callable[..., Any]:
        """The block's own forward under a checkpoint with `context_fn`, compiled as one function
        (`recompute.compiled_checkpoint`), made once per `context_fn`."""
        fn = self.checkpoints.get(context_fn)
        if fn is None:
            fn = compiled_checkpoint(self.uncompiled(self._module()), context_fn, self.compile_options)
            self.checkpoints[context_fn] = fn
        return fn

    def _as_is(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The block's own forward (`original`), called eagerly without binding it first."""
        compiled = self.compiled_here()
        if compiled is not None:
            return compiled(*args, **kwargs)
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._traced(*args, **kwargs)
        module = self._module()
        handle = self._handle()
        if (
            handle is None
            or not (module.training and torch.is_grad_enabled())
            # inside autograd's backward: a checkpoint outside adaptmem (the user's own, around several
            # blocks) is recomputing this block, which runs as it is, unobserved
            or torch._C._current_graph_task_id() != -1
        ):
            return self._as_is(module, args, kwargs)
        if self.calls is not None:
            handle = self.next_call(handle.runtime)
        runtime = handle.runtime
        observer = runtime.observer
        quiet = runtime.quiet
        if quiet is not None and handle.index not in runtime.watched:
            observer = None  # a step read for its peak only: the observer reads this call from `quiet`
        elif observer is not None:
            observer.block_start(handle, args, kwargs)  # may set handle.mode (planning)
            if runtime.quiet is not None and runtime.quiet is not quiet:
                observer, quiet = None, runtime.quiet  # it made the step a light one: this call too
            else:
                quiet = None
        else:
            quiet = None
        mode = handle.mode
        if mode is Mode.NONE and observer is None:
            # nothing to pack, recompute or tell: the block runs as it is, with no `BlockCall` (on 24
            # small blocks a step's host time was 0.1 ms less)
            handle.calls += 1
            if quiet is not None:
                quiet.append((handle.index, mode, _NOTHING))  # before it runs: one that runs out of memory ran
            output = self._as_is(module, args, kwargs)
            runtime.offload.prefetch_when_reached(output)
            if handle.index in runtime.marked:
                runtime.mark(handle.index, output)
            return output
        compiled = self.compiled_here()
        checkpointed = self.compiled_checkpoint if compiled is not None else None
        call = handle.make_call(compiled or self.uncompiled(module), args, kwargs, checkpointed)
        if quiet is not None:
            quiet.append((handle.index, call.mode, call.stats))  # before it runs: one that runs out of memory ran
        output = _run(handle, call)
        if observer is not None:
            observer.block_end(handle, call, output)
        elif handle.index in runtime.marked:
            runtime.mark(handle.index, output)
        return output

    def next_call(self, runtime: BlockRuntime) -> BlockHandle:
        """The handle of this call of a module called more than once a forward: its calls are
        counted from the step's start (the runtime's `epoch`), and take the handles in turn (a
        second forward before the backward starts again from the first)."""
        if self._epoch != runtime.epoch:
            self._epoch, self._count = runtime.epoch, 0
        calls, count = self.calls, self._count
        self._count = count + 1
        if count < len(calls):
            return calls[count]()
        if self.owned:  # the loop runs longer in this forward: the calls past the handles take the last
            handle = calls[-1]()
            runtime.longer[handle.order] = max(count + 1, runtime.longer.get(handle.order, 0))
            runtime.past = handle
            return handle
        return calls[count % len(calls)]()

    def forward_begins(self) -> None:
        """The module whose forward calls this one in a loop is called: its calls count from here."""
        handle = self._handle()
        self._count = 0
        if handle is not None:
            self._epoch = handle.runtime.epoch

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        """A call torch.compile traces (the wrapper inside a compiled model)."""
        module = self._module()
        forward = self.original(module)
        handle = self._handle()
        if handle is None or not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if self.calls is not None:  # counted eagerly: the compiler never traces the count
            handle = _untraced_next_call()(self, handle.runtime)
        runtime = handle.runtime
        observer = runtime.observer
        # the observer is called through `runtime.tell`, which the compiler never traces
        if observer is not None:
            runtime.tell(observer, "block_start", handle, args, kwargs)
        call = handle.make_call(forward, args, kwargs)  # traced: the checkpoint is traced with the rest
        output = _run(handle, call)
        if observer is not None:
            runtime.tell(observer, "block_end", handle, call, output)
        return output

    def belongs_to(self, handle: BlockHandle) -> bool:
        return self._handle() is handle

    # Weak references are copied as-is by `copy`; point them at the copies instead.
    def __deepcopy__(self, memo: dict) -> _BlockForward:
        module, handle = self._module(), self._handle()
        new = _BlockForward.__new__(_BlockForward)
        new_module = memo.get(id(module), module)
        new_handle = copy.deepcopy(handle, memo) if handle is not None else None
        new._module = weakref.ref(new_module)
        new._handle = weakref.ref(new_handle) if new_handle is not None else _dead
        new.previous = copy.deepcopy(self.previous, memo)
        new.drop_compiled()  # compiled code is not copied: compile the copy again
        new.calls, new._epoch, new._count, new.owned = None, -1, 0, False
        if self.calls is not None:
            new.calls = tuple(weakref.ref(copy.deepcopy(ref(), memo)) for ref in self.calls)
        return new

    def __reduce__(self) -> tuple:
        calls = [ref() for ref in self.calls] if self.calls is not None else None
        return (_rebuild_forward, (self._module(), self._handle(), self.previous, calls))


def _run(handle: BlockHandle, call: Any) -> Any:
    """Run `call` in its mode's strategy; a block that offloads nothing starts the copies back of the
    offloaded block before it when backward reaches it."""
    output = STRATEGIES[call.mode](call)
    if not call.mode.offloads:
        call.offload_runtime.prefetch_when_reached(output)
    handle.finished(call)
    return output


#: A call's stats where the block ran as it is (NONE): nothing was packed or sent
_NOTHING: Mapping[str, Any] = MappingProxyType({})


def _dead() -> None:
    """Stands in for a weak reference whose object is gone."""
    return None


def _rebuild_forward(
    module: nn.Module, handle: BlockHandle | None, previous: Callable | None, calls: list | None = None
) -> _BlockForward:
    fwd = _BlockForward.__new__(_BlockForward)
    fwd._module = weakref.ref(module)
    fwd._handle = weakref.ref(handle) if handle is not None else _dead
    fwd.previous = previous
    fwd.drop_compiled()
    fwd.calls = tuple(weakref.ref(h) for h in calls) if calls is not None else None
    fwd._epoch, fwd._count, fwd.owned = -1, 0, False
    return fwd


@functools.cache
def _untraced_next_call() -> Callable[[_BlockForward, BlockRuntime], BlockHandle]:
    """`_BlockForward.next_call` behind `torch.compiler.disable`, made once, as calls get handles of
    their own (`repeat_calls`), not at import (which would load the compiler with adaptmem)."""
    return torch.compiler.disable(_BlockForward.next_call, recursive=True)


def instrument(
    model: nn.Module,
    blocks: BlockSelection = "auto",
    *,
    mode: Mode | str = Mode.NONE,
    compress: CompressOptions | None = None,
    offload: OffloadOptions | None = None,
    head: HeadSelection = "auto",
) -> list[BlockHandle]:
    """Wrap the selected blocks of `model` so each can switch mode on the fly.

    Args:
        model: the model; it is changed in place (and `restore` undoes it).
        blocks: which submodules are blocks; see `adaptmem.wrapping.selection`.
        mode: the mode every block starts in.
        compress: codec options for COMPRESS (per handle afterwards).
        offload: options for OFFLOAD (per handle afterwards).
        head: the loss head to wrap as well ("auto": a Hugging Face language model's output
            projection; a qualified name or an nn.Linear for a model of one's own; None for
            none); see `adaptmem.wrapping.head`. It starts KEPT, which changes nothing;
            `get_head(model).mode = "chunked"` chunks its logits.

    Returns the handles in forward order. Calling it again with the same
    selection returns the same handles; a different selection is an error
    (restore first).
    """
    return _instrument(model, blocks, mode=mode, compress=compress, offload=offload, head=head)


def _instrument(
    model: nn.Module,
    blocks: BlockSelection = "auto",
    *,
    mode: Mode | str = Mode.NONE,
    compress: CompressOptions | None = None,
    offload: OffloadOptions | None = None,
    head: HeadSelection = "auto",
    managed: bool = False,
) -> list[BlockHandle]:
    """`instrument`; `managed`: for a manager, which runs the blocks a model checkpoints itself in
    NONE and says so at the step that finds them (no warning of a recompute twice here)."""
    model = unwrap(model)
    chosen = find_blocks(model, blocks)
    found_head = find_head(model, head)
    existing: Instrumentation | None = model.__dict__.get(_ATTR)
    if found_head is None and head == "auto" and existing is None and (likely := likely_head(model)) is not None:
        log.warning(
            'adaptmem: head="auto" finds a Hugging Face language model\'s loss head, and %s has none; its '
            "%r (as many outputs as %r has rows) looks like one: pass head=%r to have its logits managed "
            "(at long sequences the largest tensor of a step), or head=None to say there is none",
            type(model).__name__,
            likely[0],
            likely[1],
            likely[0],
        )
    if existing is not None:
        if [id(m) for _, m in chosen] == [id(m) for m in existing.modules]:
            return list(existing.handles)
        raise ValueError(
            f"{type(model).__name__} is already instrumented with {len(existing.modules)} blocks "
            f"({_names(existing.primary)}); blocks={blocks!r} selects {len(chosen)} others. "
            "Call adaptmem.restore(model) first to change the selection."
        )
    for name, module in chosen:
        if isinstance(module.__dict__.get("forward"), _BlockForward):
            raise ValueError(
                f"block {name!r} is already instrumented through another model object; "
                "call adaptmem.restore on that model first"
            )
    if found_head is not None and any(found_head[1] is m or _contains(m, found_head[1]) for _, m in chosen):
        raise ValueError(f"head {found_head[0]!r} is inside a selected block; select the blocks without it")
    runtime = BlockRuntime()
    start = Mode.parse(mode)
    handles = [
        BlockHandle(name, module, i, runtime, start, compress or CompressOptions(), offload or OffloadOptions())
        for i, (name, module) in enumerate(chosen)
    ]
    for handle in handles:
        if not managed:
            _warn_if_hf_checkpointing(handle, runtime)
        module = handle.module
        module.__dict__["forward"] = _BlockForward(module, handle, module.__dict__.get("forward"))
    head_handle = attach_head(found_head, runtime) if found_head is not None else None
    model.__dict__[_ATTR] = Instrumentation(handles, runtime, head_handle)
    return list(handles)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def restore(model: nn.Module) -> None:
    """Undo `instrument`: the model looks and behaves exactly as before. A no-op on a plain model."""
    model = unwrap(model)
    inst: Instrumentation | None = model.__dict__.get(_ATTR)
    if inst is None:
        return
    primary = inst.primary
    for handle in primary:  # check everything before changing anything
        current = handle.module.__dict__.get("forward")
        if not (isinstance(current, _BlockForward) and current.belongs_to(handle)):
            raise RuntimeError(
                f"block {handle.name!r}: its forward was replaced after adaptmem.instrument "
                f"(now {current!r}); remove that wrapper first, then call adaptmem.restore"
            )
    if inst.head is not None:
        detach_head(inst.head)
    for handle in primary:
        module = handle.module
        previous = module.__dict__["forward"].previous
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = previous
    inst.runtime.observer = None
    inst.runtime.offload.pool.clear()
    del model.__dict__[_ATTR]


def compile_blocks(model: nn.Module, **compile_options: Any) -> list[BlockHandle]:
    """Compile each block's own forward with `torch.compile(**compile_options)`, the way
    torchtitan compiles per block, and keep adaptmem's wrapper outside the compiled code.

    The wrapper runs eagerly around each compiled block: the manager is never traced,
    and a mode change never recompiles (the compiled forward does not depend on the
    mode), so `fullgraph=True` works in every mode. Call it after `instrument` or
    `manage`; `restore` (or closing the manager that instrumented the model) drops the
    compiled code. Returns the handles.
    """
    inst: Instrumentation | None = unwrap(model).__dict__.get(_ATTR)
    if inst is None:
        raise ValueError(
            f"{type(model).__name__} is not instrumented: call adaptmem.instrument(model) or "
            "adaptmem.manage(model) first, then adaptmem.compile_blocks(model)"
        )
    if getattr(getattr(unwrap(model), "config", None), "use_cache", None) is True:
        log.warning(
            "adaptmem: %s has config.use_cache = True: Hugging Face builds a key/value cache in training "
            "too, which each layer writes under its own index, so each block in NONE compiles its own "
            "code (past 8 blocks torch.compile's recompile limit is reached; with fullgraph=True that "
            "raises). Set model.config.use_cache = False for training",
            type(unwrap(model)).__name__,
        )
    for handle in inst.primary:
        handle.module.__dict__["forward"].compile(handle.module, compile_options)
    return list(inst.handles)


def repeat_calls(model: nn.Module, sequence: list[int] | None) -> list[BlockHandle]:
    """Give each call of a block the model calls more than once in a forward a handle of its own.

    `sequence`: the blocks (by `BlockHandle.order`, their place among those selected) of one
    forward's calls in the order they ran: for ALBERT's one shared layer run 6 times, [0] * 6;
    for a recurrent-depth model's core of blocks 2 and 3 run three times between blocks 0, 1
    and 4, [0, 1, 2, 3, 2, 3, 2, 3, 4]. A block it leaves out keeps one call, in its place.
    None gives every block one handle again. The handles are numbered in the order of the
    calls, a call after the first named `<name>#<call + 1>` and started in its first call's
    mode; returns them all (the instrumentation's from now on)."""
    inst: Instrumentation | None = unwrap(model).__dict__.get(_ATTR)
    if inst is None:
        raise ValueError(f"{type(model).__name__} is not instrumented")
    primary = inst.primary
    if sequence is None:
        sequence = [h.order for h in primary]
    if any(not 0 <= order < len(primary) for order in sequence):
        raise ValueError(f"calls {sequence}: blocks are 0 to {len(primary) - 1}")
    for order in range(len(primary)):  # a block not called there keeps its place
        if order not in sequence:
            later = [i for i, o in enumerate(sequence) if o > order]
            sequence = list(sequence)
            sequence.insert(later[0] if later else len(sequence), order)
    handles: list[BlockHandle] = []
    calls: dict[int, list[BlockHandle]] = {}
    for order in sequence:
        first = primary[order]
        mine = calls.setdefault(order, [])
        if not mine:
            handle = first
        else:
            handle = BlockHandle(
                f"{first.name}#{len(mine) + 1}",
                first.module,
                0,
                first.runtime,
                first.mode,
                first.compress_options,
                first.offload_options,
            )
            handle.order, handle.call = order, len(mine)
        mine.append(handle)
        handles.append(handle)
    for index, handle in enumerate(handles):
        handle.index = index
    for order, mine in calls.items():
        forward = primary[order].module.__dict__["forward"]
        forward.calls = tuple(weakref.ref(h) for h in mine) if len(mine) > 1 else None
        forward._epoch = -1
    if len(handles) > len(primary):
        _untraced_next_call()  # made here, not while torch.compile traces a call
    inst.handles = handles
    return list(handles)


def loop_owner(model: nn.Module, owner: nn.Module, orders: list[int]) -> Callable[[], None]:
    """Count the calls of the blocks `orders` (by `BlockHandle.order`), which `owner`'s forward runs in
    a loop, from each call of `owner`: a second forward, which calls `owner` again, starts again from
    each block's first handle, and a call past a block's handles (the loop run longer than when its
    calls were given handles, `repeat_calls`) takes the last, counted in the runtime's `longer`.
    Without it, calls count from the step's start and take the handles in turn. Returns what undoes it."""
    inst: Instrumentation | None = unwrap(model).__dict__.get(_ATTR)
    if inst is None:
        raise ValueError(f"{type(model).__name__} is not instrumented")
    modules = [weakref.ref(inst.primary[order].module) for order in orders]

    def forwards() -> list[_BlockForward]:
        found = (ref() for ref in modules)
        return [
            m.__dict__["forward"]
            for m in found
            if m is not None and isinstance(m.__dict__.get("forward"), _BlockForward)
        ]

    def begins(module: nn.Module, args: tuple) -> None:
        for forward in forwards():
            forward.forward_begins()

    for forward in forwards():
        forward.owned = True
    hook = owner.register_forward_pre_hook(torch.compiler.disable(begins, recursive=True))

    def undo() -> None:
        hook.remove()
        for forward in forwards():
            forward.owned = False

    return undo


def get_handles(model: nn.Module) -> list[BlockHandle]:
    """The handles of an instrumented model ([] for a plain one)."""
    inst: Instrumentation | None = unwrap(model).__dict__.get(_ATTR)
    return list(inst.handles) if inst is not None else []


def get_head(model: nn.Module) -> HeadHandle | None:
    """The loss head's handle of an instrumented model (None for a plain one, or one without a head)."""
    inst: Instrumentation | None = unwrap(model).__dict__.get(_ATTR)
    return inst.head if inst is not None else None


def get_instrumentation(model: nn.Module) -> Instrumentation | None:
    return unwrap(model).__dict__.get(_ATTR)


def _warn_if_hf_checkpointing(handle: BlockHandle, runtime: BlockRuntime) -> None:
    if checkpoints_itself(handle.module):
        runtime.warn_once(
            "hf-gc",
            f"adaptmem: {handle.name} has Hugging Face gradient checkpointing enabled, so it is "
            "recomputed twice under adaptmem's recompute modes; switch it off "
            "(model.activation_checkpointing_disable(), or model.gradient_checkpointing_disable() in "
            "transformers without it) and let adaptmem decide",
        )


def _names(handles: list[BlockHandle]) -> str:
    names = [h.name for h in handles]
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
