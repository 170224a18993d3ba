"""Watching one training step, block by block, to learn what each mode costs.

A step is cut into segments at block boundaries: in forward, each block's start
and end; in backward, the moment the gradient of a block's output is ready
(a tensor hook), which is when that block's backward begins. At every boundary
the recorder reads the probe's allocation and the peak since the previous
boundary, then resets the peak. From these:

  held      bytes a block adds from its start to the next block's start
            (what it keeps for backward, plus its output, less what the caller frees)
  fwd_peak  transient above its start during its forward
  bwd_peak  transient above the start of its backward segment
  recompute bytes a checkpointed block rematerializes in backward
and, around the blocks, what the model does before them (embeddings), after
them (head and loss, forward and backward) and in backward (gradients).

Allocations at boundaries leave out offloaded copies still in flight (`_allocated`).

A step recorded without `detail` (the manager's steady state: shapes seen, plan
held, predictions on target) reads the probe only at its start, at the first
block and at its end: it yields the step's peak, not per-block figures, and is
not learned from. The hooks still run, so overlap and double backward are seen.
Only its first block calls the recorder, as it starts (where the forward is planned):
from there each block, the first included, appends its index, mode and stats to a list
on the blocks' runtime (`BlockRuntime.quiet`), which the recorder reads into the
step's `plan`, in the order they ran, where it needs them (a replan, the step's end);
such a step's `blocks` hold the first only. Each block that ran last in a step before
(`BlockRuntime.marked`), with the other calls of its module where its calls are blocks of
their own (a loop drawn per batch ends at another), hooks its output as it runs: backward
has begun when the first such gradient arrives, and is taken from then on as through the
blocks (a second forward after it is a second micro-batch). A forward that ran a block
twice goes back to calling the recorder at every block from the next step on; a second
forward before the backward (the first block run again, which calls the controller)
does not.
On a device that runs asynchronously (CUDA) such a step is not waited for: only a
step measured block by block synchronizes, to read its events' times, and a
light step's `seconds` are the host's, from its start to its end. A wait at
every step's end would leave the device idle while the host issues the next.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from adaptmem.control.readings import SafeReadings
from adaptmem.control.samples import BlockSample, InputShape, StepSample, shape_of
from adaptmem.devices.probe import MemoryProbe
from adaptmem.modes import Mode
from adaptmem.pytree import tensors_in
from adaptmem.strategies import BlockCall
from adaptmem.strategies.call import main_input
from adaptmem.strategies.payloads import backward_entry
from adaptmem.wrapping import BlockHandle, BlockRuntime


class Segment(enum.Enum):
    """Which stretch of the step the next peak reading belongs to."""

    IDLE = "idle"  # no step open
    BEFORE_BLOCKS = "before blocks"  # from the step's start to the first block (embeddings)
    OVERLAP = "overlap"  # from a second forward to the first one's backward: only the peak counts
    BLOCK = "block"  # a block's forward
    BETWEEN = "between"  # after a block's forward, before the next block's (or the head and loss)
    BACKWARD = "backward"  # a block's backward
    TAIL = "tail"  # after the first block's backward: the backward before the blocks


class StepRecorder:
    """A `BlockObserver` that records one step at a time through a probe (whose failures it survives)."""

    def __init__(
        self,
        probe: MemoryProbe,
        in_flight: Callable[[], int] | None = None,
        last_index: int | None = None,
        runtime: BlockRuntime | None = None,
        orders: list[int] | None = None,
    ) -> None:
        """`orders`: each block's module (its order among those selected), where a module's calls
        are blocks of their own: a loop run fewer times ends at another call of the module that
        ran last."""
        self.probe = SafeReadings(probe)
        self._step_started = getattr(probe, "step_started", None)
        # the indices of the blocks a forward has run last (the last managed one, until a step shows
        # which ran last; more than one where a loop's count varies per batch; None: any block): in a
        # step not measured block by block, only the first block run and these get a backward hook
        # (backward began; backward went through every block)
        self.last: frozenset[int] | None = None if last_index is None else frozenset((last_index,))
        by_module: dict[int, list[int]] = {}
        for i, order in enumerate(orders or ()):
            by_module.setdefault(order, []).append(i)
        self._calls: dict[int, frozenset[int]] = {}  # a block's index: its module's calls', where more than one
        for calls in by_module.values():
            if len(calls) > 1:
                self._calls.update(dict.fromkeys(calls, frozenset(calls)))
        if self.last is not None:
            self.last = self._calls.get(last_index, self.last)
        self._in_flight = in_flight
        self._failures_at_begin = 0
        self._lock = threading.RLock()
        self.sample: StepSample | None = None
        self._open: str = "idle"  # which segment the next peak reading belongs to
        self._bwd_current: BlockSample | None = None
        self._step_mark: Any = None
        self._step_host = 0.0
        self.detail = True  # measure the step block by block (`measure_blocks`, at the first block)
        self._runtime = runtime  # the blocks' runtime, where a light step's quiet blocks list themselves
        self._quiet: list | None = None  # that list, while a light step runs
        self._folded = 0  # how much of it is in the sample
        self._quiet_stats: list[dict] = []  # their calls' stats, read at the step's end
        self._began_at: set[int] = set()  # the marked blocks whose output's gradient arrived in it
        self._may_quiet = False  # the last step ran each block once in each forward, its forwards from its first block
        self._again_at_first = False  # the open step's first block ran again before its backward (a second forward)

    # ---------------------------------------------------------------- steps
    def begin(self, *, grads_resident: bool = False) -> StepSample:
        """Open a step; `grads_resident`: it starts with the weights' gradients allocated."""
        with self._lock:
            if self._step_started is not None:  # scripted probes follow the step count
                self._step_started()
            self._failures_at_begin = self.probe.failures
            self.sample = StepSample(start=self._less_in_flight(self.probe.restart()), grads_resident=grads_resident)
            self.detail = True
            self._open = Segment.BEFORE_BLOCKS
            self._bwd_current = None
            self._step_mark = self.probe.mark()
            self._step_host = time.perf_counter()
            self._stop_quiet()
            return self.sample

    def end(self) -> StepSample | None:
        with self._lock:
            sample = self.sample
            if sample is None:
                return None
            self._fold()
            sample.quiet_host = sum(stats.get("host", 0) for stats in self._quiet_stats)
            self._stop_quiet()
            self._may_quiet = not sample.overlapped or self._again_at_first
            self._again_at_first = False
            self._close_segment()
            waited = sample.detailed or not getattr(self.probe.inner, "asynchronous", False)
            end_mark = None
            if waited:  # else a light step on an asynchronous device: not waited for
                end_mark = self.probe.mark()
                self.probe.synchronize()
            self._finish(sample, end_mark, waited)
            if sample.plan and not sample.overlapped:  # the block forward ran last, for the next light step
                last = next(reversed(sample.plan))
                if self.last is None or last not in self.last:  # with every call of its module
                    calls = self._calls.get(last, frozenset((last,)))
                    self.last = calls if self.last is None else self.last | calls
            sample.unmeasured = self.probe.failures > self._failures_at_begin
            self.sample = None
            self._open = Segment.IDLE
            return sample

    def measure_blocks(self, detail: bool) -> None:
        """Measure the open step block by block (True) or read its peak only."""
        self.detail = detail

    def planned_head(self, head: Any) -> None:
        """The loss head's choice for the open step, as its plan set it."""
        if self.sample is not None:
            self.sample.head = head

    @property
    def forward_started(self) -> bool:
        return self.sample is not None and bool(self.sample.blocks)

    def forward_state(self) -> tuple[int, int, int, dict[int, Mode]] | None:
        """(batch, extent, allocation at the first block, {index: mode} of blocks run) while a
        forward is under way and no backward has begun; None otherwise."""
        with self._lock:
            self._fold()
            sample = self.sample
            if sample is None or not sample.blocks or sample.backward_reached:
                return None
            return sample.batch, sample.extent, sample.blocks[0].start, dict(sample.plan)

    # ---------------------------------------------------------- observer API
    def ran(self, index: int) -> bool:
        """Block `index` already ran in this step's forward."""
        self._fold()
        sample = self.sample
        return sample is not None and index in sample.plan

    @property
    def backward_done(self) -> bool:
        """This step's backward has gone through every block. Without a gradient for the
        first block's input (frozen embeddings) there is no mark after its backward: a
        forward that begins once every block's backward has begun comes after it."""
        sample = self.sample
        if sample is None or (sample.overlapped and not sample.looped):  # the forwards after a second one
            return False  # belong to its step
        if sample.tail_hooked:
            return sample.completed_once
        return bool(sample.blocks) and all(b.bwd_start is not None for b in sample.blocks)

    def loop(self, index: int) -> None:
        """Block `index` ran again in its own forward (a loop): the step is read as `overlap` reads
        it, and its backward is still followed through the first calls' blocks (`backward_done`: a
        forward after it is a second micro-batch)."""
        with self._lock:
            self.overlap(index)
            if self.sample is not None:
                self.sample.looped = True

    def overlap(self, index: int) -> None:
        """Block `index` ran again before the forward's backward: where it is the first block run,
        a second forward began (the next step may be a light one all the same: its first block,
        which calls the controller, sees a second forward begin); else a block ran twice in one
        forward (the next step watches every block). The blocks run again are not recorded,
        and the step is watched for its peak. A step measured block by block goes on reading
        the first forward's backward, which autograd runs after the second's (it takes nodes
        made later first): the first forward's figures are whole, and are learned, all but the
        head's (`CostModel.learn`)."""
        with self._lock:
            sample = self.sample
            if sample is not None:
                self._fold()
                blocks = sample.blocks
                self._again_at_first = not sample.overlapped and bool(blocks) and index == blocks[0].index
                self._close_segment()
                sample.overlapped = True
                self._open = Segment.OVERLAP

    def block_start(
        self,
        handle: BlockHandle,
        args: tuple,
        kwargs: dict,
        shape: InputShape | None = None,
        allocated: int | None = None,
    ) -> None:
        """`shape`: the step's input shape, and `allocated` the probe's allocation now, where the
        caller has read them already."""
        with self._lock:
            sample = self.sample
            if sample is None or sample.overlapped:
                return
            if sample.blocks and not sample.detailed:
                self._fold()
                sample.blocks.append(BlockSample(index=handle.index, mode=handle.mode, input_bytes=0, start=0))
                sample.plan[handle.index] = handle.mode
                return
            if not sample.blocks:
                sample.detailed = self.detail
                if self._runtime is not None:
                    self._runtime.measuring = sample.detailed
                if not sample.detailed and self._go_quiet(handle.index):  # it lists itself, as the blocks after it do
                    sample.batch, sample.extent, sample.seq, sample.width = shape or shape_of(args, kwargs)
                    now = self._less_in_flight(allocated) if allocated is not None else self._allocated()
                    sample.blocks.append(BlockSample(index=handle.index, mode=handle.mode, input_bytes=0, start=now))
                    self._open = Segment.BLOCK
                    return
            now = self._close_segment() if sample.detailed else self._allocated()
            grad_inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            if not sample.blocks:
                sample.batch, sample.extent, sample.seq, sample.width = shape or shape_of(args, kwargs)
                if grad_inputs:  # its gradient marks the end of the last block backward
                    on_gradient(grad_inputs[0], self._make_bwd_hook(None))
                    sample.tail_hooked = True
            elif sample.blocks[-1].held is None:
                sample.blocks[-1].held = now - sample.blocks[-1].start
            if not grad_inputs:  # the first block after frozen embeddings: its activations need no grad
                main = main_input(args, kwargs)
                grad_inputs = [main] if main is not None else []
            inputs = sum(t.numel() * t.element_size() for t in grad_inputs)
            elem = grad_inputs[0].element_size() if grad_inputs else 0
            block = BlockSample(index=handle.index, mode=handle.mode, input_bytes=inputs, start=now, elem_size=elem)
            if sample.detailed:
                block._marks["fwd0"] = self.probe.mark()
                block.extent = sample.extent if len(sample.blocks) == 0 else shape_of(args, kwargs).extent
            sample.blocks.append(block)
            sample.plan[handle.index] = handle.mode
            self._open = Segment.BLOCK

    def block_end(self, handle: BlockHandle, call: BlockCall, output: Any) -> None:
        with self._lock:
            sample = self.sample
            if sample is not None and sample.overlapped and call.stats:  # a second forward's: what it sent
                self._quiet_stats.append(call.stats)
            if sample is None or not sample.blocks or sample.overlapped:
                return
            block = sample.blocks[-1]
            if sample.detailed:
                top, block.end = self._take_peak()
                block.fwd_top = max(top, block.start)
                sample.peak = max(sample.peak, top)  # the step's peak may be this block's forward
                block._marks["fwd1"] = self.probe.mark()
            block.mode = call.mode
            block.packed = call.stats.get("packed", 0)
            block.on_device = call.stats.get("on_device", 0)
            block.host = call.stats.get("host", 0)
            block.residue = call.stats.get("residue")
            if sample.detailed and "pack_s" in call.stats:  # its unpack time is known once its backward ran
                block._marks["stats"] = call.stats
            if sample.detailed or block is sample.blocks[0] or self.last is None or handle.index in self.last:
                outs = tensors_in(output)
                if sample.detailed:
                    block.output_bytes = sum(t.numel() * t.element_size() for t in outs)
                grad_out = next((t for t in outs if t.requires_grad), None)
                if grad_out is not None:
                    on_gradient(grad_out, self._make_bwd_hook(block))
            self._open = Segment.BETWEEN

    def recompute(self, handle: BlockHandle, begin: bool) -> None:
        with self._lock:
            block = self._bwd_current
            if block is None or block.index != handle.index:
                return
            if begin:
                block._marks["rc0"] = (self._allocated(), self.probe.mark())
            elif "rc0" in block._marks:
                before, _ = block._marks["rc0"]
                block.recompute_bytes = self._allocated() - before
                block._marks["rc1"] = self.probe.mark()

    # ---------------------------------------------------------------- inner
    def _go_quiet(self, first: int) -> bool:
        """A light step: from here the blocks run without calling the recorder (where the last
        step ran each block once; True), but for the `first` block run again (a second forward);
        each that has run last hooks its output for the moment backward begins (`_backward_began`)."""
        runtime = self._runtime
        if runtime is None or not self._may_quiet or self.last is None:
            return False
        self._quiet, self._folded, self._began_at = [], 0, set()
        runtime.watched = frozenset((first,))
        runtime.marked, runtime.mark = self.last, self._mark_last
        runtime.quiet = self._quiet
        return True

    def _stop_quiet(self) -> None:
        """No light step, nor a measured one, runs (a step begins or ends)."""
        if self._runtime is not None:
            self._runtime.quiet, self._runtime.marked = None, frozenset()
            self._runtime.measuring = False
        self._quiet, self._folded, self._quiet_stats = None, 0, []

    def _mark_last(self, index: int, output: Any) -> None:
        """A block that has run last ran in a light step (`BlockRuntime.mark`): where it ran last
        in this step too, its output's gradient is where backward begins."""
        grad_out = backward_entry(output)
        if grad_out is not None:
            on_gradient(grad_out, lambda grad: self._backward_began(index))

    def _backward_began(self, index: int) -> None:
        """Backward reached block `index`'s output in a light step: the first such is where it
        began, and it is taken as through them all (a loop's earlier turn that has run last reached
        after it is not; the same output reached again is a second backward)."""
        with self._lock:
            sample = self.sample
            if sample is None or sample.overlapped:
                return
            began, self._began_at = self._began_at, self._began_at | {index}
            if index in began:
                sample.double_backward = True  # a second backward (retain_graph / create_graph)
                return
            if began:
                return
            for b in sample.blocks:
                b.bwd_start = 0

    def _fold(self) -> None:
        """Put the blocks that ran quietly since the last call into the sample, in the order they ran."""
        quiet = self._quiet
        if quiet is None or len(quiet) == self._folded:
            return
        with self._lock:
            ran = quiet[self._folded :]  # a copy: the training thread may append as we read
            self._folded += len(ran)
            # what each call sent to the host, a second forward's too (a block run as it is sent nothing)
            self._quiet_stats.extend(stats for _, _, stats in ran if stats)
            sample = self.sample
            if sample is None or sample.overlapped:
                return
            plan = sample.plan
            for index, mode, _ in ran:
                if index in plan:  # a block run twice in one forward: only the peak counts
                    sample.overlapped = True
                    return
                plan[index] = mode

    def _make_bwd_hook(self, block: BlockSample | None):
        def hook(grad: Any) -> None:
            self._bwd_boundary(block)

        return hook

    def _bwd_boundary(self, block: BlockSample | None) -> None:
        """The gradient of `block`'s output is ready: its backward begins (None: the
        first block's input gradient is ready, so the last block backward ended)."""
        with self._lock:
            if self.sample is None or (self.sample.overlapped and not self.sample.detailed):
                return
            if self._seen_twice(block):
                self.sample.double_backward = True  # a second backward (retain_graph / create_graph)
                return
            if not self.sample.detailed:  # only where backward has got to
                if block is None:
                    self.sample.completed_once = True
                elif block is self.sample.blocks[0]:  # the first block run: backward went through them all
                    for b in self.sample.blocks:
                        if b.bwd_start is None:
                            b.bwd_start = 0
                else:
                    block.bwd_start = 0
                return
            now = self._close_segment()
            if block is None:
                self._bwd_current = None
                self._open = Segment.TAIL
                self.sample.completed_once = True
                return
            block.bwd_start = now
            block._marks["bwd0"] = self.probe.mark()
            self._bwd_current = block
            self._open = Segment.BACKWARD

    def _seen_twice(self, block: BlockSample | None) -> bool:
        """This boundary was passed before in this step: backward is running again."""
        return block.bwd_start is not None if block is not None else self.sample.completed_once

    def _allocated(self) -> int:
        """Allocation now, less the device bytes of offloaded copies still in flight: those land
        on the link's schedule, not the block's, so a block's `held` must not count them coming
        or going (they show, where they are, in the peaks: transients, head, backward)."""
        return self._less_in_flight(self.probe.allocated())

    def _take_peak(self) -> tuple[int, int]:
        """The peak since the last boundary and the allocation now (as `_allocated` counts it), in one
        reading where the probe can; the peak starts again from here."""
        top, now = self.probe.take_peak()
        return top, self._less_in_flight(now)

    def _less_in_flight(self, allocated: int) -> int:
        return allocated - self._in_flight() if self._in_flight is not None else allocated

    def _close_segment(self) -> int:
        """Attribute the peak since the last boundary to the open segment; returns allocation now."""
        sample = self.sample
        if not sample.detailed:  # one reading: the step's peak
            sample.peak = max(sample.peak, self.probe.peak())
            return 0
        top, now = self._take_peak()
        sample.peak = max(sample.peak, top)
        if self._open is Segment.BETWEEN:  # only before the first backward boundary: the last one is the head and loss
            sample.head_top = max(sample.head_top, top)
        elif self._open is Segment.BLOCK and sample.blocks:
            sample.blocks[-1].fwd_top = max(sample.blocks[-1].fwd_top, top)
        elif self._open is Segment.BACKWARD and self._bwd_current is not None:
            current = self._bwd_current
            current.bwd_top = max(current.bwd_top or 0, top)
            current._marks["bwd1"] = self.probe.mark()
        elif self._open is Segment.TAIL:
            sample.tail_top = max(sample.tail_top, top)
        elif self._open is Segment.OVERLAP:
            sample.overlap_top = max(sample.overlap_top, top)
        return now

    def _finish(self, sample: StepSample, end_mark: Any, waited: bool) -> None:
        """The step's figures once it ended: timed by the probe's marks where the device was
        waited for, else (a light step on an asynchronous device) by the host."""
        probe = self.probe
        if waited:
            sample.seconds = probe.seconds(self._step_mark, end_mark)
        else:
            sample.seconds = time.perf_counter() - self._step_host
        blocks = sample.blocks
        if not sample.detailed:
            sample.completed = bool(blocks) and all(b.bwd_start is not None for b in blocks)
            return
        if blocks and blocks[-1].held is None:
            last = blocks[-1]
            drops = [b.end - b.start - b.held for b in blocks[:-1] if b.held is not None and b.mode == last.mode]
            last.held = last.end - last.start - (drops[-1] if drops else 0)
        for block in blocks:
            marks = block._marks
            if "fwd0" in marks and "fwd1" in marks:
                block.fwd_seconds = probe.seconds(marks["fwd0"], marks["fwd1"])
            if "bwd0" in marks:
                block.bwd_seconds = probe.seconds(marks["bwd0"], marks.get("bwd1", end_mark))
                if block.bwd_top is None:  # its segment ran to the end of the step
                    block.bwd_top = sample.tail_top or sample.peak
            if "rc0" in marks and "rc1" in marks:
                block.recompute_seconds = probe.seconds(marks["rc0"][1], marks["rc1"])
            if "stats" in marks and "bwd0" in marks:
                block.moved_seconds = marks["stats"]["pack_s"] + marks["stats"]["unpack_s"]
            block._marks = {}
        sample.completed = bool(blocks) and all(b.bwd_start is not None for b in blocks)


def on_gradient(tensor: torch.Tensor, hook: Callable[[Any], None]) -> None:
    """Call `hook` as backward reaches `tensor` (its gradient is ready, before the node that made it
    runs): a pre-hook on that node, registered in one call (a tensor hook's Python bookkeeping cost
    twice as much on the host, at every step); a tensor hook on a leaf, which has no node."""
    node = tensor.grad_fn
    if node is not None:
        node.register_prehook(hook)
    else:
        tensor.register_hook(hook)
