"""SELECTIVE: a checkpoint that holds the weight layers' outputs and recomputes the rest.

What to drop is chosen by bytes freed per FLOP of recompute. A weight layer (a
linear layer, a convolution) costs ``2 * inputs`` FLOPs per element of its
output, 512 to 11,000 in a transformer: its output is held. Everything else in a
block is pointwise or nearly (norms, activation functions, the gated MLP's
product, rotary embeddings, the copies that reshape heads), or, for attention
written out, ``2 * head_dim`` per element of the seq x seq scores: it is
recomputed. So is a weight layer under `MIN_FLOPS_PER_ELEMENT` (a depthwise
convolution, a LoRA up-projection), which is bound by memory traffic as the
pointwise ops are. In a Llama block that frees the norms' outputs, the MLP's
activation and product, and the attention's rotated inputs, output and scores:
about half of what the block saves, for a recompute of its pointwise work and
attention core.

It is done by structure, not op by op. The block runs under the same
non-reentrant checkpoint as CHECKPOINT. In forward, each weight layer
(`nn.Linear`, `nn.Conv1d/2d/3d` and the transposed kinds, or a subclass with
their forward; Hugging Face's `Conv1D`) has its output held, and what it saves
for backward is noted (`Recipe`): views of its input (flattened, or as it is)
and of its weights. In the recompute the layer does not run: the checkpoint
(adaptmem's own, `rerun`) is handed those views, rebuilt on the recomputed
input with forward's sizes, strides and offsets, and the held output stands for
the layer's, so backward is the one NONE runs, bit for bit, and no Python runs
per op. Fused attention is held the same way: its queries, keys and values are
views of its arguments, its output and log-sum-exp its own (held). Where a
layer saved anything else (its weight cast under autocast), has a forward set
on the instance, or saves through hooks of its own, it runs its forward under a
dispatch mode that answers its one weight op (``mm``, ``addmm``,
``convolution``) with the held output instead: autograd records the same node
over the same recomputed input. An attention that saved anything else (keys
repeated for grouped heads) is held through a dispatch mode from the block's
next forward on. PyTorch's selective
checkpointing ran a dispatch mode over every op of the block, forward and
recompute, and cost more than a full checkpoint at batch 1 on a GPU; it is
still what runs under `torch.compile`, where the compiler applies the op policy
once (`recompute.selective_policy`).

Not held: the block's last weight-layer call until a recompute runs through it
(the checkpoint's early stop ends the recompute once the last saved tensor is
back, before a Llama block's MLP down projection runs), and a layer whose
output something changes in place after forward (its version counter tells;
the recompute runs it). A second backward (retain_graph, create_graph)
recomputes with every weight layer run: exact, as CHECKPOINT is.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from adaptmem.registrations import listed, registrations
from adaptmem.strategies import rerun

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default: 0, _aten.addmm.default: 1}  # op -> index of its first matrix argument
_CONVOLUTION = _aten.convolution.default
_CONVOLUTIONS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


#: A weight layer's output is held when recomputing it costs at least this many FLOPs per element
#: (a linear layer of 256 inputs or more): below it a matmul is bound by memory traffic, as the
#: pointwise ops are, and is recomputed with them (a depthwise convolution, a LoRA up-projection).
MIN_FLOPS_PER_ELEMENT = 512


def flops_per_element(module: nn.Module) -> int | None:
    """FLOPs of a weight layer's forward per element of its output (one multiply-add is two),
    or None for a module that is not a weight layer. A subclass counts only with the forward
    of its base: one with a forward of its own (a quantized linear layer) may run other ops."""
    kind = type(module)
    if isinstance(module, nn.Linear) and kind.forward is nn.Linear.forward:
        return 2 * module.in_features
    base = next((c for c in _CONVOLUTIONS if isinstance(module, c)), None)
    if base is not None and kind.forward is base.forward:
        taps = math.prod(module.kernel_size) * module.in_channels // module.groups
        if module.transposed:
            taps //= math.prod(module.stride)
        return 2 * max(taps, 1)
    if kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers"):  # GPT-2's linear layer
        return 2 * module.weight.shape[0]
    return None


def keeps_output(module: nn.Module) -> bool:
    """SELECTIVE holds this module's output: a weight layer dear enough to recompute."""
    flops = flops_per_element(module)
    return flops is not None and flops >= MIN_FLOPS_PER_ELEMENT


