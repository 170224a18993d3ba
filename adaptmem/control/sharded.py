"""FSDP2 (`fully_shard`) across ranks: a rank that runs out of memory takes part in the rest
of the step's collectives, so every rank can retry it together.

Under FSDP2 a step is a fixed sequence of collectives: an all-gather before each
sharded module's forward (and again before its backward, where it resharded after
forward), a reduce-scatter after its backward, and the manager's own plan point
between them. A rank whose forward or backward stops on an out-of-memory error
leaves the others inside the next one. So the sequence is logged as it is issued
(through FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter`, around the
communication FSDP2 would use anyway), and a step that succeeded is kept as the
template. A rank that fails then, once it has freed what the attempt held, resets
FSDP2's per-step state (`FSDPModule.reset_iter_state`), drops the gradients its
gathered parameters took before the failure, and runs the rest of the template with
zeros of the same sizes: the other ranks finish their step, learn at its end that
one rank failed, and every rank puts its state back and retries. What the failing
rank sent is discarded with the attempt, so the gradients stay exact.

Before any step has succeeded there is no template: then every rank checks, with a
small all-reduce before each of FSDP2's collectives and before the plan point,
whether a rank failed; one that did signals at the others' next check, which
stops their step there (`Stopped`), and all meet at its end. That costs a
collective per collective, in the first step only.

On the CPU (gloo) a collective runs on the backend's worker thread, which lets go
of its buffers only after the caller has been told it finished: in about one call
in five, on two busy cores, the buffers outlived the call, so a buffer FSDP2 frees
right after (an all-gather's output once copied out, a reduce-scatter's input) was
freed at a moment the thread scheduler chose, and the same step under the same plan
peaked 0.57 MB higher one time than another. So after each of FSDP2's collectives on
the CPU, the rank yields until the worker has let go of them (`_settle`, at most
`SETTLE_S`).

Not covered (said once, as a warning): a torch whose FSDP2 has no `reset_iter_state`,
FSDP2 modules with a communication of the user's own or several parameter groups, and a
2-D (HSDP) mesh, whose all-reduce runs outside that communication.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("adaptmem")

PLAN_POINT = "plan point"  # the manager's own collectives, at the first managed block's forward

SETTLE_S = 0.05  # the longest a rank waits for gloo's worker to let go of a collective's buffers

# Phases of the first step's checks (`RankAgreement.check`): what a rank is doing when it takes part.
FAILING, BEFORE_COLLECTIVE, BEFORE_PLAN, STEP_END = 0, 1, 2, 3


class Stopped(torch.OutOfMemoryError):
    """Raised on a rank whose step is stopped at a check because another rank ran out of memory."""


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that `fully_shard` has wrapped, in `model.modules()` order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def split_blocks(blocks: list[tuple[str, nn.Module]], modules: list[nn.Module]) -> None:
    """Raise ValueError naming the blocks that span two FSDP2 units (a block with a sharded module
    inside it): its parameters are gathered in parts, so its costs and its recompute's gathers are
    not the block's alone."""
    sharded = {id(m) for m in modules}
    split = []
    for name, block in blocks:
        inner = [n for n, m in block.named_modules() if n and id(m) in sharded]
        if inner:
            split.append(f"{name} ({', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''} sharded apart)")
    if split:
        raise ValueError(
            f"adaptmem: {len(split)} block(s) span two FSDP2 units: {'; '.join(split[:3])}. Shard each block "
            "whole (fully_shard(block), then fully_shard(model)), or select as blocks the modules you shard "
            "(manage(..., blocks=...))."
        )


class _Logged:
    """FSDP2's communication for one kind of collective, logging each call in the step's sequence."""

    def __init__(self, steps: ShardedSteps, inner: Any) -> None:
        self.steps = steps
        self.inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, *args: Any, **kwargs: Any):
        if self.steps.checking:
            self.steps.checked(BEFORE_COLLECTIVE)
        self.steps.now.append(_Call(self.inner, output_tensor, input_tensor, group, args, kwargs))
        held = _uses(output_tensor, input_tensor)
        work = self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        if work is None:  # run to its end (asked for without async_op)
            _settle(held)
        return work


class _Call:
    """One collective of a step, as FSDP2 issued it: enough to issue it again with zeros."""

    __slots__ = ("comm", "out_shape", "in_shape", "dtype", "device", "group", "args", "kwargs")

    def __init__(self, comm: Any, output: torch.Tensor, input: torch.Tensor, group: Any, args: tuple, kwargs: dict):
        self.comm, self.group, self.args = comm, group, args
        self.out_shape, self.in_shape, self.dtype, self.device = output.shape, input.shape, input.dtype, input.device
        self.kwargs = {**kwargs, "async_op": False} if "async_op" in kwargs else kwargs

    def again(self) -> None:
        """The same collective with zeros for this rank's part, waited for."""
        output = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        zeros = torch.zeros(self.in_shape, dtype=self.dtype, device=self.device)
        held = _uses(output, zeros)
        work = self.comm(output, zeros, self.group, *self.args, **self.kwargs)
        if work is not None:
            work.wait()
        _settle(held)


