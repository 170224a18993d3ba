"""Retrying a step after an out-of-memory error, with the training state left exact.

A failed attempt changes state that a clean step would not have: it drew
random numbers (dropout), may have updated buffers in forward (normalization
running statistics, updated in place *without* bumping the tensor version), and
may have written gradients: fresh `.grad` tensors where there were none,
additions into `.grad` tensors that already held the sum of earlier
micro-batches, or a `zero_grad()` the step function itself calls between
forward and backward. `StepGuard` undoes all of it:

  - RNG states (CPU and every initialized CUDA device) are put back;
  - every buffer is copied to the host by value when the guard is made (up to
    the policy's `buffer_snapshot_limit`), and put back where its values differ
    (`BufferCopies`: a CUDA buffer's copy is queued, not waited for);
  - fresh gradients are dropped; an existing one is copied just before backward
    first accumulates into it (a hook on the parameter runs before
    accumulation); one it zeroed in place (`zero_grad()`) stays zeroed, as the
    retry zeroes it again. The guard holds existing gradients weakly: one the
    step function dropped (`zero_grad(set_to_none=True)`, as Lightning's closure
    does between forward and backward) is freed there as without the guard, and
    is given back as dropped (None), which the retry drops again; one it
    replaced by a tensor of its own before backward cannot be given back, and
    the retry is refused with the cause.

Accumulation itself happens in place as PyTorch always does it: the recovered
step's state equals that of a clean step bit for bit. Where that cannot be
promised, `InexactRetryError` names the cause and the setting that avoids it.
"""

from __future__ import annotations

import random
import re
import sys
import weakref
from collections import Counter
from typing import Any

import torch

from adaptmem.config.units import format_bytes, parse_bytes
from adaptmem.devices.tiers import host_allocations
from adaptmem.modes import Mode
from adaptmem.registrations import ListedModules, keep_attributes, put_back_attributes


class StepOutOfMemoryError(torch.OutOfMemoryError):
    """The step ran out of memory under every plan tried; `attempts` holds them."""

    def __init__(self, message: str, attempts: list[dict]) -> None:
        super().__init__(message)
        self.attempts = attempts


class InexactRetryError(RuntimeError):
    """A retry could not restore the training state exactly; the message says why and what avoids it."""


def rng_state(host: bool = False) -> tuple:
    """The CPU's random generator state, and every initialized CUDA device's; with `host`, also
    Python's `random` and NumPy's global generator (a model may draw from them in forward:
    Wav2Vec2's SpecAugment masks with `np.random`). Those cost the host about 40 us a step, so
    they are taken where an attempt is run again (`run_step`), not for every step."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    if not host:
        return torch.get_rng_state(), cuda, None, None
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state() if numpy is not None else None


def set_rng_state(state: tuple) -> None:
    cpu, cuda, python, numpy = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if python is not None:
        random.setstate(python)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy)


class BufferCopies:
    """Host copies of a model's buffers, taken before each step; one per manager.

    A CPU buffer is copied as it stands. A CUDA buffer is copied into a pinned
    host tensor kept from step to step, queued on the current stream
    (`non_blocking`) rather than waited for: a wait at every step's start would
    leave the device idle while the host issues the step. The copy runs before
    anything the step then queues, so it holds the values the step began with;
    `settle` waits for it, before a retry reads it.
    """

    def __init__(self) -> None:
        self._pinned: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def take(self, buffers: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not buffers:
            self._pinned.clear()
            return []
        with torch.no_grad(), host_allocations():
            copies = [(b, self._pinned_copy(b) if b.is_cuda else b.detach().to("cpu", copy=True)) for b in buffers]
        if len(self._pinned) > len(buffers):  # buffers replaced or gone: their copies go too
            self._pinned = {k: v for k, v in self._pinned.items() if v[0]() is not None}
        return copies

    def _pinned_copy(self, buffer: torch.Tensor) -> torch.Tensor:
        kept = self._pinned.get(id(buffer))
        host = kept[1] if kept is not None and kept[0]() is buffer else None
        if host is None or host.shape != buffer.shape or host.dtype != buffer.dtype:
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
            self._pinned[id(buffer)] = (weakref.ref(buffer), host)
        host.copy_(buffer.detach(), non_blocking=True)
        return host

    @staticmethod
    def settle(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Wait for the queued copies of CUDA buffers to land."""
        for index in sorted({b.device.index for b, _ in copies if b.is_cuda}):
            torch.cuda.synchronize(index)