#: The share of the held outputs' FLOPs SELECTIVE may spend recomputing some of them instead:
#: those that free the most bytes per FLOP (fewest FLOPs per byte, the larger first) while it
#: lasts. None by default: a weight layer's output costs hundreds of FLOPs an element to
#: recompute, and where the step is bound by memory traffic (a GPU's, a CPU's) the pointwise
#: work SELECTIVE recomputes already costs what the target allows. At 0.15, a Llama block
#: of hidden 512 at 512 tokens leaves its query and key projections to the recompute:
#: on the CPU's Llama at batch 4 x 512 that held 53.0% of NONE's peak at 1.08x its step,
#: none 59.5% at 1.04x; on an H200 at batch 4 x 2048, 50.4% at 1.16x to 1.22x, none 55.3%
#: at 1.12x (`python -m stress.bench_modes --selective-share 0.15`).
RECOMPUTE_SHARE = 0.0


def resolve_ops(names: tuple[str, ...]) -> frozenset:
    """The aten ops named ``packet.overload`` that this build of torch has."""
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


#: Fused attention's ops, whose outputs SELECTIVE holds (eager) or keeps (compiled: `recompute.SAVED_OPS`).
ATTENTION_OPS = resolve_ops(
    (
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_fused_attention_overrideable.default",
        "_flash_attention_forward.default",
        "_efficient_attention_forward.default",
    )
)
_SDPA_DROPOUT = 4  # dropout_p's position in scaled_dot_product_attention's arguments
ATTENTION = "attention"  # the owner of fused attention calls in a block's keys


class Held:
    """What a weight layer or a fused attention returned in forward, held for the recompute."""

    __slots__ = ("values", "version", "nbytes", "flops", "recipe")

    def __init__(self, values: tuple, flops: int, recipe: Recipe | None = None) -> None:
        self.values = values  # a layer: (output,); an attention: its op's outputs
        self.version = values[0]._version
        self.nbytes = sum(v.nbytes for v in values if isinstance(v, torch.Tensor))
        self.nbytes += recipe.nbytes if recipe is not None else 0  # what its recipe keeps of the call's own
        self.flops = flops
        self.recipe = recipe

    @property
    def spoiled(self) -> bool:
        """Changed in place after forward: not what the recompute needs."""
        return self.values[0]._version != self.version


class Recipe:
    """How to give the checkpoint what a held call saved in forward without running it again.
    Each saved tensor is one of:

    - a view of one of the call's tensor arguments (a layer's input, flattened or as it is;
      attention's queries, keys and values): rebuilt on the recomputed argument with forward's
      size, strides and offset;
    - a view of the call's output (fused attention saves its own): rebuilt on the held output;
    - a view of one of a layer's weights, or a small tensor of the call's own (attention's
      log-sum-exp, its random seeds): kept as it is, detached.

    `start` is the count of tensors the block had saved before the call, which the recompute
    must have refilled when it comes to it, and `inputs` the arguments' layouts, which the
    recomputed ones must have."""

    __slots__ = ("start", "inputs", "parts", "nbytes")

    def __init__(self, start: int, inputs: list[tuple], parts: list, nbytes: int = 0) -> None:
        self.start, self.inputs, self.parts = start, inputs, parts
        self.nbytes = nbytes  # what the kept tensors of the call's own hold (weights' views hold nothing)

    @staticmethod
    def of(
        start: int,
        saved: list[torch.Tensor],
        inputs: list[torch.Tensor],
        *,
        weights: frozenset = frozenset(),
        out: torch.Tensor | None = None,
        spare: int = 0,
    ) -> Recipe | None:
        """The recipe for `saved` (what the call saved, in order), or None where a saved tensor is
        none of those (a weight cast under autocast, keys repeated for grouped heads): `weights`,
        the storages whose views are kept; `spare`, the bytes of other tensors that may be kept."""
        storages = [a.untyped_storage().data_ptr() for a in inputs]
        output = out.untyped_storage().data_ptr() if out is not None else None
        parts: list = []
        kept = 0
        for t in saved:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in storages and t.dtype == inputs[storages.index(ptr)].dtype:
                parts.append((storages.index(ptr), t.size(), t.stride(), t.storage_offset()))
            elif ptr == output and t.dtype == out.dtype:
                parts.append((None, t.size(), t.stride(), t.storage_offset()))
            elif ptr in weights:
                parts.append(t.detach())
            elif kept + storage.nbytes() <= spare:  # its whole storage stays: what counts
                kept += storage.nbytes()
                parts.append(t.detach())
            else:
                return None
        return Recipe(start, [_layout(a) for a in inputs], parts, kept)

    def give(self, frame: Any, inputs: list[torch.Tensor], out: torch.Tensor | None = None) -> bool:
        """In the recompute: hand the checkpoint the call's saved tensors, rebuilt on `inputs` and
        the held `out`; False (nothing given) where the recompute is not where forward was."""
        if frame.count != self.start or [_layout(a) for a in inputs] != self.inputs:
            return False
        for part in self.parts:  # the last one may end the recompute (`rerun.Stop`)
            if isinstance(part, torch.Tensor):
                frame.refill(part)
            else:
                base = out if part[0] is None else inputs[part[0]]
                frame.refill(base.as_strided(*part[1:]))
        return True


