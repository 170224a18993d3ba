"""Ranks that agree: one plan for every rank at every step, and retries taken together.

Under `torch.distributed` (a process group initialized, more than one rank),
each manager talks to the others at three points of a step, always in the same
order on every rank, so no collective waits on a rank that took another path:

  the plan point   (first managed block's forward) the largest shape and
                   allocation and the smallest budget are reduced across ranks,
                   and rank 0's plan for them (blocks and loss head) is broadcast:
                   every rank runs it;
  the step's end   whether any rank ran out of memory; if one did, every rank
                   records the failure, puts its state back and retries;
  a clean end      the worst peak / budget ratio, so every decider moves alike,
                   and the gradients are averaged across ranks (see below).

A rank that runs out of memory before its plan point still joins the plan
collectives with empty figures. Under FSDP2 the step has collectives of its own
between these points: a rank that fails takes part in the rest of them with
zeros (`adaptmem.control.sharded`), then in the step's end. Under
`DistributedDataParallel` the managed step runs inside `no_sync()` and the
gradients are averaged here once every rank has succeeded, exactly as DDP's
default hook does (divide by the world size, then sum): a rank failing in
backward can then never leave DDP's reducer waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from adaptmem.config.policy import Policy, PolicyError
from adaptmem.control.headcosts import KEPT, HeadChoice
from adaptmem.control.sharded import STEP_END, ShardedSteps, Stopped, fsdp_modules, split_blocks
from adaptmem.modes import LADDER, HeadMode, Mode

_NO_HEAD, _KEPT = -2, -1  # the head's code in a broadcast plan; a chunked head's is its chunk


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class RankAgreement:
    def __init__(self) -> None:
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # gloo reduces CPU tensors; NCCL needs them on the rank's device
        backend = dist.get_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def figures(
        self, batch: int, extent: int, start: int, budget: int, bias: float = 0.0, fill: float = 1.0
    ) -> tuple[int, int, int, int, float, float]:
        """(largest batch, largest extent, largest start, smallest budget, largest bias, smallest
        fill) across ranks: rank 0 plans for every rank, so with the predictions' bias and the fill
        that are safest for all (each rank learns its own from its own peaks)."""
        scale = 1_000_000
        figures = [batch, extent, start, -budget, round(bias * scale), -round(fill * scale)]
        t = torch.tensor(figures, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        b, e, s, nb, bi, nf = (int(v) for v in t.tolist())
        return b, e, s, -nb, bi / scale, -nf / scale

    def plan(
        self, modes: tuple[Mode, ...], head: HeadChoice | None = None
    ) -> tuple[tuple[Mode, ...], HeadChoice | None]:
        """Rank 0's plan, the blocks' modes and the loss head's choice, on every rank."""
        code = _NO_HEAD if head is None else _KEPT if head.chunk is None else head.chunk
        t = torch.tensor([LADDER.index(m) for m in modes] + [code], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        *indices, code = t.tolist()
        head = None if code == _NO_HEAD else KEPT if code == _KEPT else HeadChoice(HeadMode.CHUNKED, code)
        return tuple(LADDER[i] for i in indices), head

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def same_policy(self, policy: Policy) -> None:
        """Raise `PolicyError` on every rank unless every rank runs this policy (its settings, not its
        name): ranks that decide differently would run different plans."""
        digest = hashlib.sha256(policy.model_dump_json(exclude={"name"}).encode()).digest()
        mine = int.from_bytes(digest[:7], "big")
        t = torch.tensor([mine, -mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise PolicyError(
                f"adaptmem: the ranks run different policies (rank {self.rank} runs {policy.name!r}); every rank "
                "must run the same one, or their plans would differ. Pass the same policy= (and budget fractions) "
                "on every rank, and check that ADAPTMEM_POLICY is set alike in every rank's environment."
            )

    def check(self, flag: bool, phase: int) -> tuple[bool, int]:
        """(whether any rank raised its flag, the largest phase any rank is at): the first step's
        checks under FSDP2, where a rank that failed signals from outside the step (`sharded`)."""
        t = torch.tensor([1 if flag else 0, phase], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0].item()), int(t[1].item())

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
        self.sharded: ShardedSteps | None = None  # under FSDP2 with other ranks: the steps' collectives
        self._looked = False  # for FSDP2 modules, at the first step (`fully_shard` may come after `manage`)
        self.deferring = False  # inside run_step: a failed rank catches up once the attempt is freed
        self._pending: tuple[Callable[[], tuple[Mode, ...]], bool] | str | None = None

    def begin_attempt(self, model: torch.nn.Module, blocks: Iterable, policy: Policy) -> None:
        """A step's attempt starts: its FSDP2 collectives are logged from here. At the first, every
        rank checks that all run one policy, and that no block (`blocks`: their handles, with `name`
        and `module`) spans two FSDP2 units; a rank that finds either raises, and so does every other,
        at the same point. Alone, it does nothing."""
        if self.agree is None:
            return
        if not self._looked:
            self._looked = True
            self.agree.same_policy(policy)
            modules = fsdp_modules(model)
            if modules:
                split_blocks([(h.name, h.module) for h in blocks], modules)
                self.sharded = ShardedSteps(modules, self.agree.check)
        if self.sharded is not None:
            self.sharded.begin_attempt()

    def plan_point(self) -> None:
        if self.sharded is not None:
            self.sharded.plan_point()

    def close(self) -> None:
        if self.sharded is not None:
            self.sharded.close()

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

    def join_plan_point(self, modes: tuple[Mode, ...], retrying: bool) -> None:
        """A rank that failed before its plan point still takes part in the plan collectives (and, in
        a retry, in the vote on giving the batch up)."""
        self.agree.figures(0, 0, 0, 2**62)
        self.agree.plan(modes)
        if retrying:
            self.agree.any(False)

    def failure(
        self,
        error: BaseException | None,
        joined: bool,
        modes: Callable[[], tuple[Mode, ...]],
        retrying: bool = False,
        refused: bool = False,
    ) -> BaseException | None:
        """When any rank ran out of memory in this step, every rank records it. `joined`: this rank
        took part in the plan point's collectives (else it joins them now, with the `modes()` it runs);
        `retrying`: the attempt retries a failed one; `refused`: every rank gave the batch up together
        at the plan point. Under FSDP2 a rank that failed first runs the rest of the step's collectives;
        inside run_step it does so once the attempt's memory is freed (`catch_up`)."""
        if self.agree is None:
            return error
        oom = isinstance(error, torch.OutOfMemoryError)
        sharded = self.sharded
        if sharded is not None and sharded.checking and not refused:
            return self._first_step_end(error, oom)
        if oom and not refused and sharded is not None and sharded.can_catch_up():
            if self.deferring:
                self._pending = (modes, retrying)
                return error
            sharded.catch_up(lambda: self.join_plan_point(modes(), retrying))
        elif oom and not joined:
            self.join_plan_point(modes(), retrying)
        failed = self.agree.any(oom)
        if sharded is not None and not failed:
            sharded.succeeded()
        if failed and not oom and error is None:
            return torch.OutOfMemoryError("another rank ran out of memory in this step")
        return error

    def _first_step_end(self, error: BaseException | None, oom: bool) -> BaseException | None:
        """The end of an attempt under FSDP2 before any step succeeded (no template to catch up
        with: `sharded` checks before each collective instead). A rank stopped at a check joins the
        others at the end; a rank that failed signals, once freed inside run_step."""
        if isinstance(error, Stopped):
            self.sharded.reset()
            self.agree.check(True, STEP_END)
            return error
        if oom:
            if self.deferring:
                self._pending = "signal"
                return error
            self.sharded.signal()
            return error
        failed, _ = self.agree.check(False, STEP_END)
        if failed:
            return torch.OutOfMemoryError("another rank ran out of memory in this step")
        self.sharded.succeeded()
        return error

    def catch_up(self) -> None:
        """After a failed attempt is freed (run_step): this rank's part in the rest of the step's
        FSDP2 collectives, then in its end, where the other ranks learn of the failure."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending == "signal":
            self.sharded.signal()
            return
        modes, retrying = pending
        self.sharded.catch_up(lambda: self.join_plan_point(modes(), retrying))
        self.agree.any(True)
