"""CHECKPOINT and SELECTIVE: recompute in backward what forward did not keep.

Both run a non-reentrant checkpoint (RNG state and autocast state preserved):
adaptmem's own (`rerun`), which does what PyTorch's does with less host work per
saved tensor, and PyTorch's `torch.utils.checkpoint` where the block is compiled
or runs under the compiler (which traces PyTorch's). The recompute calls the
block's original forward, never the adaptmem wrapper, so a mode set between
forward and backward cannot change what is recomputed.

Tensor keyword arguments are handed to checkpoint positionally: checkpoint
saves its tensor inputs through the saved-tensor mechanism, which is what lets
CHECKPOINT+OFFLOAD move the block input to the host with one pack hook around
the checkpoint (inside the checkpoint, checkpoint's own hooks are innermost).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _StopRecomputationError,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from adaptmem.registrations import buffers_of, keep_attributes, put_back_attributes
from adaptmem.strategies import rerun
from adaptmem.strategies.call import BlockCall, main_input
from adaptmem.strategies.packing import Packer, Residue
from adaptmem.strategies.selective import ATTENTION_OPS, SelectiveRun, resolve_ops

log = logging.getLogger("adaptmem")
_WEIGHT_OPS = ("mm.default", "addmm.default", "convolution.default", "_scaled_mm.default")


#: Ops whose outputs SELECTIVE keeps, as Megatron's selective recomputation does: the linear
#: layers' matmuls (`mm`/`addmm`: a linear layer flattens its input to 2-D), convolutions and
#: fused attention kernels, whose outputs grow with the sequence. The attention core written
#: out (`bmm` of queries by keys, softmax, dropout on the scores, `bmm` by values) is
#: recomputed: its batch x heads x seq x seq tensors are what make long sequences expensive.
SAVED_OPS = resolve_ops(_WEIGHT_OPS) | ATTENTION_OPS


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of weight matmuls, convolutions and fused attention; recompute the rest
    (norms, activations, and the attention core of eager attention with its seq x seq scores).

    An op that draws randomness (an attention with dropout) is recomputed like
    the rest. Recompute restores the RNG state of forward, so the random draws
    replay in forward's order only if every draw is replayed: skipping one would
    shift the stream under every later dropout. Keeping random ops' outputs
    instead fails on the CPU, where dropout is ``bernoulli_`` followed by an
    in-place ``div_`` on the kept tensor.
    """
    if op in SAVED_OPS and not draws_randomness(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def draws_randomness(op: Any, args: tuple, kwargs: dict) -> bool:
    """True when this call of `op` consumes the RNG (a seeded op; attention only with dropout > 0)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
    return float(p) > 0.0


def selective_contexts() -> tuple[Any, Any]:
    """The context pair of SELECTIVE: a plain function, so torch.compile can trace the checkpoint."""
    return create_selective_checkpoint_contexts(selective_policy)


def run_checkpoint(call: BlockCall) -> Any:
    return _checkpointed(call, None)


def run_selective(call: BlockCall) -> Any:
    if call.compiled_checkpoint is not None or torch.compiler.is_compiling():  # the compiler applies the op policy
        return _checkpointed(call, selective_contexts)
    return _checkpointed(call, None, selective=SelectiveRun(call.module))


def compiled_checkpoint(forward: Any, context_fn: Any, options: dict) -> Any:
    """`forward` under a non-reentrant checkpoint (with `context_fn`, SELECTIVE's op policy, or
    PyTorch's default), compiled as one function with `options`: the compiler sees the
    checkpointed region and partitions forward and recompute itself (torchtitan's order:
    checkpoint, then compile). A checkpoint run eagerly around compiled code would instead run
    the whole compiled forward again in backward, and SELECTIVE's policy over ops the compiled
    code hides from it: on a host-bound Llama on the CPU, 1.8x NONE's step against about 1.05x.

    What the forward sets outside itself (a layer's last state, a context variable) is not set
    again by the recompute, as adaptmem's own checkpoint leaves it (`BlockRun`): the compiler is
    told so, which it otherwise refuses (transformers 5.25's attention sets a context variable
    of the `kernels` package, and every compiled checkpointed Llama layer failed to trace)."""
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    compiled = torch.compile(checkpointed, **options)
    config = torch._dynamo.config

    @functools.wraps(checkpointed)
    def run(*args: Any, **kwargs: Any) -> Any:
        # set and put back by hand: `config.patch` cost 138 us a call, at every block of every step
        before = config.skip_fwd_side_effects_in_bwd_under_checkpoint
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        try:
            return compiled(*args, **kwargs)
        finally:
            config.skip_fwd_side_effects_in_bwd_under_checkpoint = before

    return run


def run_checkpoint_offloaded_input(call: BlockCall) -> Any:
    """DeepSpeed's cpu_checkpointing: checkpoint, and keep the block input on the host."""
    packer = Packer(
        call.module,
        offload=call.offload,
        runtime=call.offload_runtime,
        grad_only=True,
        main=main_input(call.args, call.kwargs),
        stats=call.stats,
    )
    with packer.installed():
        return _checkpointed(call, None)


class BlockRun:
    """The function checkpoint runs: the block's forward, once in forward and again as the
    recompute in backward.

    The recompute must read the block's state as forward read it, and leave it as forward left
    it. What a layer keeps on itself for its next call (a recurrent layer's last state) is set
    back to what it was as forward began while the recompute runs, and to what forward left
    after it (`keep_attributes`). Normalization
    layers update their running statistics in place (without bumping the tensor
    version), so a recompute would apply the update a second time: the block's
    buffers are copied by value as a recompute begins and put back as it ends
    (without a new version, so a buffer autograd saved is not seen as changed). It
    holds the module, the forward and the listener, never the call's arguments:
    checkpoint keeps it alive until backward.
    """

    __slots__ = ("module", "forward", "n_args", "tensor_keys", "static", "notify", "runs", "selective", "before")

    def __init__(self, call: BlockCall, tensor_keys: list[str], static: dict, selective: Any = None) -> None:
        self.selective = selective  # a SelectiveRun: weight layers' outputs held in forward, answered in recompute
        self.module = call.module
        self.forward = call.forward
        self.n_args = len(call.args)
        self.tensor_keys = tensor_keys
        self.static = static
        self.notify = call.on_recompute
        self.runs = 0
        self.before: list | None = None  # what the block kept on itself as its forward began

    def _forward(self, flat: tuple) -> Any:
        n = self.n_args
        return self.forward(*flat[:n], **self.static, **dict(zip(self.tensor_keys, flat[n:])))

    def __call__(self, *flat: Any) -> Any:
        if torch.compiler.is_compiling():  # compiled: the recompute is part of the compiled backward
            return self._forward(flat)
        self.runs += 1
        if self.runs == 1:
            self.before = keep_attributes(self.module)
            if self.selective is not None:
                return self.selective.around(False, lambda: self._forward(flat))
            return self._forward(flat)
        if self.notify is not None:
            self.notify(True)  # a rerun is the recompute, inside backward
        state = keep_buffers(self.module)
        attributes = keep_attributes(self.module)
        if self.before is not None:  # the recompute reads the state forward read, not the one it left
            put_back_attributes(self.before)
        ended = False  # ran to its end, or stopped once it had what backward needs
        try:
            if self.selective is not None:
                out = self.selective.around(True, lambda: self._forward(flat))
            else:
                out = self._forward(flat)
            ended = True
            return out
        except (rerun.Stop, _StopRecomputationError):  # stopped early, as both checkpoints stop it
            ended = True
            raise
        finally:
            put_back_buffers(state)
            put_back_attributes(attributes)
            if self.notify is not None and ended:  # one that failed (out of memory) shows no bytes
                self.notify(False)


def keep_buffers(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, a copy of its values) for every buffer of `module`.

    Outside any dispatch mode: under SELECTIVE the recompute runs inside
    PyTorch's caching mode, which refuses ops the forward did not run.
    """
    with torch.no_grad(), _disable_current_modes():
        return [(b, b.detach().clone()) for b in buffers_of(module)]


def put_back_buffers(state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy back the values the buffers had at `keep_buffers`.

    Through `.data`, which has a version counter of its own: a buffer autograd
    saved in the recompute (a scale the block multiplies by) keeps its version,
    so backward does not refuse it as modified in place. Every buffer is copied,
    not only those whose values changed: finding which would read them on the
    host, a wait for the device at every recomputed block that holds a buffer.
    """
    with torch.no_grad(), _disable_current_modes():
        for buffer, copy in state:
            buffer.data.copy_(copy)


def _checkpointed(call: BlockCall, context_fn: Any, selective: Any = None) -> Any:
    args, kwargs = without_cache(call)
    if call.compiled_checkpoint is not None and not torch.compiler.is_compiling():
        return call.compiled_checkpoint(context_fn)(*args, **kwargs)
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    static = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    run = BlockRun(call, tensor_keys, static, selective)
    flat = (*args, *(kwargs[k] for k in tensor_keys))
    if context_fn is None and not torch.compiler.is_compiling():
        if not call.measured or selective is not None:
            return rerun.checkpoint(run, *flat)
        residue = Residue(call.module, call.offload.min_bytes)
        out = rerun.checkpoint(run, *flat, saw=residue)
        call.stats["residue"] = residue.bytes
        return out
    options = {} if context_fn is None else {"context_fn": context_fn}  # the default is what torch.compile expects
    return checkpoint(run, *flat, use_reentrant=False, preserve_rng_state=True, **options)


_CACHE_KEYS = ("past_key_values", "past_key_value", "layer_past", "cache_params")


def is_cache(value: Any) -> bool:
    """A Hugging Face cache object (`transformers.cache_utils.Cache` or a model's own cache
    class), found by its classes' names so that transformers need not be imported."""
    return any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers") for c in type(value).__mro__)


def without_cache(call: BlockCall) -> tuple[tuple, dict]:
    """The call's arguments with a KV cache dropped, as Hugging Face's own checkpointing does.

    A cache that the block writes to would be written twice (once more by the
    recompute), giving the recomputed attention other shapes than forward had.
    A cache is found by keyword (`past_key_values`, ...) or by its type, also where
    a model hands it positionally (GPT-2 does). Layers that declare
    `_can_checkpoint_with_cache` only read it and keep it.
    """
    module, args, kwargs = call.module, call.args, call.kwargs
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    dropped = [k for k, v in kwargs.items() if v is not None and (k in _CACHE_KEYS or is_cache(v))]
    positions = [i for i, v in enumerate(args) if is_cache(v)]
    uses_cache = bool(kwargs.get("use_cache"))
    # `use_cache` handed positionally (RecurrentGemma's layers take it so): a block that keeps its own
    # state when it is True (a recurrent layer's last state, a convolution's window) would recompute
    # from the state its forward left
    flag = _use_cache_position(type(module))
    flag_set = flag is not None and flag < len(args) and args[flag] is True
    if not dropped and not positions and not uses_cache and not flag_set:
        return args, kwargs
    caches = [kwargs[k] for k in dropped] + [args[i] for i in positions]
    kwargs = dict(kwargs)
    for key in dropped:
        kwargs[key] = None
    if uses_cache:
        kwargs["use_cache"] = False
    args = tuple(None if i in positions else False if flag_set and i == flag else a for i, a in enumerate(args))
    name = type(module).__name__
    # Only a cache that already holds tokens for this block shows that the caller passed one.
    # `use_cache=True` from a model's config (True by default) and from the caller look the same
    # here: the model fills it in from its config and builds an empty cache itself, on every
    # training call. Telling of those at WARNING warned every user who never asked for a cache;
    # they are told at DEBUG, on each call: the once-per-model record (`warn_once`) is at WARNING.
    if any(_holds_past(module, c) for c in caches):
        call.warn_once(
            f"cache:{name}",
            f"adaptmem: {name} recomputes in backward, so its KV cache is not written in training, and the "
            "cached tokens passed to it are not attended to (Hugging Face's own gradient checkpointing drops the "
            f"cache alike); pass no cache in training, or leave {name} out of `blocks=`",
        )
    elif log.isEnabledFor(logging.DEBUG):
        log.debug(
            "adaptmem: %s recomputes in backward, so its KV cache is not written in training "
            "(use_cache=True, from the model's config or from the caller)",
            name,
        )
    return args, kwargs


#: Per module class, `_use_cache_position`'s answer: a dictionary, not `functools.cache`, which
#: torch.compile warns of in every checkpointed block of a compiled model ("Dynamo detected a call
#: to a functools.lru_cache-wrapped function").
_USE_CACHE_AT: dict[type, int | None] = {}


def _use_cache_position(cls: type) -> int | None:
    """The place of `use_cache` among a module class's forward's positional arguments (self not
    counted), or None."""
    if cls in _USE_CACHE_AT:
        return _USE_CACHE_AT[cls]
    at = None
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    for i, param in enumerate(params):
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        if param.name == "use_cache":
            at = i
            break
    _USE_CACHE_AT[cls] = at
    return at


def _holds_past(module: torch.nn.Module, cache: Any) -> bool:
    """`cache` holds tokens of earlier calls for this block: the caller passed it filled. The
    block's slot is found by the `layer_idx` Hugging Face gives each layer's attention; a model
    building a cache for itself builds it empty, and a block's slot is empty until it runs."""
    if isinstance(cache, (tuple, list)):
        return len(cache) > 0  # a legacy (key, value) pair: only ever the caller's past
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        return False
    index = _layer_index(module)
    if index is None:
        return False
    try:
        return length(index) > 0
    except (ValueError, IndexError):  # a slot with no sequence (a linear-attention layer's state)
        return False


#: A block's `layer_idx`, found once: every training call of a model with a cache asks for it.
_LAYER_INDEX: weakref.WeakKeyDictionary[torch.nn.Module, int | None] = weakref.WeakKeyDictionary()


def _layer_index(module: torch.nn.Module) -> int | None:
    if module not in _LAYER_INDEX:
        found = (m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int))
        _LAYER_INDEX[module] = next(found, None)
    return _LAYER_INDEX[module]
