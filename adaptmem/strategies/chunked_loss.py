"""The chunked loss: a fused linear cross-entropy that never makes the whole logits.

``F.cross_entropy(epilogue(F.linear(hidden, weight, bias)), target)`` is computed a
chunk of tokens at a time: each chunk's logits are made, the epilogue the model
applied to them is replayed (`ChunkedLogits` in `head.py` records it), the loss
and its gradient are taken, and the chunk is dropped. Only the sums over tokens
and over chunks are added in another order than the whole-logits code adds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossSpec:
    """What the loss call asked for, and the chunking: one chunk is `chunk` tokens."""

    epilogue: tuple  # ((func, args with LOGITS for the logits, kwargs), ...), in order
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    chunk: int = 1024


class _Logits:
    """Marks where the logits go in a recorded call (`LOGITS`)."""

    def __repr__(self) -> str:
        return "<logits>"


LOGITS = _Logits()


def _apply_epilogue(z: torch.Tensor, epilogue: tuple) -> torch.Tensor:
    for func, args, kwargs in epilogue:
        z = func(*[z if a is LOGITS else a for a in args], **kwargs)
    return z


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


_SCALES = {
    torch.Tensor.mul: "mul",
    torch.Tensor.__mul__: "mul",
    torch.Tensor.__rmul__: "mul",
    torch.mul: "mul",
    torch.Tensor.div: "div",
    torch.Tensor.__truediv__: "div",
    torch.div: "div",
}
_TANH = (torch.tanh, torch.Tensor.tanh)
#: Sums with the logits first: a number, or a vector over the vocabulary (BART's `final_logits_bias`).
_SHIFTS = {
    torch.Tensor.add: "add",
    torch.Tensor.__add__: "add",
    torch.Tensor.__radd__: "add",
    torch.add: "add",
    torch.Tensor.sub: "sub",
    torch.Tensor.__sub__: "sub",
    torch.sub: "sub",
}


def _direct_steps(epilogue: tuple, dtype: torch.dtype) -> tuple | None:
    """The epilogue as maps of float32 logits, `(("mul" | "div" | "add" | "sub", number) | ("tanh",
    None), ...)` in order, where it is casts to float32, products or quotients by a number, sums or
    differences with a number or a floating vector over the vocabulary, and at most one ``tanh``, made
    in float32 (Granite's ``logits / logits_scaling``, Cohere's ``logits * logit_scale``, Gemma 2's
    soft-cap ``tanh(logits / c) * c``, BART's ``logits + final_logits_bias``), or empty; else None.
    Such an epilogue runs in place on the chunk's buffer (and a second, the ``tanh``'s output, kept
    for its gradient): through autograd a Granite's chunk held about four buffers of its logits'
    size, a Gemma 2's five."""
    steps, current = [], dtype
    for func, args, kwargs in epilogue:
        if func is torch.Tensor.to and args == (LOGITS, torch.float32) and not kwargs:
            current = torch.float32
            continue
        if func in _TANH and args == (LOGITS,) and not kwargs and current == torch.float32:
            if any(op == "tanh" for op, _ in steps):
                return None
            steps.append(("tanh", None))
            continue
        if kwargs or len(args) != 2 or args[0] is not LOGITS or current != torch.float32:
            return None
        number = args[1]
        shift = _SHIFTS.get(func)
        if shift is not None and isinstance(number, torch.Tensor) and number.is_floating_point():
            steps.append((shift, number))  # the gradient passes a shift unchanged
            continue
        op = _SCALES.get(func) or shift
        if op is None:
            return None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or (op == "div" and number == 0):
            return None
        steps.append((op, number))
    return tuple(steps)


def _chunk_losses(
    hidden, weight, bias, target, spec: LossSpec, grads: _Grads | None, grad_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss of every chunk (summed, or per token for reduction "none"); with `grads`,
    also each chunk's gradients, accumulated into it (scaled by `grad_rows` per token, if given)."""
    n = hidden.shape[0]
    per_token = spec.reduction == "none"
    autocast, autocast_dtype = _autocast_state(hidden.device.type)
    steps = _direct_steps(spec.epilogue, autocast_dtype if autocast else hidden.dtype)  # the logits' dtype
    direct = steps is not None and spec.label_smoothing == 0.0
    losses = [] if per_token else None
    total = None
    for start in range(0, n, spec.chunk):
        end = min(n, start + spec.chunk)
        h, t = hidden[start:end], target[start:end]
        rows = grad_rows[start:end] if grad_rows is not None else None
        z = F.linear(h, weight, bias)
        if direct:
            loss, g = _direct_chunk(z, t, spec.ignore_index, per_token, grads is not None, rows, steps)
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


def _direct_chunk(z, t, ignore_index, per_token, want_grad, rows, steps=()):
    """Cross-entropy of one chunk in float32 and its gradient written over the chunk's logits
    (softmax less the one-hot, through the epilogue's maps `steps`): one chunk-sized buffer (two
    with a ``tanh``), where autograd would hold four (the logits, their log-softmax, its gradient
    and theirs) or more."""
    compute = z.dtype
    zf = z.float() if compute != torch.float32 else z
    kept = None  # the tanh's output, for its gradient
    for op, number in steps:
        if op == "tanh":
            kept = zf.tanh_()
            zf = kept.clone()
        elif op in ("add", "sub"):
            zf.add_(number) if op == "add" else zf.sub_(number)
        else:
            zf.mul_(number) if op == "mul" else zf.div_(number)
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
    for op, number in reversed(steps):  # the maps' own gradients, as autograd takes them
        if op == "tanh":
            g.mul_(kept.square_().neg_().add_(1))  # 1 - tanh^2
        elif op in ("add", "sub"):
            continue
        else:
            g.mul_(number) if op == "mul" else g.div_(number)
    if compute != torch.float32:
        g = g.to(compute)  # the gradient the projection's backward sees, as autocast's cast back gives it
    return (loss if per_token else loss.sum()), g


def _autograd_chunk(z, t, spec, per_token, want_grad, rows):
    """Any other epilogue (a soft-cap or a scale in a lower precision than float32) or label
    smoothing: autograd through it, per chunk."""
    with torch.enable_grad():
        leaf = z.detach().requires_grad_(want_grad)
        loss = F.cross_entropy(
            _apply_epilogue(leaf, spec.epilogue),
            t,
            ignore_index=spec.ignore_index,
            reduction="none" if per_token else "sum",
            label_smoothing=spec.label_smoothing,
        )
        g = torch.autograd.grad(loss, leaf, grad_outputs=rows)[0] if want_grad else None
    return loss.detach(), g


class _Grads:
    """The head's gradients, accumulated chunk by chunk: the hidden states' row by row, the
    weight's and bias's in float32 (summed over chunks, so not rounded once per chunk)."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]) -> None:
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        self.bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and needs[2] else None
        )

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
            raise RuntimeError(
                "the CHUNKED loss head cannot run backward twice (retain_graph=True): its "
                "gradients were handed on by the first backward. Keep the head for such a loop: "
                'adaptmem.manage(model, head=None), or a policy with head = "kept"'
            )
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


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    spec: LossSpec,
    *,
    recompute: bool | None = None,
) -> torch.Tensor:
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
