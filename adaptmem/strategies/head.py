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
from typing import Any

import torch
import torch.nn.functional as F

from adaptmem.strategies.chunked_loss import LOGITS, LossSpec, chunked_cross_entropy


class LogitsNotMaterializedError(RuntimeError):
    """Code read the values of logits that the CHUNKED loss head never makes."""


_FIX = (
    "The loss head runs CHUNKED, so the full tokens x vocabulary logits are never made (that is "
    "the memory it saves); only the loss is computed from them, chunk by chunk. To use the logits "
    "themselves, keep the head for this model: `adaptmem.manage(model, head=None)` (or a policy "
    'with head = "kept"), or compute what you need from them outside training (under '
    "torch.no_grad() or model.eval() the head runs as it is)."
)


class _Source:
    """What the head saw in one call: its projection, the chunk size, and every `ChunkedLogits`
    made from it (weakly), whose hidden states are let go once the loss has been taken."""

    __slots__ = ("weight", "bias", "chunk", "views", "on_loss", "__weakref__")

    def __init__(self, weight, bias, chunk: int, on_loss: Callable[[int, int], None] | None) -> None:
        self.weight, self.bias, self.chunk = weight, bias, chunk
        self.views: list[weakref.ref] = []  # refs, not a WeakSet: that would compare tensors with ==
        self.on_loss = on_loss


_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


class ChunkedLogits(torch.Tensor):
    """The logits of a CHUNKED loss head: their shape and dtype, no storage (see the module)."""

    @staticmethod
    def __new__(cls, hidden, source, epilogue, vocab, dtype, like=None):
        shape, device = ((*hidden.shape[:-1], vocab), hidden.device) if like is None else (like.shape, like.device)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(self, hidden, source, epilogue, vocab, dtype, like=None) -> None:
        """`like`: logits the loss consumed already (no hidden states), whose shape and device a map
        of them keeps."""
        self._hidden = hidden
        self._source = source
        self._epilogue = epilogue
        self._vocab = vocab
        source.views.append(weakref.ref(self))

    @classmethod
    def of(
        cls,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        chunk: int,
        on_loss: Callable[[int, int], None] | None = None,
    ) -> ChunkedLogits:
        """The logits ``F.linear(hidden, weight, bias)`` would make, to be chunked by `chunk` tokens."""
        dtype = hidden.dtype  # what F.linear makes: its input's dtype, or autocast's
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        return cls(hidden, _Source(weight, bias, max(1, int(chunk)), on_loss), (), weight.shape[0], dtype)

    # the recorded forms
    def _derive(self, hidden=None, step=None) -> ChunkedLogits:
        epilogue = self._epilogue if step is None else (*self._epilogue, step)
        dtype = self.dtype
        if step is not None:
            func, args, kwargs = step
            with torch.no_grad():  # the dtype the map makes, on stand-ins of its operands' dtypes and ranks
                meta = torch.empty((1, 1), dtype=dtype, device="meta")
                dtype = func(*[meta if a is LOGITS else _meta(a) for a in args], **kwargs).dtype
        if hidden is None and self._hidden is None:  # consumed by the loss: an element-wise map of them
            # (Accelerate's mixed precision casts a model's outputs with `.float()`) is as unmade as they are
            return ChunkedLogits(None, self._source, epilogue, self._vocab, dtype, like=self)
        return ChunkedLogits(self._hidden if hidden is None else hidden, self._source, epilogue, self._vocab, dtype)

    def _live_hidden(self, what: str) -> torch.Tensor:
        if self._hidden is None:
            raise LogitsNotMaterializedError(f"{what}: these logits were consumed by the loss already. {_FIX}")
        return self._hidden

    def describe(self) -> str:
        return (
            f"ChunkedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, chunk={self._source.chunk} tokens, "
            "not materialized: the CHUNKED loss head makes them a chunk at a time inside the loss)"
        )

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


def _meta(value: Any) -> Any:
    """`value` for working out a map's dtype: a tensor as an empty one of its dtype and rank."""
    if isinstance(value, torch.Tensor):
        return torch.empty((1,) * value.dim(), dtype=value.dtype, device="meta")
    return value


def _constant(value: Any, what: str, vocab: int) -> Any:
    """A value an element-wise map of the logits may take, needing no gradient (its gradient would be
    lost): a number, a tensor of one value, or one value per vocabulary entry (BART's
    `final_logits_bias`, shaped (1, vocabulary)), which is replayed as a vector over each chunk's rows."""
    if isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, torch.Tensor) and not isinstance(value, ChunkedLogits) and not value.requires_grad:
        if value.numel() == 1:
            return value
        if value.dim() >= 1 and value.shape[-1] == vocab and value.numel() == vocab:
            return value.reshape(vocab)
    raise LogitsNotMaterializedError(
        f"{what} with {type(value).__name__} {getattr(value, 'shape', '')}: the CHUNKED head replays only "
        f"maps of the logits with a constant that needs no gradient (a number, one value, or one per "
        f"vocabulary entry). {_FIX}"
    )


def _elementwise(func):
    def handler(*args, **kwargs):
        target = next(a for a in args if isinstance(a, ChunkedLogits))
        what, vocab = _name(func), target._vocab
        template = tuple(LOGITS if a is target else _constant(a, what, vocab) for a in args)
        kwargs = {k: _constant(v, what, vocab) for k, v in kwargs.items()}
        return target._derive(step=(func, template, kwargs))

    return handler


