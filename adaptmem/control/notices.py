"""Warnings the manager gives once per run: each names what happened and what to do instead."""

from __future__ import annotations

import logging
import re
from typing import Any

from adaptmem.config.units import format_bytes
from adaptmem.control.samples import StepSample

log = logging.getLogger("adaptmem")


class Notices:
    def __init__(self) -> None:
        self._given: set[str] = set()
        self._worst_over = 0  # the most a step warned of went over its budget (bytes)
        # block index -> (its input's elements a sample, the first block's) in the first step measured
        self._lengths: dict[int, tuple[int, int]] = {}

    def _once(self, name: str) -> bool:
        if name in self._given:
            return False
        self._given.add(name)
        return True

    def unmarked(self, user_plan: bool) -> None:
        """The model ran a training forward outside a marked step."""
        if not self._once("unmarked"):
            return
        log.warning(
            "adaptmem: the model ran a training forward outside a marked step, so nothing is "
            "learned from it and the blocks keep the %s plan. Wrap each forward + backward in "
            "`with mem.step():`, call mem.run_step(fn, batch), or drive begin_step()/end_step() "
            "from your framework's hooks (adaptmem.integrations).",
            "user's" if user_plan else "calibration (every block checkpointed)",
        )

    def budget_below_start(self, start: int, budget: int) -> None:
        """A step reached its first block holding more than the user's budget: no plan keeps it."""
        if self._once("budget below start"):
            log.warning(
                "adaptmem: the budget (%s) is below what this step holds as its first block starts (%s: "
                "weights, gradients and optimizer state on the device, and what ran before the blocks), so no "
                "plan can keep a step under it; the steps run the tightest plans, and an out-of-memory error "
                "comes only from the device. Raise the budget (budget= in bytes or a share of the device, or "
                "mem.set_budget), or keep the optimizer's state off the device.",
                format_bytes(budget),
                format_bytes(start),
            )

    def overlap(self) -> None:
        """A step ran a second forward before its backward."""
        if self._once("overlap"):
            log.warning(
                "adaptmem: a step ran a second forward before its backward (as a contrastive loss "
                "does). From the next step, a step's first forward is planned for as many forwards "
                "as the step before ran, and they all run its plan; in this step, which nothing "
                "foretold, the second forward was planned for the memory the first left, and the "
                "step may go over the budget. The cost model learns from each step's first forward "
                "(each forward's plan is in the step's record, `forward_plans`)."
            )

    def calls_per_block(self, repeated: list[tuple[str, int]], blocks: int) -> None:
        """Blocks the model calls more than once a forward became a block per call."""
        if self._once("calls per block"):
            named = ", ".join(f"{name} {n} times" for name, n in repeated[:3]) + (", ..." if len(repeated) > 3 else "")
            log.warning(
                "adaptmem: the model calls a block more than once in each forward (%s): each call keeps "
                "its own activations, so each is now planned as a block of its own, named <block>#2, "
                "#3, ... after the first (%d blocks in all), with its own mode. Their costs are measured "
                "again from the next step, which runs every call checkpointed.",
                named,
                blocks,
            )

    def loop_longer(self, counts: list[tuple[str, int]], before: int, blocks: int) -> None:
        """A forward ran a loop more times than before: its added turns became blocks of their own."""
        if self._once("loop longer"):
            named = ", ".join(f"{name} {n} times" for name, n in counts[:3]) + (", ..." if len(counts) > 3 else "")
            log.warning(
                "adaptmem: a forward ran the model's loop more times than any before (%s): the calls past "
                "the blocks it had (%d) ran in the last call's mode, and this step was read for its peak. "
                "Each call is now a block of its own (%d blocks), measured again from the next step; a "
                "forward with fewer turns leaves the last blocks unrun, and the plans count them all (a "
                "loop's count drawn in forward cannot be foretold). To plan for the longest loop from the "
                "start, run it in the first step.",
                named,
                before,
                blocks,
            )

    def loop_uneven(self, names: list[str], longer: dict[int, int]) -> None:
        """Blocks ran past their calls, but not as whole turns of the loop that made them."""
        if self._once("loop uneven"):
            log.warning(
                "adaptmem: a forward called blocks more times than the first step did, but not as whole "
                "turns of its loop (block by place and calls: %s): the calls past each block's last ran "
                "in its mode, and the blocks stay as they are; a step with them is planned for the calls "
                "of the first step and may go over the budget.",
                ", ".join(
                    f"{names[order] if order < len(names) else order}: {n}" for order, n in sorted(longer.items())
                ),
            )

    def one_length(self, asked: int, seen: int) -> None:
        """`largest_batch` asked at a length no step ran, where every step ran at one."""
        if self._once("one length"):
            log.warning(
                "adaptmem: largest_batch(%d) answers for samples of %d tokens at the first block a step runs, "
                "but every step so far ran it at %d. The length is that block's input's, not another "
                "input's: in a model of two towers (CLIP's image and text, say) it is the first tower's "
                "(patches for a vision tower). For batches like the ones you train, ask largest_batch(%d).",
                asked,
                asked,
                seen,
                seen,
            )

    def over_budget(self, step: int, observed: int, budget: int, predicted: float, plan: str, steps: int) -> None:
        """A step planned under the budget peaked over it, with no out-of-memory error (the device had
        room): said at the first such step of a run, and again at one that goes more than twice as far
        over as any said before (a bert2bert's later steps went 13 and 18 MiB over, after a first 0.8
        MiB, unsaid). `steps`: the steps over it so far, this one included."""
        over = observed - budget
        if self._worst_over and over <= 2 * self._worst_over:
            return
        first, self._worst_over = not self._worst_over, over
        then = (
            ". The plans after it count what it showed and aim lower for a while; summary()['steps_over_budget'] "
            "counts the steps over it. Where the budget must hold at every step (other work shares the "
            "device), give a lower one."
            if first
            else f": further over than any step before it ({steps} steps over the budget so far). Where it "
            "must hold, give a lower budget."
        )
        log.warning(
            "adaptmem: step %d peaked at %s, %s over the budget of %s, where its plan (%s) was predicted at %s%s",
            step,
            format_bytes(observed),
            format_bytes(over),
            format_bytes(budget),
            plan,
            format_bytes(predicted),
            then,
        )

    def head_kept(self, why: str) -> None:
        """A step used the chunked head's logits beyond what a chunk replays: the head is kept."""
        if self._once("head kept"):
            log.warning(
                "adaptmem: a step used the loss head's chunked logits beyond what a chunk replays (%s). From "
                "now on the head is kept whole: its logits are made as the model makes them, and the plans "
                "count their memory. run_step (and with it the Lightning callback and the Trainer mixin) runs "
                "such a step again at once, its state put back; under `with mem.step():` it raised, and the "
                "next step keeps the head. To have the head chunked, leave the logits to the loss "
                "(docs/loss-head.md says which maps of them are replayed), or say head=None to manage none.",
                why,
            )

    def head_bypassed(self, name: str, owner: str) -> None:
        """The model was given `labels=` and its head was never called: the loss came from the head's
        weight by other code, which adaptmem does not chunk."""
        if self._once("head bypassed"):
            log.warning(
                "adaptmem: %s was given labels=, but its loss head %s was never called: the loss was made "
                "from the head's weight by other code (TRL's fused LM head, a fused linear cross-entropy). "
                "adaptmem cannot chunk that loss: it counts its memory with the step's and plans the blocks "
                "around it, and the plans keep the head. To have adaptmem chunk the logits, let the model "
                "compute its loss in its own forward (TRL 1.16's trainers always use their own).",
                owner,
                name,
            )

    def lengths_apart(self, sample: StepSample, names: list[str]) -> None:
        """A block whose input's length does not follow the first block's from step to step (an
        encoder-decoder's decoder, its target length apart from its source's): every step is planned,
        predicted and recorded by its first block's input, so that block's bytes are predicted wrong.
        Read in steps measured block by block; a fixed ratio (a network's later stages) is fine."""
        if "lengths apart" in self._given or not sample.detailed or len(sample.blocks) < 2:
            return
        first = sample.blocks[0].extent
        for block in sample.blocks[1:]:
            if block.extent <= 0 or first <= 0:
                continue
            seen = self._lengths.setdefault(block.index, (block.extent, first))
            if abs(block.extent * seen[1] - seen[0] * first) <= 0.01 * seen[0] * first:
                continue
            self._once("lengths apart")
            name = names[block.index] if block.index < len(names) else str(block.index)
            if seen[1] == first:  # the blocks before it took the same length both times (a fixed-size image)
                stack = re.escape(name.rsplit(".", 1)[0]) + r"\.\d+" if "." in name else re.escape(name)
                remedy = (
                    "The blocks before it took the same length both times (a vision tower on images of one "
                    f'size, say): manage its stack alone, blocks=r"{stack}" (or a budget with room), and the '
                    "plans follow its length"
                )
            else:
                remedy = (
                    "Make the second length follow the first (pad the targets to a length set by the "
                    "sources'), or give the run room: a budget well under the device (a bert2bert whose "
                    "targets varied apart still peaked at 130% of a budget of 70%)"
                )
            log.warning(
                "adaptmem: block %s takes inputs whose length does not follow the first block's: %s elements "
                "a sample where the first block's had %s, then %s where it had %s (an encoder-decoder's "
                "decoder, or a vision-language model's language layers after its vision tower). A step is "
                "planned, predicted and recorded by its first block's input (its record's `seq` is that "
                "input's), so the memory of blocks like this one is predicted as if their length followed it: "
                "such steps may run out of memory and be retried, go over the budget, or be given up, and "
                "`longest_sequence` answers for the first block's length. %s.",
                name,
                f"{seen[0]:,}",
                f"{seen[1]:,}",
                f"{block.extent:,}",
                f"{first:,}",
                remedy,
            )
            return

    def device_idle(self, probe: Any, sample: StepSample | None, step: int) -> None:
        """A `SimulatedDevice` counts only while entered: a step run outside it reads a peak of
        what was there before, and every plan would be made on figures of nothing."""
        device = getattr(probe, "device", None)
        if (
            sample is None
            or not sample.blocks
            or not hasattr(device, "active")
            or device.active
            or sample.peak > sample.start
            or not self._once("idle")
        ):
            return
        log.warning(
            "adaptmem: the SimulatedDevice given to the manager was not entered during step %d, so it "
            "counted none of its tensors (peak %s, what was there before) and the plans rest on "
            "figures of nothing. Run the steps inside `with device:` (around the training loop, "
            "trainer.fit() or trainer.train()).",
            step,
            format_bytes(sample.peak),
        )


def own_checkpointing(names: list[str], added: bool, others: int) -> None:
    """The model's own gradient checkpointing switched on (`added`) for the blocks `names`, or off."""
    if added:
        log.warning(
            "adaptmem: %d block(s) (%s) now checkpoint themselves: the model's own gradient checkpointing "
            "(gradient_checkpointing_enable() or activation_checkpointing_enable()) decides for them, "
            "recomputing them whatever adaptmem plans, so adaptmem runs them in NONE (its own recompute would"
            " run them once more) and plans the others. Switch it off "
            "(model.activation_checkpointing_disable(), or model.gradient_checkpointing_disable() in "
            "transformers without it) to let adaptmem decide for every block.",
            len(names),
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )
    else:
        log.warning(
            "adaptmem: the model's own gradient checkpointing is off again for %d block(s); "
            "adaptmem decides for every block",
            others,
        )
