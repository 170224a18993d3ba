"""Warnings the manager gives once per run: each names what happened and what to do instead."""

from __future__ import annotations

import logging
from typing import Any

from adaptmem.config.units import format_bytes
from adaptmem.control.samples import StepSample

log = logging.getLogger("adaptmem")


class Notices:
    def __init__(self) -> None:
        self._given: set[str] = set()

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
