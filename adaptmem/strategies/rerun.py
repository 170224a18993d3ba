"""A non-reentrant checkpoint with little host work per saved tensor.

What it does is what ``torch.utils.checkpoint(..., use_reentrant=False)`` does:
forward builds the block's graph as usual, but every tensor autograd saves is
replaced by a holder; the first holder backward unpacks reruns the block (the
RNG and autocast state of forward restored, grad enabled), fills every holder
still alive in the order forward saved them, and stops the rerun once the last
is filled. The gradients are the ones the block's forward gives, bit for bit.

Where the step is bound by the host launching work (a GPU at batch 1, small
tensors on a CPU), PyTorch's checkpoint costs more than the recompute itself:
per saved tensor it builds a holder, a weak reference and a metadata record in
forward, and in backward looks up the graph task, a handle and two
dictionaries, through wrappers that switch the compiler off. Here a saved
tensor costs a holder and a weak reference in forward and a slot read in
backward; the only check kept is the one that catches a rerun that differs from
forward (a tensor of another shape or dtype, or fewer tensors saved).

Not covered, and left to PyTorch's checkpoint by the caller: code being compiled
(`torch.compile` traces PyTorch's), and a context function (SELECTIVE's op
policy under the compiler).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError, get_device_states, set_device_states

try:  # the device a `with torch.device(...)` block set, kept for the rerun as PyTorch does
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
except ImportError:  # pragma: no cover - older torch
    _get_current_function_mode_stack = None
    DeviceContext = None


class Stop(Exception):
    """Raised from the rerun's pack hook once the last holder is filled."""


class _Holder:
    """Stands in for one saved tensor: its shape and dtype from forward, and the value a rerun found."""

    __slots__ = ("shape", "dtype", "value", "__weakref__")

    def __init__(self, x: torch.Tensor) -> None:
        self.shape = x.shape
        self.dtype = x.dtype
        self.value: torch.Tensor | None = None


class _Inputs(torch.autograd.Function):
    """Saves the block's tensor arguments through autograd's saved tensors, so a pack hook
    around the checkpoint (CHECKPOINT | OFFLOAD's) sees them; its output is never used."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - nothing depends on its output
        raise AssertionError("the checkpoint's input saver has no gradient")


_outside_backward = itertools.count(-2, -1)  # a graph task id for an unpack outside any backward


class _Frame:
    """One forward of one checkpointed block: what its rerun needs, and the holders it fills."""

    __slots__ = ("fn", "args", "positions", "saver", "holders", "task", "count", "state", "recording", "__weakref__")

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn = fn
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.holders: list[weakref.ref] = []
        self.task: int | None = None  # the graph task whose rerun filled the holders
        self.count = 0
        self.state = _State(args)
        self.recording: list | None = None  # forward's saved tensors, while a caller listens (SELECTIVE)

    def pack(self, x: torch.Tensor) -> _Holder:
        holder = _Holder(x)
        self.holders.append(weakref.ref(holder))
        if self.recording is not None:
            self.recording.append(x)
        return holder

    def noting(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int, list | None]:
        """``fn(*args, **kwargs)`` in forward, with the tensors it saves through this frame listed:
        (its result, the count saved before it, the list), the list None where another hook is
        the innermost or a call outside is listing already."""
        start = len(self.holders)
        if self.recording is not None or not self.innermost():
            return fn(*args, **kwargs), start, None
        self.recording = []
        try:
            out = fn(*args, **kwargs)
        finally:
            saved, self.recording = self.recording, None
        return out, start, saved

    def innermost(self) -> bool:
        """This frame's hooks are the ones autograd saves through now (no hook inside it, such as
        a checkpoint of PyTorch's that the block runs): what the block saves comes to this frame."""
        try:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        except (AttributeError, RuntimeError):  # pragma: no cover - an older torch
            return False
        return top is not None and getattr(top[0], "__self__", None) is self

    def unpack(self, holder: _Holder) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task == -1:
            task = next(_outside_backward)
        if task != self.task or holder.value is None:
            self._rerun(task)
        value = holder.value
        if value is None:
            raise CheckpointError(
                "adaptmem: a checkpointed block saved fewer tensors for backward in its recompute than in "
                f"forward ({self.count} of {len(self.holders)}): its forward must run the same ops when run "
                "again (no data-dependent branches, no state changed between the two runs); leave that "
                "block out of the recomputing modes"
            )
        holder.value = None  # the node that unpacks it holds it from here; a second unpack reruns
        return value

    def _rerun(self, task: int) -> None:
        self.task = task
        self.count = 0
        if not self.holders:
            return
        args = list(self.args)
        for i, t in zip(self.positions, self.saver.grad_fn.saved_tensors):
            args[i] = t
        outer = running()
        _running.frame = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.refill, _same), torch.enable_grad():
                self.state.rerun(self.fn, args)
        except Stop:
            pass
        finally:
            _running.frame = outer

    def refill(self, x: torch.Tensor) -> torch.Tensor:
        """The rerun's pack hook: `x` fills the next holder still alive; `Stop` after the last.
        SELECTIVE calls it too, handing over what a layer it does not run saved in forward."""
        # Detached: a saved output packed as itself would hold the node that saved it (a cycle
        # through C++ that no collector frees, and the rerun's graph with it).
        x = x.detach() if x.requires_grad else x
        i = self.count
        self.count = i + 1
        holder = self.holders[i]()
        if holder is not None:
            if x.shape != holder.shape or x.dtype != holder.dtype:
                module = getattr(self.fn, "module", None)
                block = f" ({type(module).__name__})" if module is not None else ""
                raise CheckpointError(
                    f"adaptmem: a checkpointed block's{block} recompute saved a tensor of shape {tuple(x.shape)} "
                    f"and {x.dtype} where forward saved {tuple(holder.shape)} and {holder.dtype} (saved tensor {i}): "
                    "its forward must run the same ops when run again (no branch on data or on state that "
                    "changes between the two runs, and a context such as an attention backend held around "
                    "backward too). A model that keeps a cache or a state on its layers while its config's "
                    "use_cache is on does so: set model.config.use_cache = False for training. Otherwise "
                    "leave the block out of the recomputing modes: a policy without SELECTIVE and CHECKPOINT "
                    '(adaptmem.Policy(modes=("NONE", "OFFLOAD"))), or the block out of blocks='
                )
            holder.value = x
        if i + 1 == len(self.holders):
            raise Stop
        return x


