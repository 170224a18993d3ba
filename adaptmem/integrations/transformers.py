"""adaptmem inside a Hugging Face `transformers.Trainer`.

`AdaptMemTrainerCallback` is the thin adapter: the manager is built on the model at
`on_train_begin` and closed at `on_train_end`. The Trainer has no per-micro-batch
begin event, so each micro-batch is bracketed from `on_step_begin` (or the
previous `on_substep_end`) to the next `on_substep_end` / `on_pre_optimizer_step`:
two micro-batches are never learned as one.

The Trainer has no exception event either: to have a micro-batch that runs out
of memory retried under a tighter plan, mix `AdaptMemTrainerMixin` into the
Trainer class; its `training_step` runs through `run_step` (then the callback's
brackets stand aside), and it puts the callback first, so the reporters see
the figures it adds to each log.

The manager's state rides in the Trainer's checkpoint (`trainer_state.json`, the
callback being an `ExportableState`) and is restored on resume with no extra
flag: the resumed Trainer loads it into `state.stateful_callbacks`, where the
callback finds it, and the manager is built from it (its log goes on under the
saved run id). A resume that finds none says so and starts cold. At train end
the closed manager's last state is kept and put in `state.stateful_callbacks`,
which `trainer.save_state()` writes as it is. With
`restore_callback_states_from_checkpoint=True` the Trainer also rebuilds
callbacks from their saved arguments; arguments that are not JSON (a
`SimulatedDevice`, a `Policy` object) are then taken from the callback the user
passed, when it is still alive in this process.

The model's own gradient checkpointing (`TrainingArguments(gradient_checkpointing=True)`,
which the Trainer switches on before `on_train_begin`) is switched off with one log
line saying adaptmem now decides, unless `keep_model_checkpointing=True`: then
adaptmem plans around the blocks that checkpoint themselves.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from adaptmem.control.manager import MemoryManager
from adaptmem.integrations.stand_in import count_loaded

__all__ = ["AdaptMemTrainerCallback", "AdaptMemTrainerMixin"]

log = logging.getLogger("adaptmem")

_JSON = (str, int, float, bool, type(None))
_LIVE: weakref.WeakValueDictionary[str, AdaptMemTrainerCallback] = weakref.WeakValueDictionary()


def _own_checkpointing_name(model: Any) -> str:
    """What this transformers calls a model's own checkpointing: `activation_checkpointing`
    in newer versions (where the `gradient_checkpointing` names warn), else the old name."""
    return "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"


def own_checkpointing_on(model: Any) -> bool:
    """The model's own (Hugging Face) checkpointing is on."""
    return bool(getattr(model, f"is_{_own_checkpointing_name(model)}", False))


