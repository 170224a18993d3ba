"""What one step looked like, as the recorder saw it: named records, not loose attributes.

BlockSample   one block in one step: its bytes, transients and times
StepSample    one step: its shape, peaks, blocks, plan (and the loss head's choice)
InputShape    a block's main input size, what plans and costs are keyed on (`shape_of`)
StepState     the step in hand as the manager sees it: its label, plan point and verdict so far
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from adaptmem.modes import Mode
from adaptmem.pytree import tensors_in
from adaptmem.strategies.call import main_input


@dataclass
class BlockSample:
    """What one block did in one step (bytes are absolute probe readings unless said)."""

    index: int
    mode: Mode
    input_bytes: int  # tensor inputs that require grad (the block's activations in)
    start: int  # allocated at block start
    elem_size: int = 0  # bytes per element of the first such input (activation dtype)
    extent: int = 0  # elements a sample of its main input (`shape_of`), in a step measured block by block
    end: int = 0  # allocated at block end
    fwd_top: int = 0  # peak during its forward
    held: int | None = None  # start of next block (or estimate) minus start
    output_bytes: int = 0
    packed: int = 0  # bytes handed to an OFFLOAD/COMPRESS pack hook
    on_device: int = 0  # of those, bytes left on the device
    host: int = 0  # of those, bytes sent to the host
    residue: int | None = None  # of what a checkpoint's forward saved, what OFFLOAD would leave on the device
    bwd_start: int | None = None  # allocated when its backward began
    bwd_top: int | None = None  # peak during its backward
    recompute_bytes: int | None = None
    fwd_seconds: float = 0.0
    bwd_seconds: float | None = None
    recompute_seconds: float = 0.0
    moved_seconds: float | None = None  # in its pack and unpack hooks (OFFLOAD, COMPRESS): copies, waits, codecs
    _marks: dict = field(default_factory=dict, repr=False)

    @property
    def fwd_peak(self) -> int:
        return max(0, self.fwd_top - self.start)

    @property
    def bwd_peak(self) -> int | None:
        if self.bwd_top is None or self.bwd_start is None:
            return None
        return max(0, self.bwd_top - self.bwd_start)


@dataclass
class StepSample:
    """One step, as the recorder saw it."""

    batch: int = 0
    extent: int = 0  # elements per sample of the first block's main input (see `shape_of`)
    seq: int = 0  # its dimension 1, for logs
    width: int = 0  # elements per position of a sequence (B, S, H): H; 0 for any other input
    start: int = 0  # allocated at step start
    head_top: int = 0  # peak from the last block's end to the first block backward
    tail_top: int = 0  # peak after the last block backward
    overlap_top: int = 0  # peak from a second forward's start to the first forward's backward
    forwards: int = 1  # forwards alike (shape, plan) before the backward, where the head is learned from them
    peak: int = 0  # the step's peak
    blocks: list[BlockSample] = field(default_factory=list)
    plan: dict[int, Mode] = field(default_factory=dict)
    completed: bool = False  # every block's backward was seen
    completed_once: bool = False  # the first block's input gradient arrived (the blocks' backward ended)
    double_backward: bool = False  # some block's backward ran twice in this step
    overlapped: bool = False  # a second forward began before the first one's backward
    looped: bool = False  # overlapped by a block run again in its own forward (a loop), not a second forward
    tail_hooked: bool = False  # the first block's input needs a gradient, which marks the blocks' backward end
    unmeasured: bool = False  # a probe reading failed during the step: its figures are not to be learned
    detailed: bool = True  # measured block by block (False: only its start and peak, not learned from)
    grads_resident: bool = False  # the weights' gradients were allocated before the step (accumulation)
    head: Any = None  # the loss head's HeadChoice in this step (None: no managed head)
    seconds: float = 0.0
    quiet_host: int = 0  # bytes sent to the host by calls without a BlockSample (a light step's, a second forward's)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def host_bytes(self) -> int:
        """Bytes the step's blocks sent to the host."""
        return sum(b.host for b in self.blocks) + self.quiet_host

    @property
    def backward_reached(self) -> bool:
        """The backward reached a block: the head and loss before it ran whole."""
        return any(b.bwd_start is not None for b in self.blocks)