class StepGuard:
    """Remembers what a step may change (gradients, RNG, buffers, the tensors a module keeps on itself)
    so a failed attempt can be undone.

    Args:
        model: the managed model.
        snapshot: the policy's `accumulation_snapshot` ("device", "host" or "off").
        buffer_limit: the policy's `buffer_snapshot_limit` (bytes): buffers past it are not copied.
        copies: where the buffers' copies are kept from step to step (the manager's); a new one if None.
        modules: the model's modules (`ListedModules`), read in place of walking the model for its
            parameters and buffers; None walks it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        snapshot: str = "device",
        *,
        buffer_limit: int = 256 * 2**20,
        copies: BufferCopies | None = None,
        modules: ListedModules | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.rng = rng_state(host=True)
        buffers = list(model.buffers()) if modules is None else modules.tensors("_buffers")
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
        self.buffer_limit = buffer_limit
        self.buffer_copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.buffer_bytes <= buffer_limit:
            self.buffer_copies = (copies or BufferCopies()).take(buffers)
        # every parameter (tied ones twice: the restore sets each alike); those needing no gradient
        # are left out where read (a restore is rare, a step is not)
        self.params = list(model.parameters()) if modules is None else modules.tensors("_parameters", once=False)
        # what the model keeps on its modules for the next call (a recurrent layer's last state): a failed
        # attempt's forward may have set it, to a tensor that holds that forward's graph
        self.attributes = keep_attributes(model)
        self.most_copied = 0  # the most bytes of gradient copies an attempt held (`saved`)
        self._hooks: list = []
        self._hold({p: g for p in self.params if (g := p.grad) is not None and p.requires_grad})

    def _hold(self, existing: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Remember the gradients there as the attempt starts: weakly, with their versions."""
        self.existing = {p: weakref.ref(g) for p, g in existing.items()}
        self.devices = {p: g.device for p, g in existing.items()}
        self.versions = {p: g._version for p, g in existing.items()}
        self.saved: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.fresh: set[torch.nn.Parameter] = set()  # backward made their gradient in this attempt
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_hook(self._before_accumulate(p)) for p in existing]

    @property
    def copied_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def _before_accumulate(self, p: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            if p.grad is None:
                self.fresh.add(p)
            elif p not in self.saved and self.snapshot != "off" and p.grad is self.existing[p]():
                # detached, the copy records nothing in a backward that builds a graph (no grad mode to set)
                held = p.grad.detach()
                self.saved[p] = held.to("cpu", copy=True) if self.snapshot == "host" else held.clone()

        return hook

    def restore(self) -> None:
        """Put gradients, RNG states and buffers back as they were when the guard was made (a
        gradient the step function dropped stays dropped)."""
        self.most_copied = max(self.most_copied, self.copied_bytes)
        self._check_gradients()
        set_rng_state(self.rng)
        self._restore_buffers()
        put_back_attributes(self.attributes)
        for p in self.params:
            if p.requires_grad and p not in self.existing:
                p.grad = None
        for p, ref in self.existing.items():
            if p in self.saved:
                copy = self.saved[p]
                p.grad = copy.to(self.devices[p]) if copy.device != self.devices[p] else copy
            else:
                p.grad = ref()  # untouched, zeroed in place (the retry zeroes it again), or dropped (again)
        self._hold({p: p.grad for p in self.existing if p.grad is not None})

    def _check_gradients(self) -> None:
        """Refuse, before changing anything, a retry that could not be exact."""
        replaced = [
            p
            for p, ref in self.existing.items()
            if ref() is None and p not in self.saved and p.grad is not None and p not in self.fresh
        ]
        if replaced:
            raise InexactRetryError(
                f"adaptmem: the step function replaced {len(replaced)} gradient(s) from earlier steps by "
                "tensors of its own before backward, which a retry cannot give back. Make that change "
                "outside the function given to run_step (after it returns), or drop them "
                "(zero_grad(set_to_none=True))."
            )
        changed = [
            p
            for p, ref in self.existing.items()
            if p not in self.saved and (g := ref()) is not None and g._version != self.versions[p]
        ]
        if not changed:
            return
        if self.snapshot == "off":
            raise InexactRetryError(
                f"adaptmem: out of memory after {len(changed)} gradient(s) from earlier micro-batches were "
                "partly updated, and the policy keeps no copy (accumulation_snapshot='off'), so the step "
                "cannot be retried exactly. Set accumulation_snapshot='device' (or 'host') in the policy."
            )
        scaled = [p for p in changed if bool(self.existing[p]().detach().ne(0).any())]
        if scaled:
            raise InexactRetryError(
                f"adaptmem: the step function changed {len(scaled)} existing gradient(s) in place before "
                "backward (something other than zero_grad), which a retry would apply twice. Make that "
                "change outside the function given to run_step (after it returns)."
            )

    def _restore_buffers(self) -> None:
        if self.buffer_copies is None:
            raise InexactRetryError(
                f"adaptmem: the model's buffers take {format_bytes(self.buffer_bytes)}, more than the "
                f"{format_bytes(self.buffer_limit)} copied before each step, so a retry cannot put back "
                "what the failed attempt changed in them (normalization statistics, say). Raise "
                "buffer_snapshot_limit in the policy."
            )
        BufferCopies.settle(self.buffer_copies)
        with torch.no_grad():
            for buffer, copy in self.buffer_copies:
                if not torch.equal(buffer, copy.to(buffer.device)):
                    buffer.copy_(copy)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.saved.clear()


def _shortened(text: str, limit: int = 300) -> str:
    """`text` within `limit` characters: whole sentences where they fit, else whole words and "...",
    never a word cut in two (an allocator's message runs to several sentences of advice)."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    end = cut.rfind(". ")
    if end >= limit // 3:
        return cut[: end + 1]
    return cut[: limit - 4].rsplit(" ", 1)[0] + " ..."


BEFORE_BLOCKS = "before the first managed block"  # a failed attempt's phase where no block ran
HEAD = "the loss head"  # every block's forward ended, and no block's backward began: the head, the loss, their backward


def failure_phase(sample: Any, blocks: int) -> str:
    """Where a failed attempt ran out: before its blocks, in their forward, in the loss head (every
    block's forward ended and no backward began; known in a step measured block by block), or in
    backward. `blocks`: the model's managed blocks."""
    ran = sample is not None and bool(sample.blocks)
    if ran and sample.backward_reached:
        return "backward"
    if ran and sample.detailed and len(sample.blocks) >= blocks > 0 and all(b.end for b in sample.blocks):
        return HEAD
    return "forward" if ran else BEFORE_BLOCKS


_WANTED = re.compile(r"Tried to allocate ([0-9.]+ (?:B|KiB|MiB|GiB|TiB))")
_FREE = re.compile(r"of which ([0-9.]+ (?:B|KiB|MiB|GiB|TiB)) is free")


def lacked(err: BaseException) -> float | None:
    """What an out-of-memory error's allocation lacked: the bytes it asked for less those free, as
    CUDA's message (and the stand-in's) says them; None where the message does not say both."""
    text = str(err)
    wanted, free = _WANTED.search(text), _FREE.search(text)
    if wanted is None or free is None:
        return None
    short = parse_bytes(wanted[1]) - parse_bytes(free[1])
    return short if short > 0 else None


def phase_text(phase: str) -> str:
    """Where an attempt ran out, as the messages write it: "in forward", "before the first managed block",
    "in the loss head or the loss" (what runs after every block's forward: the head, and the user's
    loss code, a distillation's KL over two models' logits among it)."""
    if phase == HEAD:
        return "in the loss head or the loss, after every block's forward"
    return phase if phase == BEFORE_BLOCKS else f"in {phase}"


def failure_record(
    err: BaseException,
    sample: Any,
    executed: tuple,
    predicted: float,
    budget: int,
    headroom: float,
    available: int | None = None,
    blocks: int = 0,
) -> dict:
    """What one failed attempt was: where it ran out (`phase`), the message, the plan that ran.
    `blocks`: the model's managed blocks, whose forwards all ended where the head ran out."""
    ran = sample is not None and bool(sample.blocks)
    text = str(err).strip()
    message = text.splitlines()[0] if text else type(err).__name__
    return {
        "phase": failure_phase(sample, blocks),
        "message": _shortened(message),
        "plan_counts": dict(Counter(m.label for m in executed)) if ran else {},
        "head": sample.head.label if ran and sample.head is not None else None,
        "predicted_peak_bytes": predicted,
        "budget_bytes": budget,
        "headroom": headroom,
        "available_bytes": available,  # the device's usable memory just after (None: no capacity known)
    }


#: Added to an out-of-memory error raised through `with mem.step():`, which does not retry.
RETRY_NOTE = (
    "adaptmem: `with mem.step():` records this out-of-memory error (the same batch run again gets a plan "
    "predicted lower) but does not retry it. To have it retried under a tighter plan, with the gradients "
    "left exact, run the forward and backward through `mem.run_step(fn, *args)`."
)


def add_note(err: BaseException, note: str) -> None:
    """Append `note` to `err`'s message, so `str(err)` says it too (a `__notes__` entry is shown only
    in tracebacks), keeping the error's type and traceback."""
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}", *err.args[1:])
    elif hasattr(err, "add_note"):
        err.add_note(note)


def counts_text(counts: dict[str, int]) -> str:
    """A plan's modes counted, as the messages write them: "2 x CHECKPOINT, 2 x NONE"."""
    return ", ".join(f"{n} x {m}" for m, n in sorted(counts.items()))


def attempt_text(attempt: dict) -> str:
    """A failed attempt's plan and prediction, as the messages write them: "4 x CHECKPOINT; head
    CHUNKED:512; predicted peak 203.95 MiB" (no prediction: the first step's calibration plan)."""
    if not attempt["plan_counts"]:
        return "no managed block ran, so no plan"  # nor a prediction: a step is planned at its first block
    plan = counts_text(attempt["plan_counts"])
    if attempt.get("head"):
        plan += f"; head {attempt['head']}"
    predicted = attempt["predicted_peak_bytes"]
    return plan + (f"; predicted peak {format_bytes(predicted)}" if predicted else "; not predicted (calibration)")


#: The advice on memory after out-of-memory errors: they come from the device, not from the budget
#: (the plans' aim, which a step may pass), so a larger budget would only have the plans aim higher.
ROOM = "make room on the device (memory other processes or your own tensors hold, or a larger device)"


def kept_head_text(why: str) -> str:
    """Why a refused or given-up batch's plans keep the loss head whole, and what would chunk it."""
    return (
        f"  The loss head is kept whole for the rest of this run: a step used its chunked logits beyond what "
        f"a chunk replays ({why}), so its logits are made whole, and they take the most memory at long "
        "lengths. Leave the logits to the loss (docs/loss-head.md says which maps of them are replayed), or "
        "take what you need of them from a smaller batch, to have the head chunked in a new run."
    )


def oom_report(
    attempts: list[dict],
    max_retries: int,
    compression_allowed: bool = False,
    snapshot: tuple[str, int] = ("", 0),
    head_kept_for: str | None = None,
) -> str:
    """`snapshot`: the policy's `accumulation_snapshot` and the most bytes of gradient copies an
    attempt held (gradients from earlier micro-batches, copied before backward added into them).
    `head_kept_for`: why the loss head is kept for good (`PlanBook.keep_head`), said where an
    attempt kept it."""
    lines = [f"adaptmem: the step ran out of memory {len(attempts)} time(s) (max_retries={max_retries}); plans tried:"]
    for i, a in enumerate(attempts, 1):
        lines.append(
            f"  attempt {i}: {attempt_text(a)} against budget {format_bytes(a['budget_bytes'])} "
            f"(headroom {a['headroom']:.2f}); out of memory {phase_text(a['phase'])}: {a['message']}"
        )
    if head_kept_for is not None and any(a.get("head") == "KEPT" for a in attempts):
        lines.append(kept_head_text(head_kept_for))
    if attempts and all(a["phase"] == BEFORE_BLOCKS for a in attempts):  # no mode saves anything there
        lines.append(
            "Every attempt ran out before the first managed block ran, where no mode saves memory (given up "
            "after a second attempt found no more room than the first): lower the batch size or sequence "
            f"length, or {ROOM} (what the step holds before its blocks, the weights, gradients and optimizer "
            "state among it, takes from it). What runs there is the step's code before the model's blocks (a "
            "teacher model's forward in distillation) or the model's own: an "
            "attention mask built for the whole sequence (packed sequences' position_ids make one of batch x "
            "length x length on the eager and SDPA paths), or a layer that holds much, such as an audio model's "
            "convolutional feature encoder, which can be made a block with `blocks=`."
        )
    elif attempts and all(a["phase"] == HEAD for a in attempts):
        lines.append(
            "Every attempt ran out in the loss head or the loss (the step's code after the model, a "
            "distillation's KL over two models' logits among it), after every block's forward, where the "
            "blocks hold the least they can under the modes tried: lower the tokens a batch (the batch size "
            f"or sequence length), or {ROOM}."
        )
    else:
        # compression holds more than a plan that keeps none of the blocks' saved tensors on the device
        offloaded = any(a["plan_counts"] and all(Mode.parse(m).offloads for m in a["plan_counts"]) for a in attempts)
        more = "" if compression_allowed or offloaded else " allow more modes (policy 'max-savings' adds compression),"
        lines.append(f"Lower the batch size or sequence length,{more} or {ROOM}.")
    how, copied = snapshot
    if copied and how == "device":
        lines.append(
            f"Each attempt held up to {format_bytes(copied)} of copies of the gradients earlier micro-batches "
            "left, taken so that a retry is exact (the policy's accumulation_snapshot='device'): 'host' keeps "
            "them in host memory instead, 'off' keeps none (an error in such a micro-batch then raises "
            "InexactRetryError rather than retry)."
        )
    return "\n".join(lines)


def plan_text(modes: tuple, head: Any) -> str:
    """A plan as the messages write it: `1 x CHECKPOINT, 3 x NONE; head CHUNKED:256`."""
    text = counts_text(Counter(m.label for m in modes))
    return text + (f"; head {head.label}" if head is not None else "")


class RetryGuard:
    """What `run_step` needs to take a batch again: the failures of the batch in hand, the
    controller's state before it (a `Trace`, put back when the batch is given up), and the
    buffers' host copies kept from step to step."""

    def __init__(self) -> None:
        self.attempts: list[dict] = []  # the failures of the batch in hand (since the last step that ran)
        self.trace: Any = None  # the controller as it was before that batch (adaptmem.control.unfit.Trace)
        self.last_failure: dict = {}
        self._copies = BufferCopies()
        self._modules: ListedModules | None = None

    def new_batch(self, trace: Any) -> None:
        self.trace, self.attempts = trace, []

    def failed(self, record: dict) -> None:
        self.last_failure = record
        self.attempts.append(dict(record))

    def succeeded(self) -> None:
        self.attempts = []

    def before_blocks_again(self) -> bool:
        """The batch's last two attempts ran out before the first managed block: no mode saves memory
        there, and the retry after the first (memory freed, a moment later) did not make room, so
        the batch is given up rather than run to `max_retries`."""
        return len(self.attempts) >= 2 and all(a["phase"] == BEFORE_BLOCKS for a in self.attempts[-2:])

    def guard(self, model: torch.nn.Module, snapshot: str, buffer_limit: int) -> StepGuard:
        """A `StepGuard` for one batch: what it changes can be undone before a retry."""
        if self._modules is None:
            self._modules = ListedModules(model)
        return StepGuard(model, snapshot, buffer_limit=buffer_limit, copies=self._copies, modules=self._modules)

    def report(
        self,
        max_retries: int,
        compression_allowed: bool,
        snapshot: tuple[str, int] = ("", 0),
        head_kept_for: str | None = None,
    ) -> StepOutOfMemoryError:
        """The error for a batch every retry failed: each attempt, what it ran, and what to do."""
        return StepOutOfMemoryError(
            oom_report(self.attempts, max_retries, compression_allowed, snapshot, head_kept_for), list(self.attempts)
        )