def _tensors(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """A call's tensor arguments, positional then keyword, in order."""
    found = [a for a in args if isinstance(a, torch.Tensor)]
    return found + [v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)]


def _layout(t: torch.Tensor) -> tuple:
    return t.size(), t.stride(), t.storage_offset(), t.dtype


class BlockLayers:
    """What SELECTIVE knows of one block, learned across its calls: its weight layers (listed
    again after a module is registered into the block); the layers whose output something changes in place
    after forward (not held: the recompute runs them); the calls left to the recompute by
    `RECOMPUTE_SHARE` (decided at the first forward); and the calls the recompute never
    finishes, because the checkpoint's early stop ends it when the last saved tensor is back
    (not held either: a Llama block's MLP down projection). The block's last held call is
    presumed such a call until a recompute runs through it."""

    __slots__ = ("layers", "registrations", "spoiled", "unneeded", "dropped", "attention_by_dispatch")

    def __init__(self) -> None:
        self.attention_by_dispatch = False  # its fused attention saved what no `Recipe` rebuilds
        self.layers: list[nn.Module] = []
        self.registrations = -1
        self.spoiled: set[nn.Module] = set()
        self.unneeded: set[tuple[Any, int]] | None = None  # None: not yet seen a forward
        self.dropped: set[tuple[Any, int]] = set()

    def of(self, block: nn.Module) -> list[nn.Module]:
        if self.registrations != registrations():
            modules, self.registrations = listed(block)
            self.layers = [m for m in modules if keeps_output(m)]
        return self.layers

    def holds(self, key: tuple[Any, int]) -> bool:
        return not (self.unneeded is not None and key in self.unneeded) and key not in self.dropped

    def choose(self, held: dict[tuple[Any, int], Held]) -> None:
        """At the first forward: the last call presumed unneeded, and what `RECOMPUTE_SHARE` leaves
        to the recompute, the calls that free the most bytes per FLOP first."""
        last = next(reversed(held), None)
        self.unneeded = set() if last is None else {last}
        allowance = RECOMPUTE_SHARE * sum(h.flops for k, h in held.items() if k != last)
        spent = 0
        for key, h in sorted(held.items(), key=lambda kv: (kv[1].flops / max(kv[1].nbytes, 1), -kv[1].nbytes)):
            if key != last and spent + h.flops <= allowance:
                self.dropped.add(key)
                spent += h.flops


_BLOCKS: weakref.WeakKeyDictionary[nn.Module, BlockLayers] = weakref.WeakKeyDictionary()


def block_layers(block: nn.Module) -> BlockLayers:
    known = _BLOCKS.get(block)
    if known is None:
        known = _BLOCKS[block] = BlockLayers()
    return known


