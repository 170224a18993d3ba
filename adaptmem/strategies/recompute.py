"""CHECKPOINT and SELECTIVE: recompute in backward what forward did not keep.

Both use non-reentrant `torch.utils.checkpoint` (RNG state and autocast state
preserved). The recompute calls the block's original forward, never the
adaptmem wrapper, so a mode set between forward and backward cannot change what
is recomputed.

Tensor keyword arguments are handed to checkpoint positionally: checkpoint
saves its tensor inputs through the saved-tensor mechanism, which is what lets
CHECKPOINT+OFFLOAD move the block input to the host with one pack hook around
the checkpoint (inside the checkpoint, checkpoint's own hooks are innermost).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from adaptmem.strategies.call import BlockCall
from adaptmem.strategies.packing import Packer
from adaptmem.strategies.payloads import restore

_aten = torch.ops.aten
_SAVE_NAMES = (
    "mm.default",
    "addmm.default",
    "bmm.default",
    "baddbmm.default",
    "convolution.default",
    "_scaled_mm.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_flash_attention_forward.default",
    "_efficient_attention_forward.default",
)


def _resolve(names: tuple[str, ...]) -> frozenset:
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


#: Ops whose outputs SELECTIVE keeps: matmuls, convolutions and attention.
SAVED_OPS = _resolve(_SAVE_NAMES)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of matmuls, convolutions and attention; recompute the rest.

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


_selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def run_checkpoint(call: BlockCall) -> Any:
    return _checkpointed(call, noop_context_fn)


def run_selective(call: BlockCall) -> Any:
    return _checkpointed(call, _selective_contexts)


def run_checkpoint_offloaded_input(call: BlockCall) -> Any:
    """DeepSpeed's cpu_checkpointing: checkpoint, and keep the block input on the host."""
    packer = Packer(call.module, offload=call.offload, runtime=call.offload_runtime,
                    grad_only=True, stats=call.stats)
    with torch.autograd.graph.saved_tensors_hooks(packer, restore):
        return _checkpointed(call, noop_context_fn)


def _checkpointed(call: BlockCall, context_fn: Any) -> Any:
    kwargs = without_cache(call, call.kwargs)
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    static = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    n_args = len(call.args)
    forward = call.forward
    notify = call.on_recompute  # not `call`: checkpoint keeps `run` alive, and call.args would pin the inputs
    runs = [0]

    def run(*flat: Any) -> Any:
        runs[0] += 1
        if runs[0] == 1 or notify is None:
            return forward(*flat[:n_args], **static, **dict(zip(tensor_keys, flat[n_args:])))
        notify(True)  # a rerun is the recompute, inside backward
        try:
            return forward(*flat[:n_args], **static, **dict(zip(tensor_keys, flat[n_args:])))
        finally:
            notify(False)

    return checkpoint(
        run,
        *call.args,
        *(kwargs[k] for k in tensor_keys),
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=context_fn,
    )


_CACHE_KEYS = ("past_key_values", "past_key_value", "layer_past")


def without_cache(call: BlockCall, kwargs: dict) -> dict:
    """Drop a KV cache handed to a recomputed block, as Hugging Face's own checkpointing does.

    A cache that the block writes to would be written twice (once more by the
    recompute), giving the recomputed attention other shapes than forward had.
    Layers that declare `_can_checkpoint_with_cache` only read it and keep it.
    """
    module = call.module
    if getattr(module, "_can_checkpoint_with_cache", False):
        return kwargs
    dropped = [k for k in _CACHE_KEYS if kwargs.get(k) is not None]
    uses_cache = bool(kwargs.get("use_cache"))
    if not dropped and not uses_cache:
        return kwargs
    kwargs = dict(kwargs)
    for key in dropped:
        kwargs[key] = None
    if uses_cache:
        kwargs["use_cache"] = False
    cls = type(module).__name__
    call.warn_once(
        f"cache:{cls}",
        f"adaptmem: {cls} recomputes in backward, so its KV cache is not written in training "
        "(set use_cache=False to silence this)",
    )
    return kwargs
