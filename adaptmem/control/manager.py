"""MemoryManager: the public face of the controller (`adaptmem.control.controller`).

It instruments the model (wrapping its blocks and loss head), builds the
controller and its background thread, and gives users the public API: `step()`
and `run_step()` around each forward + backward, `plan`, `stats`, `summary()`,
`longest_sequence()`, `set_budget()`, `state_dict()` and `close()`.

Lifecycle, for frameworks that drive it from hooks: build it (or use `with`),
bracket each forward+backward with `begin_step(label)` / `end_step(error)`
(`step()` and `run_step()` do it for you), and `close()` it (twice is harmless).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from adaptmem.config.budget import Budget, resolve_budget
from adaptmem.config.policy import Policy, load_policy
from adaptmem.config.units import format_bytes
from adaptmem.control.budgeting import BudgetKeeper
from adaptmem.control.compiling import CompileCounter
from adaptmem.control.controller import Controller
from adaptmem.control.events import SCHEMA_VERSION, EventLog
from adaptmem.control.reach import Reach, end_record, position_limit
from adaptmem.control.resume import announce_resume, controller_state, restore_controller_state, summary
from adaptmem.control.retry import RETRY_NOTE, StepOutOfMemoryError, add_note
from adaptmem.control.sampler import Sampler
from adaptmem.control.stats import RunStats
from adaptmem.devices.host import HostProbe
from adaptmem.devices.select import make_probe
from adaptmem.modes import Mode
from adaptmem.strategies import CompressOptions
from adaptmem.wrapping import (
    BlockHandle,
    BlockSelection,
    HeadSelection,
    find_blocks,
    find_head,
    get_instrumentation,
    repeat_calls,
    restore,
    tell_observer,
    unwrap,
)
from adaptmem.wrapping.attach import _instrument


class MemoryManager:
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
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        model = unwrap(model)  # blocks are named inside DDP / torch.compile wrappers
        self.policy = p = load_policy(policy)
        self.probe = make_probe(device, model)
        existing = get_instrumentation(model)
        if existing is not None and existing.runtime.observer is not None:
            raise RuntimeError("this model is already managed by another adaptmem.manage(); close that one first")
        budgets = BudgetKeeper(self._above_allocation(resolve_budget(budget, p, self.probe)), self.probe, p)
        reuse = existing is not None and blocks == "auto"
        if not reuse:
            find_blocks(model, blocks)  # a bad selection is refused here, before anything changes
            find_head(model, head)
        self.events = EventLog(log, run_id=state.get("run") if state is not None else None)
        self.model = model
        self._owns_instrumentation = existing is None
        handles: list[BlockHandle] = (
            list(existing.handles)
            if reuse
            else _instrument(
                model,
                blocks,
                compress=CompressOptions(
                    codec=p.compress_codec, group_size=p.compress_group_size, compile=p.compress_compile
                ),
                head=head,
                managed=True,
            )
        )
        self._handles_before = handles  # each call of a block the model calls more than once may become one
        self._user_modes = None if existing is None else tuple(h.mode for h in handles)
        self._closed = False
        try:
            self._start(model, budgets, ddp, state, made_here=self.probe is not device)
        except BaseException:
            self.events.close()
            self._give_back()
            raise

    def _start(
        self, model: nn.Module, budgets: BudgetKeeper, ddp: Any, state: dict[str, Any] | None, *, made_here: bool
    ) -> None:
        runtime = get_instrumentation(model).runtime
        self.head = get_instrumentation(model).head
        self._controller = ctl = Controller(
            model,
            self._handles_before,
            self.head,
            policy=self.policy,
            probe=self.probe,
            budgets=budgets,
            events=self.events,
            in_flight=runtime.offload.in_flight_bytes,
            user_modes=self._user_modes,
            ddp=ddp,
        )
        if state is not None:  # a state for other blocks is refused here, before the thread starts
            restore_controller_state(ctl, state)
        self._runtime = runtime
        self._sampler = Sampler(ctl.tick, self.events.flush, self.policy.sample_interval_s)
        self._sampler.start()
        runtime.observer = ctl  # held weakly: the manager holds the controller
        # torch.compile never traces the controller: it runs eagerly between compiled pieces
        runtime.tell = torch.compiler.disable(tell_observer, recursive=True)
        self._compiles = CompileCounter()
        # a probe the user passed in stays open for them
        self._finalizer = weakref.finalize(
            self, _shut_down, self._sampler, self.events, self.probe if made_here else None
        )
        self.events.emit(
            "start",
            step=ctl.stats.steps,
            schema=SCHEMA_VERSION,
            policy=self.policy.name,
            device=self.probe.name,
            budget_bytes=self.budget,
            capacity_bytes=budgets.capacity,
            blocks=[h.name for h in self._handles_before],
            start_plan="resume" if state else "user" if self._user_modes is not None else "calibrate",
            modes=[m.label for m in ctl.plans.allowed],
        )
        if state is not None:
            announce_resume(ctl, self.events.run_id)

    # ------------------------------------------------------------ what it shows
    @property
    def handles(self) -> list[BlockHandle]:
        """The managed blocks' handles, in forward order: one per call of a block the model calls
        more than once a forward, once a step has shown it (named `<block>#2`, ... after the first)."""
        return self._controller.blocks.handles

    @property
    def plan(self) -> dict[str, Mode]:
        """The mode each block runs in now: {block name: Mode}."""
        return {h.name: h.mode for h in self.handles}

    @property
    def stats(self) -> RunStats:
        """The run's counts and figures so far (steps, OOMs, plan changes, peak, decisions, ...)."""
        return self._controller.stats

    @property
    def steps(self) -> int:
        return self._controller.stats.steps

    @property
    def ooms(self) -> int:
        return self._controller.stats.ooms

    @property
    def ooms_recovered(self) -> int:
        return self._controller.stats.ooms_recovered

    @property
    def plan_changes(self) -> int:
        return self._controller.stats.plan_changes

    @property
    def pressure_events(self) -> int:
        return self._controller.stats.pressure_events

    @property
    def peak_bytes(self) -> int:
        return self._controller.stats.peak_bytes

    @property
    def steps_learned(self) -> int:
        """Steps the cost model has learned from (those measured block by block)."""
        return self._controller.costs.steps_learned

    @property
    def headroom(self) -> float:
        """The share of the budget plans aim at now (the decider's)."""
        return self._controller.decider.headroom

    @property
    def allowed_modes(self) -> tuple[Mode, ...]:
        """The modes plans may use: the policy's, less any found unusable in this run."""
        return self._controller.plans.allowed

    @property
    def budget(self) -> int:
        """The budget in force now (bytes): the user's, or less while others take memory."""
        return self._controller.budget

    @property
    def user_budget(self) -> int:
        return self._controller.budgets.user

    @property
    def budget_bytes(self) -> int:
        return self._controller.budget

    @property
    def capacity(self) -> int | None:
        return self._controller.budgets.capacity

    @property
    def in_step(self) -> bool:
        """A step is open (between `begin_step` and `end_step`)."""
        return self._controller.now.open

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

    def summary(self) -> dict[str, Any]:
        """Counts and figures of the run so far (steps, peak, OOMs, decisions, prediction error, ...)."""
        return summary(self._controller, self._compiles.count)

    # ------------------------------------------------------------ what it does
    def set_budget(self, budget: int | str) -> int:
        """A new budget (bytes, "12GiB" or "80%" of capacity), in force from the next block
        to run; returns it in bytes. Larger than the device is an error."""
        if self._closed:
            raise RuntimeError("this MemoryManager is closed; create a new one to manage the model again")
        value = resolve_budget(budget, self.policy, self.probe, use_env=False)
        if not self._controller.now.open:  # inside a step, the allocation holds the step's tensors too
            self._above_allocation(value)
        self._controller.set_budget(value)
        return value

    def _above_allocation(self, budget: int) -> int:
        """`budget`, refused where the device already holds as much for this process (the weights, the
        optimizer's state): no step could keep under it. (On the host, where the process's resident
        memory is the reading, the interpreter and its libraries count too: not checked.)"""
        if isinstance(self.probe, HostProbe):
            return budget
        try:
            allocated = int(self.probe.allocated())
        except (RuntimeError, ValueError, AttributeError):
            return budget
        if budget <= allocated:
            raise ValueError(
                f"budget {format_bytes(budget)} is not above what this process holds on the device already "
                f"({format_bytes(allocated)}: the weights, and the gradients and optimizer state where they are "
                "there), so no step could keep under it. Give more: bytes, '12GiB', or a share such as '80%'."
            )
        return budget

    def begin_step(self, label: Any = None) -> None:
        """Open one forward + backward; `label` (e.g. a framework's global step and micro-batch)
        goes into the step's record."""
        if self._closed:
            raise RuntimeError("this MemoryManager is closed; create a new one to manage the model again")
        if self._controller.now.open:
            raise RuntimeError("a step is already open: call end_step() before begin_step() (steps do not nest)")
        self._controller.begin_step(label)

    def end_step(self, error: BaseException | None = None) -> dict | None:
        """Close the step. `error`: None for a step that finished; a `torch.OutOfMemoryError`
        is recorded (the next step plans tighter); any other error drops the step unlearned
        of its verdict. Returns the step's record (an `oom` record after an OOM)."""
        if not self._controller.now.open:
            raise RuntimeError("end_step() without an open step: call begin_step() first")
        return self._controller.end_step(error)

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
        if self._controller.now.open and not self._closed:
            raise RuntimeError(
                "run_step was called inside a step that is open already (steps do not nest): the "
                "Lightning callback runs each training_step (or each closure) through run_step, and "
                "the Trainer mixin each micro-batch, so call the function itself there; in a loop of "
                "your own, close the step first (end_step(), or the end of `with mem.step():`)"
            )
        return self._controller.run(lambda: self._step(label, retried=True), fn, args, kwargs)

    def longest_sequence(self, batch: int = 1, *, limit: Budget = None) -> Reach:
        """How long can I go? After a step or more, the longest sequence at `batch` samples some plan is
        predicted to fit, with that plan. `limit`: None (the device's usable size), bytes, "12GiB", "80%"."""
        return self._positioned(
            self._controller.answer(self._limit(limit), lambda reacher: reacher.longest(batch), asked=True)
        )

    def largest_batch(self, length: int, *, limit: Budget = None) -> Reach:
        """The largest batch of `length`-token samples predicted to fit (see `longest_sequence`)."""
        seen = self._controller.lengths.one_length
        if seen is not None and length != seen:
            self._controller.notices.one_length(length, seen)
        return self._positioned(
            self._controller.answer(self._limit(limit), lambda reacher: reacher.largest_batch(length), asked=True)
        )

    def _positioned(self, reach: Reach) -> Reach:
        """`reach`, noting the model's configured positions where its length is past them."""
        positions = position_limit(self.model)
        return replace(reach, positions=positions) if positions and reach.length > positions else reach

    def _limit(self, limit: Budget) -> int | None:
        return None if limit is None else resolve_budget(limit, self.policy, self.probe, use_env=False)

    def close(self) -> None:
        """Stop the background thread, write the log, and give the model back as it was.
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._sampler.stop()
        ctl = self._controller
        ctl.abandon_step()
        ctl.ranks.close()  # FSDP2's own communication back
        ctl.stop_counting_loops()
        self._runtime.observer = None
        self.events.emit("end", step=ctl.stats.steps, summary=self.summary(), reach=end_record(ctl))
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
            handles = self._handles_before
            if self.handles != handles:  # the blocks the model calls more than once, as they were
                handles = repeat_calls(self.model, [h.order for h in handles])
            for handle, mode in zip(handles, self._user_modes):
                handle.mode = mode

    # ------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (`load_state_dict`): see `adaptmem.control.resume`."""
        with self._controller.lock:
            return controller_state(self._controller)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run: learned costs, decisions, cached plans, counters, and its
        run id (so a log shared with the saved run continues it)."""
        started_as = restore_controller_state(self._controller, state)
        announce_resume(self._controller, started_as)


def _shut_down(sampler: Sampler, events: EventLog, probe: Any) -> None:
    """Run by `close()`, or when a manager is dropped without it: stop the thread, close the
    log and the probe. It holds none of the manager, so the manager can be collected."""
    sampler.stop()
    events.close()
    closer = getattr(probe, "close", None)
    if closer is not None:
        closer()