class ShardedSteps:
    """The collective sequence of a managed FSDP2 model's steps, and the catch-up of a rank
    that failed in one (see the module's docstring)."""

    def __init__(self, modules: list[nn.Module], check: Callable[[bool, int], tuple[bool, int]]) -> None:
        self.modules = modules
        self.check = check  # RankAgreement.check
        self.now: list = []  # what this attempt issued so far: `_Call`s and PLAN_POINT
        self.template: list | None = None  # what the last successful attempt issued
        self.installed: list[tuple[nn.Module, Any, Any]] = []
        missing = _missing(modules)
        if missing is None:
            self._install()
        else:
            log.warning(
                "adaptmem: under FSDP2, an out-of-memory error on one rank cannot be retried here (%s): "
                "the other ranks would wait in FSDP2's collectives. Give the run a budget with room.",
                missing,
            )

    def _install(self) -> None:
        for module in self.modules:
            groups = module._get_fsdp_state()._fsdp_param_groups
            gather, scatter = groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm
            module.set_custom_all_gather(_Logged(self, gather))
            module.set_custom_reduce_scatter(_Logged(self, scatter))
            self.installed.append((module, gather, scatter))

    def close(self) -> None:
        """Put FSDP2's own communication back."""
        for module, gather, scatter in self.installed:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
        self.installed.clear()

    @property
    def active(self) -> bool:
        return bool(self.installed)

    def begin_attempt(self) -> None:
        self.now = []

    def plan_point(self) -> None:
        if self.checking:
            self.checked(BEFORE_PLAN)
        self.now.append(PLAN_POINT)

    @property
    def checking(self) -> bool:
        """No step has succeeded yet, so a failed rank has no template to catch up with: every rank
        checks before each collective whether one failed (a small all-reduce each, first step only)."""
        return self.active and self.template is None

    def checked(self, phase: int) -> None:
        """A check before a collective: stop this rank's step if another rank failed."""
        failed, _ = self.check(False, phase)
        if failed:
            raise Stopped("another rank ran out of memory in this step (stopped before FSDP2's next collective)")

    def signal(self) -> None:
        """This rank failed in a first step: reset FSDP2, then tell the others at their next check
        (they stop, and meet it at the step's end) or at the step's end itself."""
        self.reset()
        self.now = []
        while True:
            _, phase = self.check(True, FAILING)
            if phase in (FAILING, STEP_END):  # the others were at the step's end, or failed as well
                return

    def reset(self) -> None:
        _reset(self.modules)

    def succeeded(self) -> None:
        self.template = self.now
        self.now = []

    def can_catch_up(self) -> bool:
        return self.active and self.template is not None and len(self.now) <= len(self.template)

    def catch_up(self, join_plan_point: Callable[[], None]) -> None:
        """After this rank failed: reset FSDP2's per-step state, drop what its gathered parameters
        accumulated, and run the rest of the template's collectives with zeros."""
        self.reset()
        done, self.now = len(self.now), []
        for entry in self.template[done:]:
            if entry is PLAN_POINT:
                join_plan_point()
            else:
                entry.again()


def _uses(*tensors: torch.Tensor) -> list[tuple[Any, int]]:
    """(storage, its references now) of CPU tensors, for `_settle`; none where this torch cannot
    count a storage's references, or on a GPU (NCCL's buffers are freed by FSDP2's own stream
    ordering)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return []
    found = {}
    for t in tensors:
        if t.device.type == "cpu":
            st = t.untyped_storage()
            found.setdefault(st._cdata, (st, count(st._cdata)))
    return list(found.values())


def _settle(held: list[tuple[Any, int]]) -> None:
    """Yield until the backend holds no more references to these storages than before the
    collective (gloo's worker drops its own just after it reports the collective finished), so a
    buffer FSDP2 frees next is freed then; at most `SETTLE_S`."""
    if not held:
        return
    count, deadline = torch._C._storage_Use_Count, None
    while any(count(st._cdata) > before for st, before in held):
        now = time.perf_counter()
        deadline = deadline or now + SETTLE_S
        if now > deadline:
            return
        time.sleep(0)


def _missing(modules: list[nn.Module]) -> str | None:
    """Why a failed rank could not catch up under these modules, or None."""
    for module in modules:
        if not hasattr(module, "reset_iter_state"):
            return f"this torch {torch.__version__} has no FSDPModule.reset_iter_state"
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            return "FSDP2's parameter groups were not found"
        if len(groups) > 1:
            return f"{type(module).__name__} has several parameter groups"
        for group in groups:
            for comm in (getattr(group, "_all_gather_comm", None), getattr(group, "_reduce_scatter_comm", None)):
                if comm is None or not type(comm).__name__.startswith("Default"):
                    return f"{type(module).__name__} has a communication of its own ({type(comm).__name__})"
            mesh = getattr(group, "mesh_info", None)
            if getattr(getattr(mesh, "mesh", None), "ndim", 1) != 1:
                return "the mesh has two dimensions (HSDP)"
    return None


def _reset(modules: list[nn.Module]) -> None:
    """FSDP2 as after a step that ran to its end: the root's `reset_iter_state` (reshard, clear the
    step's trackers), and no gradient left on a gathered parameter (backward stopped before its
    reduce-scatter took it, and the retry would add to it)."""
    for module in modules:
        try:
            module.reset_iter_state()
        except RuntimeError:  # not a root: the root resets every module under it
            continue
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