class SelectiveRun:
    """What a SELECTIVE block's checkpoint runs around each run of the block: the weight
    layers' outputs, and fused attention's, held in forward and answered in the recompute.
    Holds them and the block's `BlockLayers`, never the call's arguments.

    Fused attention is reached through `torch.nn.functional.scaled_dot_product_attention`,
    which routes each thread's calls to the block running there while any runs (`_Routing`):
    a model that calls it through that attribute (Hugging Face's SDPA attention, nanoGPT) has
    it held; one that imported the function itself has it recomputed. Attention with dropout
    is recomputed: the recompute must draw the random numbers forward drew, in order."""

    __slots__ = ("known", "layers", "outputs", "calls", "finished")

    def __init__(self, block: nn.Module) -> None:
        self.known = block_layers(block)
        self.layers = [m for m in self.known.of(block) if m not in self.known.spoiled]
        self.outputs: dict[tuple[Any, int], Held] = {}
        self.calls: dict[Any, int] = {}  # calls of each layer, and of attention, in this run of the block
        self.finished: set[tuple[Any, int]] = set()  # calls a recompute ran through

    def around(self, recompute: bool, run: Any) -> Any:
        layers = self.layers
        own = [layer.__dict__.get("forward") for layer in layers]  # a forward set on the instance, kept
        self.calls = {}
        for layer in layers:
            layer.forward = (self._answering if recompute else self._holding)(layer, layer.forward)
        previous = _route_attention(self._answered_attention if recompute else self._held_attention)
        try:
            return run() if recompute else self._first(run)
        finally:
            _unroute_attention(previous)
            for layer, forward in zip(layers, own):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward
            if recompute:
                self._learn()

    def _first(self, run: Any) -> Any:
        out = run()
        known = self.known
        if known.unneeded is None:
            known.choose(self.outputs)
            for key in [k for k in self.outputs if not known.holds(k)]:
                del self.outputs[key]
        return out

    def _learn(self) -> None:
        """After a recompute: calls held but never run through are not needed; calls run through
        that were left unheld as unneeded (or are new) are."""
        unneeded = self.known.unneeded
        if unneeded is None:
            return
        unneeded.difference_update(self.finished)
        unneeded.update(k for k in self.outputs if k not in self.finished)
        self.outputs.clear()  # a second recompute (a second backward) runs everything

    def _key(self, owner: Any) -> tuple[Any, int]:
        n = self.calls.get(owner, 0)
        self.calls[owner] = n + 1
        return owner, n

    def _holding(self, layer: nn.Module, forward: Any) -> Any:
        own = "forward" in layer.__dict__  # a forward set on the instance runs in the recompute too

        def held_forward(*args: Any, **kwargs: Any) -> Any:
            frame = rerun.running()
            if frame is not None and not own:
                out, start, saved = frame.noting(forward, *args, **kwargs)
            else:
                out, saved = forward(*args, **kwargs), None
            key = self._key(layer)
            if isinstance(out, torch.Tensor) and out.requires_grad and self.known.holds(key):
                recipe = None
                if saved is not None and not kwargs:
                    weights = frozenset(p.untyped_storage().data_ptr() for p in layer.parameters(recurse=False))
                    recipe = Recipe.of(start, saved, _tensors(args), weights=weights)
                self.outputs[key] = Held((out.detach(),), flops_per_element(layer) * out.numel(), recipe)
            return out

        return held_forward

    def _answering(self, layer: nn.Module, forward: Any) -> Any:
        def answered_forward(*args: Any, **kwargs: Any) -> Any:
            key = self._key(layer)
            held = self.outputs.pop(key, None)
            if held is None:  # not held, or a second recompute: run it
                out = forward(*args, **kwargs)
            elif held.spoiled:  # changed in place after forward: run it, and hold it no more
                self.known.spoiled.add(layer)
                out = forward(*args, **kwargs)
            else:
                frame = rerun.running()
                if held.recipe is not None and frame is not None and held.recipe.give(frame, _tensors(args)):
                    self.finished.add(key)  # not where the recompute stopped inside it (`rerun.Stop`)
                    return held.values[0].requires_grad_()  # what later ops save, as forward's output
                with _AnswerLayer(held.values[0], getattr(layer, "bias", None) is not None):
                    out = forward(*args, **kwargs)
            self.finished.add(key)
            return out

        return answered_forward

    def _held_attention(self, attention: Any, *args: Any, **kwargs: Any) -> Any:
        key = self._key(ATTENTION)
        dropout = kwargs.get("dropout_p", args[_SDPA_DROPOUT] if len(args) > _SDPA_DROPOUT else 0.0)
        if dropout or not self.known.holds(key) or not torch.is_grad_enabled():
            return attention(*args, **kwargs)
        frame = rerun.running()
        if not self.known.attention_by_dispatch and frame is not None and frame.recording is None:
            return self._noted_attention(attention, frame, key, args, kwargs)
        with _Capture() as capture:
            out = attention(*args, **kwargs)
        if capture.values is not None and out.requires_grad:
            self.outputs[key] = Held(capture.values, capture.flops)
        return out

    def _noted_attention(self, attention: Any, frame: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        """Fused attention with what it saves noted (`Recipe`), no dispatch mode: its output held,
        and its log-sum-exp and seeds, small, kept. Where it saved anything else (keys repeated
        for grouped heads, the written-out math's scores), this call is left to the recompute,
        and the block's later calls are held through a dispatch mode (`_Capture`)."""
        out, start, saved = frame.noting(attention, *args, **kwargs)
        inputs = _tensors(args, kwargs)
        recipe = None
        if saved and isinstance(out, torch.Tensor) and out.requires_grad and len(inputs) >= 2:
            recipe = Recipe.of(start, saved, inputs, out=out, spare=out.nbytes // 4)
        if recipe is None:
            self.known.attention_by_dispatch = True
            return out
        q, k = inputs[0], inputs[1]
        self.outputs[key] = Held((out.detach(),), 4 * q.numel() * k.size(-2), recipe)  # q @ k^T and p @ v
        return out

    def _answered_attention(self, attention: Any, *args: Any, **kwargs: Any) -> Any:
        key = self._key(ATTENTION)
        held = self.outputs.pop(key, None)
        frame = rerun.running()
        if held is None or held.spoiled:
            out = attention(*args, **kwargs)
        elif held.recipe is None:
            with _AnswerAttention(held.values):
                out = attention(*args, **kwargs)
        elif frame is not None and held.recipe.give(frame, _tensors(args, kwargs), held.values[0]):
            out = held.values[0].requires_grad_()
        else:
            out = attention(*args, **kwargs)
        self.finished.add(key)  # not where the recompute stopped inside it (`rerun.Stop`)
        return out


class _Routing:
    """`torch.nn.functional.scaled_dot_product_attention` while SELECTIVE blocks run: a function
    that hands each call to the handler of the block running in its thread (none: the function
    found in place). Set when the first block starts, put back when the last ends, so blocks run
    in several threads at once (`nn.DataParallel`) each see their own."""

    lock = threading.Lock()
    active = 0
    found: Any = None
    local = threading.local()


def _routed_attention(*args: Any, **kwargs: Any) -> Any:
    handler = getattr(_Routing.local, "handler", None)
    if handler is None:
        return _Routing.found(*args, **kwargs)
    return handler(_Routing.found, *args, **kwargs)


def _route_attention(handler: Any) -> Any:
    """Route this thread's fused attention calls to `handler`; returns the handler it replaces."""
    with _Routing.lock:
        if _Routing.active == 0:
            _Routing.found = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _routed_attention
        _Routing.active += 1
    previous = getattr(_Routing.local, "handler", None)
    _Routing.local.handler = handler
    return previous


def _unroute_attention(previous: Any) -> None:
    _Routing.local.handler = previous
    with _Routing.lock:
        _Routing.active -= 1
        if _Routing.active == 0:
            F.scaled_dot_product_attention = _Routing.found
            _Routing.found = None


class _Capture(TorchDispatchMode):
    """Holds the outputs of the first fused attention op it sees, and the op's FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.values: tuple | None = None
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.values is None and func in ATTENTION_OPS:
            q, k = args[0], args[1]
            self.values = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in out)
            self.flops = 4 * q.numel() * k.size(-2)  # q @ k^T and p @ v: 2 * L * S * D each, per head
        return out


class _AnswerAttention(TorchDispatchMode):
    """Answers the fused attention op with its outputs held from forward."""

    def __init__(self, values: tuple) -> None:
        super().__init__()
        self.values: tuple | None = values

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        values = self.values
        if values is not None and func in ATTENTION_OPS and values[0].shape[:-1] == args[0].shape[:-1]:
            self.values = None
            return values
        return func(*args, **(kwargs or {}))


class _AnswerLayer(TorchDispatchMode):
    """Answers a weight layer's weight op with its output held from forward; every other op
    (views, casts under autocast, padding) runs."""

    def __init__(self, held: torch.Tensor, has_bias: bool) -> None:
        super().__init__()
        self.held: torch.Tensor | None = held
        self.has_bias = has_bias

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        held = self.held
        if held is not None and (func in _MATMULS or func is _CONVOLUTION):
            self.held = None
            out = _as_result(func, args, held, self.has_bias)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))


def _as_result(func: Any, args: tuple, held: torch.Tensor, has_bias: bool) -> torch.Tensor | None:
    """The held layer output as the result of `func(*args)`, or None where it is not that
    result (the op then runs): a matmul's 2-D result is the layer's output flattened, unless
    a bias is still to be added after it (`mm` in a layer with a bias)."""
    if func is _CONVOLUTION:
        x = args[0]
        if held.dtype == x.dtype and held.dim() == x.dim() and held.size(0) == x.size(0):
            return held
        return None
    if func is _aten.mm.default and has_bias:
        return None
    first = _MATMULS[func]
    a, b = args[first], args[first + 1]
    rows, cols = a.size(0), b.size(1)
    if held.dtype == a.dtype and held.numel() == rows * cols and held.is_contiguous():
        return held.view(rows, cols)
    return None
