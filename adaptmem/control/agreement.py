"""Ranks that agree: one plan for every rank at every step, and retries taken together.

Under `torch.distributed` (a process group initialized, more than one rank),
each manager talks to the others at three points of a step, always in the same
order on every rank, so no collective waits on a rank that took another path:

  the plan point   (first managed block's forward) the largest shape and
                   allocation and the smallest budget are reduced across ranks,
                   and rank 0's plan for them is broadcast: every rank runs it;
  the step's end   whether any rank ran out of memory; if one did, every rank
                   records the failure, puts its state back and retries;
  a clean end      the worst peak / budget ratio, so every decider moves alike,
                   and the gradients are averaged across ranks (see below).

A rank that runs out of memory before its plan point still joins the plan
collectives with empty figures. Under `DistributedDataParallel` the managed step
runs inside `no_sync()` and the gradients are averaged here once every rank has
succeeded, exactly as DDP's default hook does (divide by the world size, then
sum): a rank failing in backward can then never leave DDP's reducer waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from adaptmem.modes import LADDER, Mode


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class RankAgreement:
    def __init__(self) -> None:
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # gloo reduces CPU tensors; NCCL needs them on the rank's device
        backend = dist.get_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def figures(self, batch: int, extent: int, start: int, budget: int) -> tuple[int, int, int, int]:
        """(largest batch, largest extent, largest start, smallest budget) across ranks."""
        t = torch.tensor([batch, extent, start, -budget], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        b, e, s, nb = (int(v) for v in t.tolist())
        return b, e, s, -nb

    def plan(self, modes: tuple[Mode, ...]) -> tuple[Mode, ...]:
        """Rank 0's plan, on every rank."""
        t = torch.tensor([LADDER.index(m) for m in modes], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return tuple(LADDER[i] for i in t.tolist())

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def worst(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """What DDP's default communication hook does to each gradient: divide by the world
        size, then sum across ranks."""
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.world)
                    dist.all_reduce(p.grad)


class Ranks:
    """The manager's side of the agreement: `agree` is None alone, a `RankAgreement` with other ranks.

    `ddp`: the model's `DistributedDataParallel` wrapper, if any. Its gradient reduction is held
    off inside a step (`no_sync`) and done by `average_gradients` once every rank succeeded.
    """

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel | None) -> None:
        self.agree = RankAgreement() if distributed() else None
        self.rank = self.agree.rank if self.agree is not None else 0
        self._ddp = ddp
        self._syncing = False  # this step runs in DDP's no_sync(): gradients are averaged after it

    @property
    def alone(self) -> bool:
        return self.agree is None

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Under DDP with other ranks: no gradient reduction inside the step (a rank that fails
        in backward would leave DDP's reducer waiting); `average_gradients` does it after."""
        if self.agree is not None and self._ddp is not None and self._ddp.require_backward_grad_sync:
            self._syncing = True
            return self._ddp.no_sync()
        self._syncing = False
        return contextlib.nullcontext()

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        if self.agree is not None and self._syncing:
            self.agree.average_gradients(params)

    def join_plan_point(self, modes: tuple[Mode, ...]) -> None:
        """A rank that failed before its first block still takes part in the plan collectives."""
        self.agree.figures(0, 0, 0, 2**62)
        self.agree.plan(modes)

    def failure(
        self, error: BaseException | None, joined: bool, modes: Callable[[], tuple[Mode, ...]]
    ) -> BaseException | None:
        """When any rank ran out of memory in this step, every rank records it. `joined`: this rank
        took part in the plan point's collectives (else it joins them now, with the `modes()` it runs)."""
        if self.agree is None:
            return error
        oom = isinstance(error, torch.OutOfMemoryError)
        if oom and not joined:
            self.join_plan_point(modes())
        if self.agree.any(oom) and not oom and error is None:
            return torch.OutOfMemoryError("another rank ran out of memory in this step")
        return error
