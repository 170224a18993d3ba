"""`AdaptMemCallback`: adaptmem inside a Lightning `Trainer` (`lightning` or `pytorch_lightning`).

A thin adapter over `MemoryManager`; every decision is the manager's.

  fit start        the manager is built on the LightningModule once the checkpoint, if any,
                   is restored (`on_fit_start`; `on_train_start` for strategies that restore
                   after setup, FSDP and DeepSpeed), so a resumed run is built from its saved
                   state and logs under its saved run id from its first record. A resume from
                   a checkpoint without adaptmem's state says so, and starts cold.
  each micro-batch the optimizer closure (training_step, zero_grad, backward) runs as one
                   managed step through `run_step`: an out-of-memory error in it is
                   retried under a tighter plan, with the gradients left exact also
                   inside an accumulation window. With manual optimization there is no
                   closure: the whole `training_step` runs through `run_step`, and is
                   retried where no optimizer stepped before the error (after one, the
                   weights have moved: the error says so and ends the fit). With other
                   ranks, whose gradients `run_step` would average after the step's own
                   optimizer step, it is bracketed from `on_train_batch_start` to
                   `on_after_backward`, and an OOM is recorded, not retried.
  batch end        peak, budget, plan changes and recovered OOMs go to the loggers (when the
                   Trainer has any: Lightning warns of each figure logged to none)
  checkpoints      the manager's state (costs, decisions, counters, run id) is saved with
                   the callback and loaded on resume, which continues the same log
  fit end / error  the manager is closed and the model given back; its last state is kept,
                   so a checkpoint saved after the fit (`trainer.save_checkpoint`) resumes it

The closure is reached through Lightning's automatic-optimization loop
(`fit_loop.epoch_loop.automatic_optimization._make_closure`), the one place a
callback can get at a step's forward and backward together, and a manual
`training_step` through the manual-optimization loop's `advance`; Lightning has
no public hook to retry a batch (its request to survive OOM batches was closed
as won't-fix).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the older package name
    import pytorch_lightning as pl

from adaptmem.control.manager import MemoryManager
from adaptmem.integrations.stand_in import count_loaded

__all__ = ["AdaptMemCallback"]

log = logging.getLogger("adaptmem")


class AdaptMemCallback(pl.Callback):
    """Adaptive activation memory for a Lightning fit.

    Args: as for `adaptmem.manage` (`policy`, `budget`, `device`, `blocks`, `log`, `head`);
    `log_every_n_steps`: how often figures go to the Trainer's loggers (optimizer steps).
    """

    def __init__(
        self,
        *,
        policy: Any = None,
        budget: Any = None,
        device: Any = None,
        blocks: Any = "auto",
        log: str | None = None,
        log_every_n_steps: int = 1,
        head: Any = "auto",
    ) -> None:
        super().__init__()
        self.options = {
            "policy": policy,
            "budget": budget,
            "device": device,
            "blocks": blocks,
            "log": log,
            "head": head,
        }
        self.log_every_n_steps = log_every_n_steps
        self.manager: MemoryManager | None = None
        self._pending_state: dict | None = None  # loaded from a checkpoint, for the manager to be built
        self._final_state: dict | None = None  # the closed manager's last, for checkpoints saved after fit
        self._bracketed = False
        self._loop: Any = None

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.strategy.restore_checkpoint_after_setup:  # the checkpoint, if any, is restored
            self._build(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        count_loaded(self.options["device"], *trainer.optimizers)  # a resume loaded their state by now
        self._build(trainer, pl_module)  # FSDP, DeepSpeed: restored after on_fit_start, before this

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The manager, from the saved state when the fit resumed one, or from the last fit's closed
        manager when this callback fits again (a second stage): the run goes on. Built no earlier: Lightning
        restores callbacks after `setup`, and a manager built before its state was known would
        log its `start` under a fresh run id; and `trainer.ckpt_path` (the checkpoint this fit
        restored) is known only now, so a resume without adaptmem's state can be told apart."""
        if self.manager is not None and not self.manager.closed:
            return
        state = self._pending_state
        if trainer.ckpt_path and state is None:
            log.warning(
                "adaptmem: the fit resumed from %s, which holds no adaptmem state (no %r entry among "
                "its callbacks' states: saved without AdaptMemCallback, or empty); the controller starts "
                "cold: a new run id, steps counted from 0, costs learned again",
                trainer.ckpt_path,
                self.state_key,
            )
        elif state is None and self.manager is not None:  # a second fit with this callback: the run goes on
            state = self._final_state
        self.manager = MemoryManager(pl_module, **self.options, state=state)
        self._pending_state = None
        if pl_module.automatic_optimization:
            self._wrap_closures(trainer)
        elif trainer.world_size == 1:
            self._wrap_manual_steps(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.manager is not None and self.manager.in_step:
            self.manager.end_step(error=exception)
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        self._unwrap_closures()
        if self.manager is not None and not self.manager.closed:
            try:
                self._final_state = self.manager.state_dict()
            finally:
                self.manager.close()

    # ------------------------------------------------------------ steps
    def _wrap_closures(self, trainer: pl.Trainer) -> None:
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        make = loop._make_closure
        manager = self.manager

        def make_retrying_closure(kwargs: Any, optimizer: Any, batch_idx: int) -> Any:
            closure = make(kwargs, optimizer, batch_idx)
            label = {"global_step": trainer.global_step, "batch_idx": batch_idx}
            closure.closure = _retrying(closure, manager, label)
            return closure

        loop._make_closure = make_retrying_closure
        self._loop = loop

    def _wrap_manual_steps(self, trainer: pl.Trainer) -> None:
        loop = trainer.fit_loop.epoch_loop.manual_optimization
        advance = loop.advance
        manager = self.manager

        def advance_retrying(kwargs: Any) -> None:
            label = {"global_step": trainer.global_step, "batch_idx": trainer.fit_loop.epoch_loop.batch_idx}
            manager.run_step(_before_any_step(advance, loop), kwargs, label=label)

        loop.advance = advance_retrying
        self._loop = loop

    def _unwrap_closures(self) -> None:
        if self._loop is not None:
            self._loop.__dict__.pop("_make_closure", None)
            self._loop.__dict__.pop("advance", None)
            self._loop = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.manager is not None and not pl_module.automatic_optimization and self._loop is None:
            self.manager.begin_step(label={"global_step": trainer.global_step, "batch_idx": batch_idx})
            self._bracketed = True

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bracketed and self.manager is not None:
            self._bracketed = False
            self.manager.end_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bracketed and self.manager is not None:  # manual optimization without a backward
            self._bracketed = False
            self.manager.end_step()
        if self.manager is None or not trainer.loggers or trainer.global_step % max(1, self.log_every_n_steps):
            return
        summary = self.manager.summary()
        pl_module.log_dict(
            {
                "adaptmem/peak_bytes": float(summary["peak_bytes"]),
                "adaptmem/budget_bytes": float(summary["budget_bytes"]),
                "adaptmem/plan_changes": float(summary["plan_changes"]),
                "adaptmem/ooms_recovered": float(summary["ooms_recovered"]),
            },
            on_step=True,
            on_epoch=False,
            logger=True,
            prog_bar=False,
        )

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The live manager's state; after the fit, the closed manager's last (a checkpoint saved
        then resumes the run); before the manager is built, the state loaded for it."""
        if self.manager is not None and not self.manager.closed:
            return {"manager": self.manager.state_dict()}
        state = self._final_state if self._final_state is not None else self._pending_state
        return {"manager": state} if state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("manager")
        if state is None:
            return
        if self.manager is not None and not self.manager.closed:
            self.manager.load_state_dict(state)
        else:
            self._pending_state, self._final_state = state, None


def _retrying(closure: Any, manager: MemoryManager, label: dict) -> Callable[..., Any]:
    """`closure.closure` run through `manager.run_step`, holding the closure weakly: set on the
    closure, a wrapper holding its bound method would make a reference cycle, and each
    micro-batch's closure, with the batch in its arguments (on the device), would stay alive
    until the garbage collector's next cycle. A ViT's input batches piled up by one a step,
    and the manager planned each step for more memory already in use."""
    run = closure.closure
    if getattr(run, "__self__", None) is not closure:
        return lambda *a, **k: manager.run_step(run, *a, label=label, **k)
    func, ref = run.__func__, weakref.ref(closure)
    return lambda *a, **k: manager.run_step(func, ref(), *a, label=label, **k)


class OptimizerSteppedError(RuntimeError):
    """A manual `training_step` ran out of memory after an optimizer step: not retried."""


def _before_any_step(advance: Callable[[Any], None], loop: Any) -> Callable[[Any], None]:
    """The manual loop's `advance`, whose out-of-memory error `run_step` retries only where no
    optimizer stepped in the attempt: after a step the weights and the optimizer's state have
    moved, and running the `training_step` again would step twice."""

    def attempt(kwargs: Any) -> None:
        steps = loop.optim_step_progress.total.ready
        try:
            advance(kwargs)
        except torch.OutOfMemoryError as err:
            stepped = loop.optim_step_progress.total.ready - steps
            if stepped:
                raise OptimizerSteppedError(
                    f"the training_step ran out of memory after {stepped} optimizer step(s) in it, so it is not "
                    "retried: the weights and the optimizer's state had moved, and running it again would step "
                    "them twice. Retries cover what runs before the optimizer's step (forward, manual_backward, "
                    f"clipping); the error: {err}"
                ) from err
            raise

    return attempt