class InputShape(NamedTuple):
    """The size of a block's main input: what plans and costs are keyed on."""

    batch: int  # its dimension 0 (1 of a stack of sequences, n x B x S x H)
    extent: int  # its elements per sample: all the other dimensions together (C x H x W, S x H, ...)
    seq: int  # its dimension 1 (a token model's sequence length), for reading logs only
    width: int = 0  # a sequence's (B, S, H) elements per position, H; 0 for any other input


def shape_of(args: tuple, kwargs: dict) -> InputShape:
    """The shape of a block's main input: its first floating tensor argument of two or
    more dimensions (positional, then keyword), taken whole.

    Images (B, C, H, W), video (B, C, T, H, W), audio frames (B, T, F) and token
    activations (B, S, H) are keyed on every dimension, so larger images or longer
    sequences are a new, larger shape. A 2-D input (S, H) or (B, F) is one sample.
    A stack of sequences (n, B, S, H) (Gemma3n's decoder layers take their n
    alternating-update streams so) is read as B sequences of S positions of n x H.
    """
    t = main_input(args, kwargs)
    if t is None:
        return InputShape(1, 1, 1)
    if t.dim() == 2:
        return InputShape(1, max(1, t.numel()), int(t.shape[0]), int(t.shape[1]))
    if t.dim() == 4 and _stacked(t, args, kwargs):
        # (n, B, S, H): n sequences of hidden states per token (Gemma3n's alternating updates)
        batch = max(1, int(t.shape[1]))
        return InputShape(batch, max(1, t.numel() // batch), int(t.shape[2]), int(t.shape[0] * t.shape[3]))
    batch = max(1, int(t.shape[0]))
    return InputShape(batch, max(1, t.numel() // batch), int(t.shape[1]), int(t.shape[2]) if t.dim() == 3 else 0)


def _stacked(t: Any, args: tuple, kwargs: dict) -> bool:
    """A 4-D main input that stacks sequences of hidden states (n, B, S, H): another of the block's
    tensor arguments (its position ids (B, S), a per-layer input (B, S, D)) leads with (B, S), its
    dimensions 1 and 2, where none leads with its dimensions 0 and 1 as an image's (B, C, H, W)
    arguments would (its batch first)."""
    head, inner = tuple(t.shape[:2]), tuple(t.shape[1:3])
    if head == inner:
        return False
    leads = [tuple(u.shape[:2]) for u in tensors_in((args, kwargs)) if u is not t and u.dim() >= 2]
    return inner in leads and head not in leads


@dataclass
class StepState:
    """The step in hand as the manager sees it, from `begin_step` to `end_step` (a new one each step)."""

    open: bool = False  # between begin_step and end_step
    label: Any = None  # the caller's label, written into the step's records
    rng: Any = None  # the RNG states at begin_step, put back if the step is given up before a block runs
    key: tuple[int, int, bool] | None = None  # the shape bucket the step's plan was made for
    predicted: float | None = None  # the plan's predicted peak (bytes)
    feasible: bool = True  # the plan was predicted to fit (else it is the tightest there is)
    start: int = 0  # bytes allocated at the plan point (the first block's forward)
    plan_point_passed: bool = False  # with other ranks: this rank took part in the plan point's collectives
    overlapping: bool = False  # a second forward ran before this step's backward
    looping: bool = False  # a block ran again in this step's forward (a module called more than once)
    forwards: int = 1  # forwards run before the step's backward (the first block started anew)
    planned_forwards: int = 1  # forwards the first forward's plan was made for (its batch counted them all)
    alike: bool = True  # every forward after the first had its shape and ran its plan
    later_plans: list = field(default_factory=list)  # the plans of the forwards after the first, as labels
    head_calls: tuple[int, int, int] = (0, 0, 0)  # the loss head's calls, chunked calls, armings before the step
    refused: bool = False  # given up at the plan point: no plan can fit it
    shape: Any = None  # the step's InputShape, from its plan point
