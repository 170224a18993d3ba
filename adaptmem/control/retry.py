"""Retrying a step after an out-of-memory error, with the gradients left exact.

A failed attempt changes state that a clean step would not have: it drew
random numbers (dropout), may have updated buffers in forward (BatchNorm's
running statistics), and may have written gradients: fresh `.grad` tensors
where there were none, and additions into `.grad` tensors that already held the
sum of earlier micro-batches. `StepGuard` undoes all of it. RNG states (CPU
and every initialized CUDA device) are put back, buffers from a host copy. Fresh ones are dropped. An
existing one is copied just before backward first accumulates into it (a hook
on the parameter runs before accumulation), so a retry starts from exactly the
gradients the attempt started from, and accumulation itself happens in place
as PyTorch always does it: the recovered step's gradients equal those of a
clean step bit for bit.

With `accumulation_snapshot="off"` nothing is copied; an OOM after an existing
gradient was changed then raises `InexactRetryError` instead of double counting.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from adaptmem.config.units import format_bytes


class StepOutOfMemoryError(torch.OutOfMemoryError):
    """The step ran out of memory under every plan tried; `attempts` holds them."""

    def __init__(self, message: str, attempts: list[dict]) -> None:
        super().__init__(message)
        self.attempts = attempts


class InexactRetryError(RuntimeError):
    """A retry could not restore the gradients exactly."""


class StepGuard:
    """Remembers what a step may change (gradients, RNG, buffers) so a failed attempt can be undone.

    Buffers named in `mutable` (all of them when None) are copied to the host, up
    to `buffer_limit` bytes in all; the others are only watched, and a failed
    attempt that changed one of them is an error.
    """

    def __init__(self, model: torch.nn.Module, snapshot: str = "device", *,
                 mutable: set[int] | None = None, buffer_limit: int = 256 * 2**20) -> None:
        self.snapshot = snapshot
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        buffers = list(model.buffers())
        self.buffer_versions = [(b, b._version) for b in buffers]
        copied = [b for b in buffers if mutable is None or id(b) in mutable]
        total = sum(b.numel() * b.element_size() for b in copied)
        self.buffer_copies: dict[int, torch.Tensor] | None = (
            {id(b): b.detach().to("cpu", copy=True) for b in copied} if total <= buffer_limit else None
        )
        params = model.parameters()
        self.params = [p for p in params if p.requires_grad]
        self.existing = {p: p.grad for p in self.params if p.grad is not None}
        self.versions = {p: g._version for p, g in self.existing.items()}
        self.saved: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._hooks = []
        if snapshot != "off":
            self._hooks = [p.register_hook(self._before_accumulate(p)) for p in self.existing]

    @property
    def copied_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def _before_accumulate(self, p: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            if p not in self.saved and p.grad is not None:
                with torch.no_grad():
                    copy = p.grad.detach().to("cpu", copy=True) if self.snapshot == "host" else p.grad.detach().clone()
                self.saved[p] = copy

        return hook

    def restore(self) -> None:
        """Put gradients, RNG states and buffers back as they were when the guard was made."""
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        self._restore_buffers()
        for p in self.params:
            if p not in self.existing:
                p.grad = None
        for p, grad in self.existing.items():
            if p in self.saved:
                copy = self.saved[p]
                p.grad = copy.to(grad.device) if copy.device != grad.device else copy
            elif p.grad is not grad or grad._version != self.versions[p]:
                raise InexactRetryError(
                    "adaptmem: out of memory after gradients from earlier micro-batches were partly "
                    "updated, and the policy keeps no copy (accumulation_snapshot='off'), so the step "
                    "cannot be retried exactly. Use accumulation_snapshot='device' or 'host'."
                )
        self.saved.clear()
        self.versions = {p: g._version for p, g in ((p, p.grad) for p in self.existing)}
        self.existing = {p: p.grad for p in self.existing}

    def changed_buffers(self) -> set[int]:
        """ids of the buffers whose contents changed since the guard was made."""
        return {id(b) for b, v in self.buffer_versions if b._version != v}

    def _restore_buffers(self) -> None:
        changed = [b for b, v in self.buffer_versions if b._version != v]
        if not changed:
            return
        copies = self.buffer_copies or {}
        missing = [b for b in changed if id(b) not in copies]
        if missing:
            raise InexactRetryError(
                f"adaptmem: out of memory after the forward changed {len(missing)} model buffer(s) "
                "(e.g. BatchNorm statistics) that had no copy, so the step cannot be retried exactly"
            )
        with torch.no_grad():
            for buf in changed:
                buf.copy_(copies[id(buf)])
        self.buffer_versions = [(b, b._version) for b, _ in self.buffer_versions]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.saved.clear()


def failure_record(err: BaseException, sample: Any, executed: tuple, predicted: float, budget: int,
                   headroom: float) -> dict:
    """What one failed attempt was: where it ran out (`phase`), the message, the plan that ran."""
    ran = sample is not None and bool(sample.blocks)
    backward = ran and any(b.bwd_start is not None for b in sample.blocks)
    text = str(err).strip()
    message = text.splitlines()[0] if text else type(err).__name__
    return {
        "phase": "backward" if backward else "forward" if ran else "before the first managed block",
        "message": message[:300],
        "plan_counts": dict(Counter(m.label for m in executed)) if ran else {},
        "predicted_peak_bytes": predicted,
        "budget_bytes": budget,
        "headroom": headroom,
    }


def oom_report(attempts: list[dict], max_retries: int) -> str:
    lines = [
        f"adaptmem: the step ran out of memory {len(attempts)} time(s) "
        f"(max_retries={max_retries}); plans tried:"
    ]
    for i, a in enumerate(attempts, 1):
        counts = ", ".join(f"{n} x {m}" for m, n in sorted(a["plan_counts"].items()))
        lines.append(
            f"  attempt {i}: {counts or 'no managed block ran'}; predicted peak "
            f"{format_bytes(a['predicted_peak_bytes'])} against budget {format_bytes(a['budget_bytes'])} "
            f"(headroom {a['headroom']:.2f}); out of memory in {a['phase']}: {a['message']}"
        )
    lines.append(
        "Lower the batch size or sequence length, allow more modes (policy 'max-savings' adds "
        "compression), or give adaptmem a larger budget."
    )
    return "\n".join(lines)