def switch_own_checkpointing(model: Any, on: bool) -> None:
    """Switch the model's own checkpointing on (non-reentrant) or off, by its current name."""
    name = _own_checkpointing_name(model)
    if on:
        getattr(model, f"{name}_enable")(**{f"{name}_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_disable")()


class AdaptMemTrainerCallback(TrainerCallback, ExportableState):
    """Adaptive activation memory for a Hugging Face Trainer.

    Args: as for `adaptmem.manage` (`policy`, `budget`, `device`, `blocks`, `log`, `head`);
    `keep_model_checkpointing`: leave the model's own gradient checkpointing on.
    """

    def __init__(
        self,
        *,
        policy: Any = None,
        budget: Any = None,
        device: Any = None,
        blocks: Any = "auto",
        log: str | None = None,
        keep_model_checkpointing: bool = False,
        head: Any = "auto",
        _origin: str | None = None,
    ) -> None:
        origin = _LIVE.get(_origin) if _origin is not None else None
        if origin is not None:  # rebuilt by the Trainer on resume: keep what JSON could not carry
            policy, device, blocks, head = (origin.options[k] for k in ("policy", "device", "blocks", "head"))
        self.options = {
            "policy": policy,
            "budget": budget,
            "device": device,
            "blocks": blocks,
            "log": log,
            "head": head,
        }
        self.keep_model_checkpointing = keep_model_checkpointing
        self.manager: MemoryManager | None = None
        self.pending_state: dict | None = None  # restored by the Trainer, for the manager to be built
        self.final_state: dict | None = None  # the closed manager's last, for what is saved after train
        self.retrying = False  # AdaptMemTrainerMixin runs each micro-batch through run_step
        self.micro = 0  # the micro-batch within the current optimizer step
        self._token = uuid.uuid4().hex
        self._trained: Callable[[], Any] = _nothing  # the model the last `train()` managed
        _LIVE[self._token] = self

    # ------------------------------------------------------------ lifecycle
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        count_loaded(self.options.get("device"), kwargs.get("optimizer"))
        if self.manager is not None and not self.manager.closed:
            return
        self._own_checkpointing_off(model)
        saved = self.pending_state or _saved_state(state, type(self).__name__)
        if saved is None and self.final_state is not None and self._trained() is model:
            # this callback trains the same model again (a second `train()`, or another Trainer): the run
            # goes on, as a second fit does under Lightning. Started cold, a run continued at a longer
            # length calibrated again, ran 16% over its budget, and one batch was given up
            saved = self.final_state
        elif saved is None and getattr(state, "global_step", 0) > 0:
            log.warning(
                "adaptmem: the Trainer resumed at step %d from a checkpoint that holds no adaptmem state "
                "(no %s entry with a manager state in its trainer_state.json stateful_callbacks: saved "
                "without this callback, or after train ended); the controller starts cold: a new run id, "
                "steps counted from 0, costs learned again",
                state.global_step,
                type(self).__name__,
            )
        self.manager = MemoryManager(model, **self.options, state=saved)
        self.pending_state = self.final_state = None
        self._trained = weakref.ref(model) if model is not None else _nothing
        callbacks = getattr(state, "stateful_callbacks", None)
        if isinstance(callbacks, dict):
            # a resumed Trainer's are the checkpoint's: one saved without this callback has no entry for
            # it, and the next save looks the entry up (KeyError: 'AdaptMemTrainerCallback')
            callbacks.setdefault(type(self).__name__, self.state())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is None or self.manager.closed:
            return
        if self.manager.in_step:
            self.manager.end_step()
        try:
            self.final_state = self.manager.state_dict()
        finally:
            self.manager.close()
        _publish(state, self)

    def _own_checkpointing_off(self, model: Any) -> None:
        if self.keep_model_checkpointing or not own_checkpointing_on(model):
            return
        switch_own_checkpointing(model, False)
        log.warning(
            "adaptmem: switched off the model's own gradient checkpointing (gradient_checkpointing=True or "
            "activation_checkpointing=True in the arguments, or the model's own; TRL's SFTConfig and DPOConfig "
            "turn it on by default); adaptmem now decides which blocks to recompute. Pass "
            "keep_model_checkpointing=True to keep it."
        )

    # ------------------------------------------------------------ brackets
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.micro = 0
        self._begin(state)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()
        self.micro += 1
        self._begin(state)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()

    def label(self, state: Any) -> dict:
        return {"global_step": state.global_step, "micro_batch": self.micro}

    def _begin(self, state: Any) -> None:
        if self.manager is not None and not self.retrying and not self.manager.in_step:
            self.manager.begin_step(label=self.label(state))

    def _end(self) -> None:
        if self.manager is not None and not self.retrying and self.manager.in_step:
            self.manager.end_step()

    # ------------------------------------------------------------ loggers
    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Peak, budget, plan changes and recovered OOMs join each log: the record kept in
        `state.log_history`, and the dict the reporters after this callback receive."""
        if self.manager is None or logs is None:
            return
        summary = self.manager.summary()
        figures = {
            "adaptmem/peak_bytes": summary["peak_bytes"],
            "adaptmem/budget_bytes": summary["budget_bytes"],
            "adaptmem/plan_changes": summary["plan_changes"],
            "adaptmem/ooms_recovered": summary["ooms_recovered"],
        }
        logs.update(figures)
        if state.log_history:
            state.log_history[-1].update(figures)

    # ------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """What the Trainer saves of the callback: its JSON arguments, and as `pending_state` the
        live manager's state (after train, the closed manager's last; before it, what was loaded)."""
        manager_state = self.manager.state_dict() if self.manager is not None and not self.manager.closed else None
        args = {k: v for k, v in self.options.items() if isinstance(v, _JSON)}
        args["keep_model_checkpointing"] = self.keep_model_checkpointing
        args["_origin"] = self._token
        return {"args": args, "attributes": {"pending_state": manager_state or self.final_state or self.pending_state}}


class AdaptMemTrainerMixin:
    """Mix into a `Trainer` subclass to have micro-batches that run out of memory retried::

    class MyTrainer(AdaptMemTrainerMixin, Trainer): ...
    trainer = MyTrainer(model, args, ..., callbacks=[AdaptMemTrainerCallback(budget="80%")])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        callbacks = self.callback_handler.callbacks  # adaptmem's first: reporters then see its figures
        callbacks.sort(key=lambda c: not isinstance(c, AdaptMemTrainerCallback))

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        callback = next((c for c in self.callback_handler.callbacks if isinstance(c, AdaptMemTrainerCallback)), None)
        if callback is None or callback.manager is None or callback.manager.closed:
            return super().training_step(model, inputs, num_items_in_batch)
        callback.retrying = True
        if callback.manager.in_step:  # the callback's bracket, opened before the mixin took over
            callback.manager.end_step(error=RuntimeError("handed to run_step"))
        return callback.manager.run_step(
            super().training_step, model, inputs, num_items_in_batch, label=callback.label(self.state)
        )


def _nothing() -> None:
    return None


def _publish(state: Any, callback: AdaptMemTrainerCallback) -> None:
    """Put the callback's state in `state.stateful_callbacks`: the Trainer refreshes it only when
    it saves a checkpoint, and `trainer.save_state()` after train writes it as it is (else as it
    was at the last checkpoint, or at train begin: no manager state at all)."""
    saved = getattr(state, "stateful_callbacks", None)
    if not isinstance(saved, dict):
        return
    name = type(callback).__name__
    entry = saved.get(name)
    if isinstance(entry, list):  # several callbacks of this class: replace this one's entry
        mine = [i for i, e in enumerate(entry) if ((e or {}).get("args") or {}).get("_origin") == callback._token]
        for i in mine:
            entry[i] = callback.state()
    else:
        saved[name] = callback.state()


def _saved_state(state: Any, name: str) -> dict | None:
    """The manager state saved with the checkpoint a resumed Trainer loaded: the Trainer
    restores callbacks only with `restore_callback_states_from_checkpoint=True`, but it
    always loads the saved states into `state.stateful_callbacks`."""
    if not getattr(state, "global_step", 0):
        return None
    saved = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(saved, list):
        saved = saved[0] if saved else None
    if not isinstance(saved, dict):
        return None
    return (saved.get("attributes") or {}).get("pending_state")