def _cast(name: str):
    dtype = _CASTS[name]

    def handler(self, *args, **kwargs):
        if args or kwargs:
            raise LogitsNotMaterializedError(f"Tensor.{name} with arguments is not supported. {_FIX}")
        return self if self.dtype == dtype else self._derive(step=(torch.Tensor.to, (LOGITS, dtype), {}))

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
    return self if dtype is None or dtype == self.dtype else self._derive(step=(torch.Tensor.to, (LOGITS, dtype), {}))


def _sizes(args: tuple) -> list:
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)


def _reshape(name: str):
    def handler(self, *args):
        sizes = _sizes(args)
        if not sizes or sizes[-1] not in (self._vocab, -1) or (sizes[-1] == -1 and -1 in sizes[:-1]):
            raise LogitsNotMaterializedError(
                f"Tensor.{name}{tuple(sizes)}: only reshapes that keep the vocabulary as the last dimension "
                f"({self._vocab}) are replayed on the chunked logits. {_FIX}"
            )
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
        after = items[items.index(Ellipsis) + 1 :]
        touches_last = bool(after) and not (isinstance(after[-1], slice) and after[-1] == full)
    else:
        used = sum(k.dim() if isinstance(k, torch.Tensor) and k.dtype == torch.bool else 1 for k in items)
        touches_last = used >= self.dim() and not (isinstance(items[-1], slice) and items[-1] == full)
    if touches_last:
        raise LogitsNotMaterializedError(
            f"indexing the logits by vocabulary entry ({key!r}) is not supported: only token positions are "
            f"selected on the chunked logits. {_FIX}"
        )
    return self._derive(hidden=self._live_hidden("indexing")[key])


def _cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
):
    if not isinstance(input, ChunkedLogits) or isinstance(target, ChunkedLogits):
        raise LogitsNotMaterializedError(f"cross_entropy with the logits as its target is not supported. {_FIX}")
    if weight is not None or size_average is not None or reduce is not None:
        raise LogitsNotMaterializedError(
            "cross_entropy with class weights (or the old size_average/reduce) is not supported by the "
            f"CHUNKED head. {_FIX}"
        )
    if target.is_floating_point():
        raise LogitsNotMaterializedError(f"cross_entropy with class probabilities as targets is not supported. {_FIX}")
    hidden = input._live_hidden("cross_entropy")
    if input.dim() not in (1, 2):
        raise LogitsNotMaterializedError(
            f"cross_entropy on logits of shape {tuple(input.shape)}: the chunked head takes (tokens, vocabulary), "
            f"as `logits.view(-1, logits.size(-1))` gives. {_FIX}"
        )
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = target.reshape(-1)
    if flat.numel() != rows.shape[0]:
        raise ValueError(
            f"cross_entropy: the labels hold {flat.numel()} targets (shape {tuple(target.shape)}) for "
            f"{rows.shape[0]} tokens of logits (shape {tuple(input.shape)}); give one label per token "
            "(-100 where none)"
        )
    source = input._source
    spec = LossSpec(input._epilogue, int(ignore_index), reduction, float(label_smoothing), source.chunk)
    loss = chunked_cross_entropy(rows, source.weight, source.bias, flat.to(rows.device), spec)
    if source.on_loss is not None:
        source.on_loss(rows.shape[0], math.ceil(rows.shape[0] / source.chunk))
    if spec.reduction != "none":  # the gradients are taken: nothing needs the hidden states any more
        for ref in source.views:
            view = ref()
            if view is not None:
                view._hidden = None
    return loss.reshape(target.shape) if spec.reduction == "none" else loss


def _metadata() -> frozenset:
    T = torch.Tensor
    props = (
        "shape",
        "ndim",
        "dtype",
        "device",
        "requires_grad",
        "is_cuda",
        "is_meta",
        "layout",
        "is_sparse",
        "grad_fn",
        "is_leaf",
        "grad",
        "names",
        "is_quantized",
        "is_nested",
        "itemsize",
        "output_nr",
        "_version",
    )
    funcs = [getattr(T, p).__get__ for p in props if hasattr(T, p)]
    funcs += [
        T.__hash__,
        T.size,
        T.dim,
        T.ndimension,
        T.numel,
        T.nelement,
        T.__len__,
        T.is_floating_point,
        T.is_complex,
        T.element_size,
        T.get_device,
        T.is_contiguous,
        T.stride,
        torch.is_floating_point,  # the function forms (Lightning Fabric's mixed precision asks before it casts)
        torch.is_complex,
        torch.numel,
    ]
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
_HANDLERS.update({getattr(torch.Tensor, name): _cast(name) for name in _CASTS})
_IN_PLACE = {
    torch.Tensor.__itruediv__: torch.Tensor.__truediv__,
    torch.Tensor.__imul__: torch.Tensor.__mul__,
    torch.Tensor.__iadd__: torch.Tensor.__add__,
    torch.Tensor.__isub__: torch.Tensor.__sub__,
}
for _f in (
    torch.tanh,
    torch.Tensor.tanh,
    torch.div,
    torch.Tensor.div,
    torch.Tensor.__truediv__,
    torch.mul,
    torch.Tensor.mul,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.add,
    torch.Tensor.add,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.sub,
    torch.Tensor.sub,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__neg__,
    torch.neg,
    torch.Tensor.neg,
):
    _HANDLERS[_f] = _elementwise(_f)
for _f, _out_of_place in _IN_PLACE.items():  # `logits /= c` rebinds the name: replayed out of place
    _HANDLERS[_f] = _elementwise(_out_of_place)