def _same(x: Any) -> Any:
    return x


#: The frame whose block runs in this thread (its forward, or its rerun), for SELECTIVE's layers.
_running = threading.local()


def running() -> _Frame | None:
    """The checkpoint frame of the block running in this thread, or None."""
    return getattr(_running, "frame", None)


class _State:
    """The RNG, autocast and default-device state of forward, put back for the rerun."""

    __slots__ = ("device_type", "cpu_rng", "devices", "device_rng", "autocast", "cpu_autocast", "device_ctx")

    def __init__(self, args: tuple) -> None:
        self.device_type = _device_type(args)
        module = getattr(torch, self.device_type, None)
        self.cpu_rng = torch.get_rng_state()
        self.devices: list[int] = []
        self.device_rng: list[torch.Tensor] = []
        if getattr(module, "_initialized", False):
            self.devices, self.device_rng = get_device_states(*args)
        cache = torch.is_autocast_cache_enabled()
        self.autocast = None
        if torch.amp.is_autocast_available(self.device_type):
            self.autocast = dict(
                enabled=torch.is_autocast_enabled(self.device_type),
                dtype=torch.get_autocast_dtype(self.device_type),
                cache_enabled=cache,
            )
        self.cpu_autocast = dict(
            enabled=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu"), cache_enabled=cache
        )
        self.device_ctx = None
        if _get_current_function_mode_stack is not None:
            modes = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceContext)]
            self.device_ctx = modes[-1] if modes else None

    def rerun(self, fn: Any, args: list) -> None:
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            autocast = (
                torch.amp.autocast(self.device_type, **self.autocast)
                if self.autocast is not None
                else contextlib.nullcontext()
            )
            device = self.device_ctx if self.device_ctx is not None else contextlib.nullcontext()
            with autocast, torch.amp.autocast("cpu", **self.cpu_autocast), device:
                fn(*args)


def _device_type(args: tuple) -> str:
    """The device whose RNG and autocast state the rerun restores, as PyTorch's checkpoint picks
    it: CUDA where any argument is there, else the first other accelerator's, else the default."""
    kinds = [a.device.type for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
    if "cuda" in kinds:
        return "cuda"
    if kinds:
        return kinds[0]
    return torch.utils.checkpoint.DefaultDeviceType.get_device_type()


def checkpoint(fn: Any, *args: Any, saw: Any = None) -> Any:
    """``fn(*args)`` with what it saves for backward recomputed in backward (see the module).
    Tensors are looked for among `args` themselves, not inside containers, as the block
    wrapper hands them (tensor keyword arguments positionally). `saw`, where given, is
    called with each tensor forward saves (`packing.Residue`)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    frame = _Frame(fn, args)
    tensors = [args[i] for i in frame.positions]
    frame.saver = _Inputs.apply(torch.empty((0,), requires_grad=True), *tensors)
    outer = running()
    _running.frame = frame
    pack = frame.pack
    if saw is not None:

        def pack(x: torch.Tensor) -> _Holder:
            saw(x)
            return frame.pack(x)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, frame.unpack):
            return fn(*args)
    finally:
        _running.frame = outer
