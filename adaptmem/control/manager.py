"""MemoryManager: plans per batch for the memory actually free, and survives OOMs.

Per step: at the first managed block's forward, the live input's shape picks a
plan (cached per shape bucket, made by the planner from the cost model); the
blocks run; at the step's end the recorder's measurements teach the cost model
and the watermark controller decides to hold, escalate or relax. A background
thread watches for memory taken by others: the budget shrinks at once and the
blocks not yet run in the current forward get a tighter plan. `run_step` runs a
step and retries it under a tighter plan after an out-of-memory error, with the
gradients restored exactly.

Lifecycle, for frameworks that drive it from hooks: build it (or use `with`),
bracket each forward+backward with `begin_step(label)` / `end_step(error)`
(`step()` and `run_step()` do it for you), and `close()` it (twice is harmless).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from adaptmem.config.budget import Budget, resolve_budget
from adaptmem.config.policy import Policy, load_policy
from adaptmem.control.agreement import RankAgreement, distributed
from adaptmem.control.budgeting import BudgetKeeper
from adaptmem.control.compiling import CompileCounter
from adaptmem.control.costs import CostModel
from adaptmem.control.decisions import Decider
from adaptmem.control.events import SCHEMA_VERSION, EventLog
from adaptmem.control.headcosts import HeadChoice, HeadCosts
from adaptmem.control.plans import PlanBook
from adaptmem.control.priors import priors_for
from adaptmem.control.reach import LengthsSeen, Reach, Reacher, end_record
from adaptmem.control.reactions import Reactions
from adaptmem.control.recorder import StepRecorder
from adaptmem.control.resume import (
    announce_resume,
    load_manager_state,
    manager_state,
    manager_summary,
    restore_manager_state,
)
from adaptmem.control.retry import (
    RETRY_NOTE,
    BufferCopies,
    StepGuard,
    StepOutOfMemoryError,
    add_note,
    oom_report,
    rng_state,
    set_rng_state,
)
from adaptmem.control.sampler import Sampler
from adaptmem.control.samples import StepState
from adaptmem.control.schedule import MeasureSchedule
from adaptmem.control.unfit import Trace
from adaptmem.devices.cuda import CudaProbe
from adaptmem.devices.host import HostProbe
from adaptmem.devices.select import make_probe
from adaptmem.modes import Mode
from adaptmem.strategies import CompressOptions, SelectiveBackwardError
from adaptmem.wrapping import (
    BlockHandle,
    BlockSelection,
    HeadHandle,
    HeadSelection,
    find_blocks,
    find_head,
    get_instrumentation,
    instrument,
    restore,
    tell_observer,
    unwrap,
)


class MemoryManager(Reactions):
    """Adaptive activation memory for one model; see `adaptmem.manage` for the arguments.

    Everything that can fail (policy, budget, block selection, log path, probe,
    the background thread) fails before the model is changed, or the change is
    undone: a failed construction leaves the model exactly as it was.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        policy: str | Policy | None = None,
        budget: Budget = None,
        device: Any = None,
        blocks: BlockSelection = "auto",
        log: str | None = None,
        head: HeadSelection = "auto",
        state: dict[str, Any] | None = None,
    ) -> None:
        """`state`: a saved `state_dict()` to continue, loaded before the `start` record so that the
        whole run is logged under the saved run id (`load_state_dict` comes after a fresh `start`)."""
        self._ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        model = unwrap(model)  # blocks are named inside DDP / torch.compile wrappers
        self.policy = p = load_policy(policy)
        self.probe = make_probe(device, model)
        self._device = device
        existing = get_instrumentation(model)
        if existing is not None and existing.runtime.observer is not None:
            raise RuntimeError("this model is already managed by another adaptmem.manage(); close that one first")
        self.budgets = BudgetKeeper(resolve_budget(budget, p, self.probe), self.probe, p)
        reuse = existing is not None and blocks == "auto"
        if not reuse:
            find_blocks(model, blocks)  # a bad selection is refused here, before anything changes
            find_head(model, head)
        self.events = EventLog(log, run_id=state.get("run") if state is not None else None)
        self.model = model
        self._owns_instrumentation = existing is None
        self.handles: list[BlockHandle] = (
            list(existing.handles)
            if reuse
            else instrument(
                model,
                blocks,
                compress=CompressOptions(codec=p.compress_codec, group_size=p.compress_group_size),
                head=head,
            )
        )
        self._user_modes = None if existing is None else tuple(h.mode for h in self.handles)
        try:
            self._setup(model, state)
        except BaseException:
            self.events.close()
            self._give_back()
            raise

    def _setup(self, model: nn.Module, state: dict[str, Any] | None) -> None:
        p = self.policy
        self.recorder = StepRecorder(self.probe, get_instrumentation(model).runtime.offload.in_flight_bytes)
        cuda = isinstance(self.probe, CudaProbe)
        self.head: HeadHandle | None = get_instrumentation(model).head
        head = self.head
        head_costs = HeadCosts(head.vocab, head.hidden, head.weight_bytes, cuda=cuda) if head is not None else None
        self.costs = CostModel(
            [type(h.module).__name__ for h in self.handles],
            p,
            cuda=cuda,
            priors=priors_for(self.probe, cuda, [h.offload_options for h in self.handles]),
            weight_grad_bytes=[
                sum(w.numel() * w.element_size() for w in h.module.parameters() if w.requires_grad)
                for h in self.handles
            ],
            head_costs=head_costs,
        )
        self.decider = Decider(p)
        self._lock = threading.RLock()
        self.plans = PlanBook(
            len(self.handles),
            p,
            self.costs,
            self.decider,
            self.probe,
            start_plan=self._user_modes,
            one_memory=isinstance(self.probe, HostProbe),
        )
        self._current: tuple[Mode, ...] = tuple(h.mode for h in self.handles)
        self._current_head: HeadChoice | None = None
        self.now = StepState()  # the step in hand, from begin_step to end_step
        self._closed = False
        self.lengths = LengthsSeen()  # what `longest_sequence` extrapolates from
        self.measuring = MeasureSchedule(p, self.costs)  # which steps are measured block by block
        self._replan_when_warm = False  # a replan waits for the warm reading of a first offload
        self._unmarked_warned = self._idle_warned = self._overlap_warned = False  # warnings given once
        self._agree = RankAgreement() if distributed() else None  # ranks plan and retry together
        self._rank = self._agree.rank if self._agree is not None else 0
        self._syncing = False  # this step runs in DDP's no_sync(): gradients are averaged after it
        self._buffer_copies = BufferCopies()  # run_step's host copies of the buffers, kept from step to step
        self._own_checkpointing: frozenset[int] = frozenset()  # blocks whose model checkpoints them itself
        self.steps = self.ooms = self.ooms_recovered = self.plan_changes = self.pressure_events = 0
        self.peak_bytes = 0
        self.errors: list[float] = []
        self.decisions: Counter = Counter()
        self._last_failure: dict = {}
        self._attempts: list[dict] = []  # the failures of the batch in hand (since the last step that ran)
        self._trace: Trace | None = None  # the controller as it was before that batch (adaptmem.control.unfit)
        self._alloc_retries: int | None = None  # the CUDA allocator's retry count after the last step
        if state is not None:  # a state for other blocks is refused here, before the thread starts
            restore_manager_state(self, state)
        self._runtime = get_instrumentation(model).runtime
        self._sampler = Sampler(self._tick, self.events.flush, p.sample_interval_s)
        self._sampler.start()
        self._runtime.observer = self  # held weakly: dropping the manager does not keep it alive
        # torch.compile never traces the controller: it runs eagerly between compiled pieces
        self._runtime.tell = torch.compiler.disable(tell_observer, recursive=True)
        self._compiles = CompileCounter()
        made_here = self.probe is not self._device  # a probe the user passed in stays open for them
        self._finalizer = weakref.finalize(
            self, _shut_down, self._sampler, self.events, self.probe if made_here else None
        )
        self.events.emit(
            "start",
            step=self.steps,
            schema=SCHEMA_VERSION,
            policy=p.name,
            device=self.probe.name,
            budget_bytes=self.budget,
            capacity_bytes=self.budgets.capacity,
            blocks=[h.name for h in self.handles],
            start_plan="resume" if state else "user" if self._user_modes is not None else "calibrate",
            modes=[m.label for m in self.plans.allowed],
        )
        if state is not None:
            announce_resume(self, self.events.run_id)

    # ------------------------------------------------------------ public
    @property
    def plan(self) -> dict[str, Mode]:
        """The mode each block runs in now: {block name: Mode}."""
        return {h.name: h.mode for h in self.handles}

    @property
    def budget(self) -> int:
        """The budget in force now (bytes): the user's, or less while others take memory."""
        return self.budgets.current

    @property
    def user_budget(self) -> int:
        return self.budgets.user

    @property
    def budget_bytes(self) -> int:
        return self.budgets.current

    @property
    def capacity(self) -> int | None:
        return self.budgets.capacity

    @property
    def in_step(self) -> bool:
        """A step is open (between `begin_step` and `end_step`)."""
        return self.now.open

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sampler(self) -> Sampler:
        """The background thread (`sampler.wait_ticks(n)` waits for its reaction)."""
        return self._sampler

    @property
    def last_step(self) -> dict | None:
        """The record of the last completed step (its `observed_peak_bytes` is the step's peak)."""
        return self.events.last("step")

    def set_budget(self, budget: int | str) -> int:
        """A new budget (bytes, "12GiB" or "80%" of capacity), in force from the next block
        to run; returns it in bytes. Larger than the device is an error."""
        value = resolve_budget(budget, self.policy, self.probe, use_env=False)
        with self._lock:
            before, after = self.budgets.set_user(value, self.budgets.available())
            self.plans.cache.clear()
            replanned = self._replan_running_forward()
            self.events.emit(
                "budget",
                step=self.steps + 1,
                budget_bytes_before=before,
                budget_bytes=after,
                user_budget_bytes=value,
                replanned_blocks=replanned,
            )
        return value

    def begin_step(self, label: Any = None) -> None:
        """Open one forward + backward; `label` (e.g. a framework's global step and micro-batch)
        goes into the step's record."""
        if self._closed:
            raise RuntimeError("this MemoryManager is closed; create a new one to manage the model again")
        if self.now.open:
            raise RuntimeError("a step is already open: call end_step() before begin_step() (steps do not nest)")
        self._check_own_checkpointing()
        with self._lock:
            if self.plans.failed is None:  # a new batch (not a retry of one that ran out of memory)
                self._trace, self._attempts = Trace.take(self), []
            self.now = StepState(open=True, label=label, rng=rng_state())
            kept = any(w.grad is not None for w in self.handles[-1].module.parameters())
            self.recorder.begin().grads_resident = self.costs.grads_resident = kept  # planned for as it is

    def end_step(self, error: BaseException | None = None) -> dict | None:
        """Close the step. `error`: None for a step that finished; a `torch.OutOfMemoryError`
        is recorded (the next step plans tighter); any other error drops the step unlearned
        of its verdict. Returns the step's record (an `oom` record after an OOM)."""
        if not self.now.open:
            raise RuntimeError("end_step() without an open step: call begin_step() first")
        sample = self.recorder.end()
        self._check_device_counted(sample)
        error = self._agree_on_failure(error)
        refused, self.now.refused = self.now.refused, False
        with self._lock:
            self.now.open = False
            if refused:  # given up before a block ran: the batch leaves no trace
                self._trace.restore(self)
                set_rng_state(self.now.rng)
                return None
            if (sample is not None and sample.double_backward) or isinstance(error, SelectiveBackwardError):
                self._no_second_backward_for(Mode.SELECTIVE)
            if sample is not None and sample.blocks and sample.detailed and not sample.unmeasured:
                if isinstance(error, torch.OutOfMemoryError):
                    self._trace.before_learning(self)
                self.costs.learn(sample)
                self.lengths.learn(sample)
            if isinstance(error, torch.OutOfMemoryError):
                return self._record_oom(error, sample)
            if error is None and sample is not None:
                return self._after_step(sample)
            return None

    @contextlib.contextmanager
    def step(self, label: Any = None) -> Iterator[MemoryManager]:
        """Mark one forward + backward. An OOM inside is recorded and re-raised, with a note
        that `run_step` retries; the next step runs under a plan predicted lower than the one
        that failed when it is the same batch again, and plans afresh for another batch."""
        with self._step(label, retried=False):
            yield self

    @contextlib.contextmanager
    def _step(self, label: Any, *, retried: bool) -> Iterator[MemoryManager]:
        self.begin_step(label)
        try:
            yield self
        except BaseException as err:
            self.end_step(error=err)
            if not retried and isinstance(err, torch.OutOfMemoryError) and not isinstance(err, StepOutOfMemoryError):
                add_note(err, RETRY_NOTE)
            raise
        else:
            record = self.end_step()
            if record is not None and record["type"] == "oom":  # another rank ran out of memory
                raise torch.OutOfMemoryError(record["message"])

    def run_step(self, fn: Callable[..., Any], *args: Any, label: Any = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a forward and backward, no optimizer step) as one
        step; after an out-of-memory error, free, tighten the plan and run it again."""
        guard = StepGuard(
            self.model,
            self.policy.accumulation_snapshot,
            buffer_limit=self.policy.buffer_snapshot_limit,
            copies=self._buffer_copies,
        )
        self.plans.succeeded()  # a new batch: not a retry of whatever failed before
        reruns = 0  # runs again for a second backward, not for memory
        try:
            for attempt in range(self.policy.max_retries + 1):
                self.plans.attempt = attempt - reruns
                try:
                    with self._step(label, retried=True), self._no_sync():
                        result = fn(*args, **kwargs)
                except StepOutOfMemoryError as err:  # given up before a block ran: no plan can fit it
                    refused = err.with_traceback(None)  # its frames would keep the forward's tensors alive
                except torch.OutOfMemoryError:
                    refused = None
                except SelectiveBackwardError:
                    # the step backwards twice through a SELECTIVE block, which PyTorch cannot: SELECTIVE is
                    # never planned again (end_step said so), and the step runs again from where it began
                    if Mode.SELECTIVE in self.plans.allowed:
                        raise
                    guard.restore()
                    reruns += 1
                    continue
                else:
                    self.ooms_recovered += attempt - reruns
                    self._average_gradients()
                    return result
                guard.restore()
                if refused is not None:
                    raise refused
                self._free_after_oom()
            self._trace.restore(self)  # every retry failed: the batch leaves no trace either
            raise StepOutOfMemoryError(oom_report(self._attempts, self.policy.max_retries), list(self._attempts))
        finally:
            self.plans.attempt = 0
            self.plans.succeeded()
            guard.close()

    def longest_sequence(self, batch: int = 1, *, limit: Budget = None) -> Reach:
        """How long can I go? After a step or more, the longest sequence at `batch` samples some plan is
        predicted to fit, with that plan. `limit`: None (the device's usable size), bytes, "12GiB", "80%"."""
        return self._reacher(limit).longest(batch)

    def largest_batch(self, length: int, *, limit: Budget = None) -> Reach:
        """The largest batch of `length`-token samples predicted to fit (see `longest_sequence`)."""
        return self._reacher(limit).largest_batch(length)

    def _reacher(self, limit: Budget) -> Reacher:
        fits = (
            self.budgets.available() if limit is None else resolve_budget(limit, self.policy, self.probe, use_env=False)
        )
        with self._lock:
            return self.lengths.reacher(
                self.costs,
                self.plans,
                self.budgets.user if fits is None else fits,
                0 if self.now.open else self.probe.allocated(),
            )

    def summary(self) -> dict[str, Any]:
        """Counts and figures of the run so far (steps, peak, OOMs, decisions, prediction error, ...)."""
        return manager_summary(self)

    def close(self) -> None:
        """Stop the background thread, write the log, and give the model back as it was.
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._sampler.stop()
        if self.now.open:
            self.recorder.end()
            self.now.open = False
        self._runtime.observer = None
        self.events.emit("end", step=self.steps, summary=self.summary(), reach=end_record(self))
        self._compiles.close()
        self._finalizer()  # closes the log and the probe
        self._give_back()

    def __enter__(self) -> MemoryManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _give_back(self) -> None:
        if self._owns_instrumentation:
            restore(self.model)
        elif self._user_modes is not None:
            for handle, mode in zip(self.handles, self._user_modes):
                handle.mode = mode

    # ------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (`load_state_dict`): see `adaptmem.control.resume`."""
        with self._lock:
            return manager_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run: learned costs, decisions, cached plans, counters, and its
        run id (so a log shared with the saved run continues it)."""
        load_manager_state(self, state)


def _shut_down(sampler: Sampler, events: EventLog, probe: Any) -> None:
    """Run by `close()`, or when a manager is dropped without it: stop the thread, close the
    log and the probe. It holds none of the manager, so the manager can be collected."""
    sampler.stop()
    events.close()
    closer = getattr(probe, "close", None)
    if closer is not None:
        closer()
