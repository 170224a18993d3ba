"""The loss head, chunked: logits made and consumed a chunk of tokens at a time.

At long sequences the output head's logits (tokens x vocabulary, and their
log-softmax and gradient beside them) are the largest tensors of a step. In
CHUNKED mode the head's projection returns `ChunkedLogits`: a tensor with the
logits' shape and dtype and no storage, that records what the model does to it
on the way to the loss:

  - element-wise maps with a constant (Gemma 2's final soft-cap ``/ c``, ``tanh``,
    ``* c``; Cohere's logit scale; ``.float()``) form the *epilogue*, run per chunk;
  - reshapes and slices of the leading (token) dimensions (``[..., :-1, :]``,
    ``.view(-1, vocab)``, ``.contiguous()``) are applied to the hidden states;
  - ``F.cross_entropy`` (Hugging Face's loss functions, ``nn.CrossEntropyLoss``,
    nanoGPT's own line) computes the loss chunk by chunk (`chunked_cross_entropy`).

Anything else (reading the values, ``log_softmax``, ``argmax``) raises
`LogitsNotMaterializedError` naming the operation and the fix: a tensor that
does not exist is never handed out as if it did.

The loss is exact up to the order of summation: the same ops run per chunk
(the projection, the epilogue, PyTorch's own cross-entropy), and only the sums
over tokens and over chunks are added in another order.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


class LogitsNotMaterializedError(RuntimeError):
    """Code read the values of logits that the CHUNKED loss head never makes."""


_FIX = (
    "The loss head runs CHUNKED, so the full tokens x vocabulary logits are never made (that is "
    "the memory it saves); only the loss is computed from them, chunk by chunk. To use the logits "
    "themselves, keep the head for this model: `adaptmem.manage(model, head=None)` (or a policy "
    "with head = \"kept\"), or compute what you need from them outside training (under "
    "torch.no_grad() or model.eval() the head runs as it is)."
)


# -------------------------------------------------------------- the loss
@dataclass(frozen=True)
class LossSpec:
    """What the loss call asked for, and the chunking: one chunk is `chunk` tokens."""

    epilogue: tuple  # ((func, args with _SELF for the logits, kwargs), ...), in order
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    chunk: int = 1024


class _Self:
    """Marks where the logits go in a recorded call."""

    def __repr__(self) -> str:
        return "<logits>"


_SELF = _Self()


def _apply_epilogue(z: torch.Tensor, epilogue: tuple) -> torch.Tensor:
    for func, args, kwargs in epilogue:
        z = func(*[z if a is _SELF else a for a in args], **kwargs)
    return z


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _casts_only(epilogue: tuple) -> bool:
    """The epilogue only casts to float32 (Hugging Face's ``.float()``), or is empty."""
    return all(func is torch.Tensor.to and args == (_SELF, torch.float32) and not kwargs
               for func, args, kwargs in epilogue)


def _chunk_losses(hidden, weight, bias, target, spec: LossSpec, grads: "_Grads | None",
                  grad_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of every chunk (summed, or per token for reduction "none"); with `grads`,
    also each chunk's gradients, accumulated into it (scaled by `grad_rows` per token, if given)."""
    n = hidden.shape[0]
    per_token = spec.reduction == "none"
    direct = _casts_only(spec.epilogue) and spec.label_smoothing == 0.0
    losses = [] if per_token else None
    total = None
    for start in range(0, n, spec.chunk):
        end = min(n, start + spec.chunk)
        h, t = hidden[start:end], target[start:end]
        rows = grad_rows[start:end] if grad_rows is not None else None
        z = F.linear(h, weight, bias)
        if direct:
            loss, g = _direct_chunk(z, t, spec.ignore_index, per_token, grads is not None, rows)
        else:
            loss, g = _autograd_chunk(z, t, spec, per_token, grads is not None, rows)
        del z
        if g is not None:
            grads.add(g, h, weight, start, end)
            del g
        if per_token:
            losses.append(loss)
        else:
            total = loss if total is None else total + loss
    if per_token:
        return torch.cat(losses) if losses else hidden.new_zeros((0,))
    return total if total is not None else hidden.new_zeros(())


def _direct_chunk(z, t, ignore_index, per_token, want_grad, rows):
    """Cross-entropy of one chunk in float32 and its gradient written over the chunk's logits
    (softmax less the one-hot): one chunk-sized buffer, where autograd would hold four
    (the logits, their log-softmax, its gradient and theirs)."""
    compute = z.dtype
    zf = z.float() if compute != torch.float32 else z
    lse = torch.logsumexp(zf, dim=1)
    valid = t != ignore_index
    index = torch.where(valid, t, 0).unsqueeze(1)
    loss = (lse - zf.gather(1, index).squeeze(1)) * valid
    if not want_grad:
        return (loss if per_token else loss.sum()), None
    g = zf.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
    g.scatter_add_(1, index, torch.full_like(index, -1, dtype=g.dtype))
    scale = valid.to(g.dtype) if rows is None else valid.to(g.dtype) * rows.to(g.dtype)
    g.mul_(scale.unsqueeze(1))
    if compute != torch.float32:
        g = g.to(compute)  # the gradient the projection's backward sees, as autocast's cast back gives it
    return (loss if per_token else loss.sum()), g


def _autograd_chunk(z, t, spec, per_token, want_grad, rows):
    """Any other epilogue (a soft-cap, a scale) or label smoothing: autograd through it, per chunk."""
    with torch.enable_grad():
        leaf = z.detach().requires_grad_(want_grad)
        loss = F.cross_entropy(_apply_epilogue(leaf, spec.epilogue), t, ignore_index=spec.ignore_index,
                               reduction="none" if per_token else "sum", label_smoothing=spec.label_smoothing)
        g = torch.autograd.grad(loss, leaf, grad_outputs=rows)[0] if want_grad else None
    return loss.detach(), g


class _Grads:
    """The head's gradients, accumulated chunk by chunk: the hidden states' row by row, the
    weight's and bias's in float32 (summed over chunks, so not rounded once per chunk)."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]) -> None:
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        self.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and needs[2] else None

    def add(self, g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> None:
        # under autocast the matmuls run in its dtype, as the projection's own backward would
        autocast = torch.is_autocast_enabled(g.device.type)
        if self.hidden is not None:
            self.hidden[start:end] = torch.matmul(g, weight if autocast else weight.to(g.dtype))
        if self.weight is not None:
            if not autocast and g.dtype == h.dtype == torch.float32:
                self.weight.addmm_(g.t(), h)  # in place: no chunk-sized product beside the sum
            else:
                self.weight.add_(torch.matmul(g.t(), h if autocast else h.to(g.dtype)))
        if self.bias is not None:
            self.bias.add_(g.sum(0, dtype=torch.float32))


def _denominator(target: torch.Tensor, spec: LossSpec) -> torch.Tensor | None:
    """What a "mean" loss divides by: the targets not ignored (as `F.cross_entropy` does)."""
    if spec.reduction != "mean":
        return None
    return (target != spec.ignore_index).sum()


class _GradsInForward(torch.autograd.Function):
    """Sum or mean reductions: each chunk's gradients are computed in forward, while its logits
    exist, and scaled by the incoming gradient in backward (the way Liger's fused linear
    cross-entropy does). Three matmuls per chunk, as the kept head does; measured against
    recomputing the chunk's logits in backward (`_RecomputedInBackward`, four matmuls) on the
    same peak, it is the faster (`stress/head_variants.py`). The weight's gradient buffer is
    handed to autograd as it is, so where the weight has no `.grad` yet it becomes the `.grad`
    without a copy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spec):
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
        total = _chunk_losses(hidden, weight, bias, target, spec, grads)
        denominator = _denominator(target, spec)
        ctx.grads, ctx.denominator = grads, denominator
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / denominator if denominator is not None else total

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("the CHUNKED loss head cannot run backward twice (retain_graph=True): its "
                               "gradients were handed on by the first backward. " + _FIX)
        ctx.grads = None
        scale = grad_out if ctx.denominator is None else grad_out / ctx.denominator
        out = []
        for grad, dtype in zip((grads.hidden, grads.weight, grads.bias), ctx.dtypes):
            if grad is None:
                out.append(None)
                continue
            grad.mul_(scale.to(grad.dtype))
            out.append(grad if grad.dtype == dtype else grad.to(dtype))
        del grads
        return out[0], out[1], out[2], None, None


class _RecomputedInBackward(torch.autograd.Function):
    """The chunks' logits made again in backward (under forward's autocast state), their
    gradients computed there. Per-token losses ("none") need it: the incoming gradient differs
    per token, so no gradient can be taken ahead. For sums and means it is the slower of the
    two (`stress/head_variants.py`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spec):
        with torch.no_grad():
            losses = _chunk_losses(hidden, weight, bias, target, spec, None)
        denominator = _denominator(target, spec)
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.spec, ctx.denominator = spec, denominator
        ctx.autocast = _autocast_state(hidden.device.type)
        return losses / denominator if denominator is not None else losses

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, target = ctx.saved_tensors
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
        enabled, dtype = ctx.autocast
        per_token = ctx.spec.reduction == "none"
        with torch.no_grad(), torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
            _chunk_losses(hidden, weight, bias, target, ctx.spec, grads, grad_rows=grad_out if per_token else None)
        scale = None if per_token else (grad_out if ctx.denominator is None else grad_out / ctx.denominator)
        out = []
        for grad, like in zip((grads.hidden, grads.weight, grads.bias), (hidden, weight, bias)):
            if grad is not None and scale is not None:
                grad.mul_(scale.to(grad.dtype))
            out.append(None if grad is None else grad.to(like.dtype))
        return out[0], out[1], out[2], None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          target: torch.Tensor, spec: LossSpec, *, recompute: bool | None = None) -> torch.Tensor:
    """``F.cross_entropy(epilogue(F.linear(hidden, weight, bias)), target, ...)`` without ever
    making the whole logits: `hidden` is (tokens, hidden size), `target` (tokens,). `recompute`
    (default: only for per-token losses) makes the chunks again in backward rather than taking
    their gradients in forward."""
    if spec.reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {spec.reduction!r}")
    if recompute is None:
        recompute = spec.reduction == "none"
    function = _RecomputedInBackward if recompute else _GradsInForward
    return function.apply(hidden, weight, bias, target, spec)


# ------------------------------------------------------ the lazy logits
class _Source:
    """What the head saw in one call: its projection, the chunk size, and every `ChunkedLogits`
    made from it (weakly), whose hidden states are let go once the loss has been taken."""

    __slots__ = ("weight", "bias", "chunk", "views", "consumed", "on_loss", "__weakref__")

    def __init__(self, weight, bias, chunk: int, on_loss: Callable[[int, int], None] | None) -> None:
        self.weight, self.bias, self.chunk = weight, bias, chunk
        self.views: list[weakref.ref] = []  # refs, not a WeakSet: that would compare tensors with ==
        self.consumed = False
        self.on_loss = on_loss


_HALF_OPS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


class ChunkedLogits(torch.Tensor):
    """The logits of a CHUNKED loss head: their shape and dtype, no storage (see the module)."""

    @staticmethod
    def __new__(cls, hidden, source, epilogue, vocab, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, (*hidden.shape[:-1], vocab), dtype=dtype,
                                                   device=hidden.device, requires_grad=False)

    def __init__(self, hidden, source, epilogue, vocab, dtype) -> None:
        self._hidden = hidden
        self._source = source
        self._epilogue = epilogue
        self._vocab = vocab
        source.views.append(weakref.ref(self))

    @classmethod
    def of(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int,
           on_loss: Callable[[int, int], None] | None = None) -> "ChunkedLogits":
        """The logits ``F.linear(hidden, weight, bias)`` would make, to be chunked by `chunk` tokens."""
        dtype = hidden.dtype  # what F.linear makes: its input's dtype, or autocast's
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        return cls(hidden, _Source(weight, bias, max(1, int(chunk)), on_loss), (), weight.shape[0], dtype)

    # the recorded forms
    def _derive(self, hidden=None, step=None) -> "ChunkedLogits":
        epilogue = self._epilogue if step is None else (*self._epilogue, step)
        dtype = self.dtype
        if step is not None:
            func, args, kwargs = step
            with torch.no_grad():
                meta = torch.empty((1, 1), dtype=dtype, device="meta")
                dtype = func(*[meta if a is _SELF else a for a in args], **kwargs).dtype
        return ChunkedLogits(self._hidden if hidden is None else hidden, self._source, epilogue, self._vocab, dtype)

    def _live_hidden(self, what: str) -> torch.Tensor:
        if self._hidden is None:
            raise LogitsNotMaterializedError(f"{what}: these logits were consumed by the loss already. {_FIX}")
        return self._hidden

    def describe(self) -> str:
        return (f"ChunkedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, chunk={self._source.chunk} tokens, "
                "not materialized: the CHUNKED loss head makes them a chunk at a time inside the loss)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _DESCRIBE:
            return args[0].describe()
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        raise LogitsNotMaterializedError(f"{_name(func)} on the logits is not supported. {_FIX}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise LogitsNotMaterializedError(f"{func} on the logits is not supported. {_FIX}")


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _constant(value: Any, what: str) -> Any:
    """A value an element-wise map of the logits may take: a number, or a tensor of one value that
    needs no gradient (its gradient would be lost)."""
    if isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, torch.Tensor) and not isinstance(value, ChunkedLogits) and value.numel() == 1 \
            and not value.requires_grad:
        return value
    raise LogitsNotMaterializedError(
        f"{what} with {type(value).__name__} {getattr(value, 'shape', '')}: the CHUNKED head replays only "
        f"maps of the logits with a constant that needs no gradient. {_FIX}")


def _elementwise(func):
    def handler(*args, **kwargs):
        target = next(a for a in args if isinstance(a, ChunkedLogits))
        template = tuple(_SELF if a is target else _constant(a, _name(func)) for a in args)
        kwargs = {k: _constant(v, _name(func)) for k, v in kwargs.items()}
        return target._derive(step=(func, template, kwargs))
    return handler


def _cast(name: str):
    dtype = _HALF_OPS[name]

    def handler(self, *args, **kwargs):
        if args or kwargs:
            raise LogitsNotMaterializedError(f"Tensor.{name} with arguments is not supported. {_FIX}")
        return self if self.dtype == dtype else self._derive(step=(torch.Tensor.to, (_SELF, dtype), {}))
    return handler


def _to(self, *args, **kwargs):
    dtype = kwargs.pop("dtype", None)
    rest = []
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)) and torch.device(a).type == self.device.type:
            continue
        else:
            rest.append(a)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    device = kwargs.pop("device", None)
    if rest or kwargs or (device is not None and torch.device(device).type != self.device.type):
        raise LogitsNotMaterializedError(f"Tensor.to{args!r} is not supported on the logits. {_FIX}")
    return self if dtype is None or dtype == self.dtype else self._derive(step=(torch.Tensor.to, (_SELF, dtype), {}))


def _sizes(args: tuple) -> list:
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)


def _reshape(name: str):
    def handler(self, *args):
        sizes = _sizes(args)
        if not sizes or sizes[-1] not in (self._vocab, -1) or (sizes[-1] == -1 and -1 in sizes[:-1]):
            raise LogitsNotMaterializedError(
                f"Tensor.{name}{tuple(sizes)}: only reshapes that keep the vocabulary as the last dimension "
                f"({self._vocab}) are replayed on the chunked logits. {_FIX}")
        hidden = self._live_hidden(name)
        return self._derive(hidden=getattr(hidden, name)(*sizes[:-1], hidden.shape[-1]))
    return handler


def _contiguous(self, *args, **kwargs):
    return self._derive(hidden=self._live_hidden("contiguous").contiguous())


def _flatten(self, start_dim=0, end_dim=-1):
    nd = self.dim()
    start, end = start_dim % nd, end_dim % nd
    if end == nd - 1 and start < end:
        raise LogitsNotMaterializedError(f"flatten over the vocabulary dimension is not supported. {_FIX}")
    if start >= end:
        return self
    return self._derive(hidden=self._live_hidden("flatten").flatten(start, end))


def _getitem(self, key):
    items = key if isinstance(key, tuple) else (key,)
    if any(k is None for k in items):
        raise LogitsNotMaterializedError(f"indexing the logits with None is not supported. {_FIX}")
    full = slice(None)
    if any(k is Ellipsis for k in items):
        after = items[items.index(Ellipsis) + 1:]
        touches_last = bool(after) and not (isinstance(after[-1], slice) and after[-1] == full)
    else:
        used = sum(k.dim() if isinstance(k, torch.Tensor) and k.dtype == torch.bool else 1 for k in items)
        touches_last = used >= self.dim() and not (isinstance(items[-1], slice) and items[-1] == full)
    if touches_last:
        raise LogitsNotMaterializedError(
            f"indexing the logits by vocabulary entry ({key!r}) is not supported: only token positions are "
            f"selected on the chunked logits. {_FIX}")
    return self._derive(hidden=self._live_hidden("indexing")[key])


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    if not isinstance(input, ChunkedLogits) or isinstance(target, ChunkedLogits):
        raise LogitsNotMaterializedError(f"cross_entropy with the logits as its target is not supported. {_FIX}")
    if weight is not None or size_average is not None or reduce is not None:
        raise LogitsNotMaterializedError(
            "cross_entropy with class weights (or the old size_average/reduce) is not supported by the "
            f"CHUNKED head. {_FIX}")
    if target.is_floating_point():
        raise LogitsNotMaterializedError(f"cross_entropy with class probabilities as targets is not supported. {_FIX}")
    hidden = input._live_hidden("cross_entropy")
    if input.dim() not in (1, 2):
        raise LogitsNotMaterializedError(
            f"cross_entropy on logits of shape {tuple(input.shape)}: the chunked head takes (tokens, vocabulary), "
            f"as `logits.view(-1, logits.size(-1))` gives. {_FIX}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = target.reshape(-1)
    if flat.numel() != rows.shape[0]:
        raise ValueError(
            f"cross_entropy: the labels hold {flat.numel()} targets (shape {tuple(target.shape)}) for "
            f"{rows.shape[0]} tokens of logits (shape {tuple(input.shape)}); give one label per token "
            "(-100 where none)")
    source = input._source
    spec = LossSpec(input._epilogue, int(ignore_index), reduction, float(label_smoothing), source.chunk)
    loss = chunked_cross_entropy(rows, source.weight, source.bias, flat.to(rows.device), spec)
    if source.on_loss is not None:
        source.on_loss(rows.shape[0], math.ceil(rows.shape[0] / source.chunk))
    source.consumed = True
    if spec.reduction != "none":  # the gradients are taken: nothing needs the hidden states any more
        for ref in source.views:
            view = ref()
            if view is not None:
                view._hidden = None
    return loss.reshape(target.shape) if spec.reduction == "none" else loss


def _metadata() -> frozenset:
    T = torch.Tensor
    props = ("shape", "ndim", "dtype", "device", "requires_grad", "is_cuda", "is_meta", "layout", "is_sparse",
             "grad_fn", "is_leaf", "grad", "names", "is_quantized", "is_nested", "itemsize", "output_nr", "_version")
    funcs = [getattr(T, p).__get__ for p in props if hasattr(T, p)]
    funcs += [T.__hash__, T.size, T.dim, T.ndimension, T.numel, T.nelement, T.__len__, T.is_floating_point, T.is_complex,
              T.element_size, T.get_device, T.is_contiguous, T.stride]
    return frozenset(funcs)


_METADATA = _metadata()
_DESCRIBE = frozenset({torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__})

_HANDLERS: dict[Any, Callable[..., Any]] = {
    F.cross_entropy: _cross_entropy,
    torch.Tensor.to: _to,
    torch.Tensor.view: _reshape("view"),
    torch.Tensor.reshape: _reshape("reshape"),
    torch.reshape: lambda input, shape: _reshape("reshape")(input, shape),
    torch.Tensor.contiguous: _contiguous,
    torch.Tensor.flatten: _flatten,
    torch.flatten: _flatten,
    torch.Tensor.__getitem__: _getitem,
}
_HANDLERS.update({getattr(torch.Tensor, name): _cast(name) for name in _HALF_OPS})
_IN_PLACE = {torch.Tensor.__itruediv__: torch.Tensor.__truediv__, torch.Tensor.__imul__: torch.Tensor.__mul__,
             torch.Tensor.__iadd__: torch.Tensor.__add__, torch.Tensor.__isub__: torch.Tensor.__sub__}
for _f in (torch.tanh, torch.Tensor.tanh, torch.div, torch.Tensor.div, torch.Tensor.__truediv__,
           torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
           torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
           torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.__neg__,
           torch.neg, torch.Tensor.neg):
    _HANDLERS[_f] = _elementwise(_f)
for _f, _out_of_place in _IN_PLACE.items():  # `logits /= c` rebinds the name: replayed out of place
    _HANDLERS[_f] = _elementwise(_out_of_place)
