"""AdaptMemTrainerCallback (and the retrying mixin) with a real transformers.Trainer on a
Llama built from a config, generated data, accumulation 2, an injected OOM, and a resume."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from helpers import albert, hf_arguments, llama  # noqa: E402
from transformers import Trainer  # noqa: E402

from adaptmem import load_policy, read_log  # noqa: E402
from adaptmem.integrations.transformers import AdaptMemTrainerCallback, AdaptMemTrainerMixin  # noqa: E402
from adaptmem.testing import SimulatedDevice  # noqa: E402


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 32) -> None:
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 512, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class RetryingTrainer(AdaptMemTrainerMixin, Trainer):
    pass


def inject_backward_oom(model, at_call: int):
    """One out-of-memory error in the backward of the `at_call`-th training forward of block 1."""
    calls = {"n": 0, "fired": 0}

    def arm(module, args, output):
        if not module.training or not torch.is_grad_enabled():
            return
        calls["n"] += 1
        out = output[0] if isinstance(output, tuple) else output
        if calls["n"] == at_call and out.requires_grad:

            def fail(grad):
                if not calls["fired"]:
                    calls["fired"] += 1
                    raise torch.OutOfMemoryError("injected out of memory in backward")

            out.register_hook(fail)

    model.model.layers[1].register_forward_hook(arm)
    return calls


def train(tmp_path, trainer_cls=Trainer, callback=None, oom_at=None, resume=None, **overrides):
    model = llama(layers=3, hidden=64)
    injected = inject_backward_oom(model, oom_at) if oom_at else None
    trainer = trainer_cls(
        model=model,
        args=hf_arguments(tmp_path, **overrides),
        train_dataset=Samples(),
        callbacks=[callback] if callback else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, injected


def test_micro_batches_are_steps_and_an_oom_is_retried_exactly(tmp_path):
    _, plain, _ = train(tmp_path / "plain")
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(tmp_path / "run.jsonl"))
    with dev:
        trainer, model, injected = train(tmp_path / "managed", RetryingTrainer, callback, oom_at=4)
    summary = callback.manager.summary()
    assert injected["fired"] == 1 and summary["ooms_recovered"] == 1
    assert summary["steps"] == 6 and callback.manager.closed  # 3 optimizer steps x 2 micro-batches
    steps = [r for r in read_log(tmp_path / "run.jsonl") if r["type"] == "step"]
    assert [(r["label"]["global_step"], r["label"]["micro_batch"]) for r in steps] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    expected = dict(plain.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    logged = [entry for entry in trainer.state.log_history if "adaptmem/peak_bytes" in entry]
    assert logged and logged[-1]["adaptmem/ooms_recovered"] == 1 and logged[-1]["adaptmem/budget_bytes"] == 2**30


def test_without_the_mixin_each_micro_batch_is_bracketed_by_the_callback(tmp_path):
    callback = AdaptMemTrainerCallback(budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31))
    train(tmp_path, Trainer, callback)
    labels = [r["label"] for r in callback.manager.events.of_type("step")]
    assert [(x["global_step"], x["micro_batch"]) for x in labels] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_state_is_saved_with_the_checkpoint_and_restored_on_resume(tmp_path):
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    first = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    train(tmp_path / "out", RetryingTrainer, first, max_steps=2, save_strategy="steps", save_steps=2)
    run = first.manager.summary()["run"]
    second = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    trainer, _, _ = train(
        tmp_path / "out", RetryingTrainer, second, max_steps=3, resume=str(tmp_path / "out" / "checkpoint-2")
    )
    assert second.manager.summary()["steps"] == 6 and second.manager.summary()["run"] == run
    assert [r["step"] for r in read_log(log, run=run) if r["type"] == "step"] == list(range(1, 7))
    # with restore_callback_states_from_checkpoint the Trainer rebuilds the callback from its saved arguments
    third = AdaptMemTrainerCallback(budget="1GiB", device=dev)
    trainer, _, _ = train(
        tmp_path / "out",
        RetryingTrainer,
        third,
        max_steps=3,
        restore_callback_states_from_checkpoint=True,
        resume=str(tmp_path / "out" / "checkpoint-2"),
    )
    rebuilt = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AdaptMemTrainerCallback))
    assert rebuilt is not third and rebuilt.options["device"] is dev  # the device JSON could not carry
    assert rebuilt.manager.summary()["steps"] == 6


def test_a_callback_that_trains_the_same_model_again_goes_on_with_its_run(tmp_path):
    """A second `train()` of the same model with the same callback (another Trainer, a longer length
    next) continues the run: its run id, its steps, what it learned; no calibration again. Another
    model with that callback starts a run of its own."""
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemTrainerCallback(budget="1GiB", device=dev)
    model = llama(layers=3, hidden=64)

    def fit(model, out):
        RetryingTrainer(
            model=model, args=hf_arguments(tmp_path / out, max_steps=2), train_dataset=Samples(), callbacks=[callback]
        ).train()
        reasons = [e["reason"] for e in callback.manager.events.of_type("plan")]
        return callback.manager.summary(), reasons

    first, reasons = fit(model, "a")
    assert reasons[0] == "calibrate"
    again, reasons = fit(model, "b")
    assert again["run"] == first["run"] and again["steps"] == 2 * first["steps"] > 0
    assert "calibrate" not in reasons
    other, reasons = fit(llama(layers=2, hidden=64), "c")
    assert other["run"] != first["run"] and other["steps"] == first["steps"] and reasons[0] == "calibrate"


def test_the_models_own_checkpointing_is_switched_off_with_one_line(tmp_path, caplog):
    callback = AdaptMemTrainerCallback(budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31))
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        _, model, _ = train(tmp_path, Trainer, callback, gradient_checkpointing=True, max_steps=1)
    assert not model.is_gradient_checkpointing
    assert sum("switched off the model's own gradient checkpointing" in r.getMessage() for r in caplog.records) == 1
    kept = AdaptMemTrainerCallback(
        budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31), keep_model_checkpointing=True
    )
    _, model, _ = train(tmp_path / "kept", Trainer, kept, gradient_checkpointing=True, max_steps=1)
    assert model.is_gradient_checkpointing
    assert kept.manager.events.of_type("own_checkpointing")  # planned around


def test_the_loss_head_is_managed_in_a_trainer_and_the_callback_passes_head(tmp_path):
    """A real Trainer with the policy that always chunks: every step's head is chunked and the
    loss head's logits never reach the Trainer; head=None leaves the head to the model."""
    heads = {}
    for head in ("auto", None):
        dev = SimulatedDevice(capacity_bytes=2**30)
        callback = AdaptMemTrainerCallback(
            policy="long-context", device=dev, head=head, log=str(tmp_path / f"{head}.jsonl")
        )
        trainer = RetryingTrainer(
            model=llama(layers=2, hidden=64, dropout=0.0),
            args=hf_arguments(tmp_path, max_steps=2),
            train_dataset=Samples(n=8),
            callbacks=[callback],
        )
        with dev:
            trainer.train()
        heads[head] = [r["head"] for r in read_log(str(tmp_path / f"{head}.jsonl")) if r["type"] == "step"]
    assert len(heads["auto"]) == 4 and all(h.startswith("CHUNKED:") for h in heads["auto"]), heads
    assert heads[None] == [None] * 4


def test_under_bf16_mixed_precision_the_head_stays_chunked(tmp_path):
    """`bf16=True` has Accelerate cast the model's outputs with `.float()`, the chunked logits among
    them, after the loss consumed them inside forward: the cast is as unmade as they were, and every
    step keeps its head chunked (it raised AttributeError at the first step)."""
    dev = SimulatedDevice(capacity_bytes=2**30)
    log = str(tmp_path / "bf16.jsonl")
    callback = AdaptMemTrainerCallback(policy="long-context", device=dev, log=log)
    trainer = RetryingTrainer(
        model=llama(layers=2, hidden=64, dropout=0.0),
        args=hf_arguments(tmp_path, max_steps=2, bf16=True),
        train_dataset=Samples(n=8),
        callbacks=[callback],
    )
    with dev:
        trainer.train()
    heads = [r["head"] for r in read_log(log) if r["type"] == "step"]
    assert len(heads) == 4 and all(h.startswith("CHUNKED:") for h in heads), heads
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.state.log_history if "loss" in r)


def test_a_resumed_run_on_the_stand_in_counts_the_optimizer_state_it_loaded(tmp_path):
    """The optimizer state a resume loads is made outside the stand-in (the Trainer builds its
    optimizer inside `train()`, so a user cannot `dev.track` it): the callback counts it as training
    begins, and the resumed steps peak as the same steps of the run never interrupted (a Phi-3's read
    45 MiB low, and were planned otherwise)."""

    def run(resume=None):
        model = llama(layers=3, hidden=64)
        dev = SimulatedDevice(capacity_bytes=2**31)
        dev.track(model)
        callback = AdaptMemTrainerCallback(budget="1GiB", device=dev)
        args = hf_arguments(tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
        trainer = RetryingTrainer(model=model, args=args, train_dataset=Samples(), callbacks=[callback])
        with dev:
            trainer.train(resume_from_checkpoint=resume)
        return [(r["step"], r["observed_peak_bytes"]) for r in callback.manager.events.of_type("step")]

    whole = run()
    resumed = run(resume=str(tmp_path / "checkpoint-2"))
    assert [s for s, _ in resumed] == [5, 6], resumed
    # (a few bytes apart, scalars one run holds and the other not; 1.6 MB less before: the AdamW state)
    assert all(abs(a - b) <= 64 for (_, a), (_, b) in zip(resumed, whole[-2:])), (whole, resumed)


def test_albert_shared_layer_under_the_trainer_is_a_block_per_call_and_resumes_so(tmp_path, caplog):
    """ALBERT runs one layer four times a forward: under the Trainer each call becomes a block from
    the second step, training is exact against the plain Trainer, and the state a checkpoint holds
    names the calls, so the resumed run has them from its start."""
    kept = {"policy": load_policy().model_copy(update={"head": "kept"})}

    def run(out, trainer_cls=Trainer, callback=None, resume=None, **overrides):
        model = albert()
        trainer = trainer_cls(
            model=model,
            args=hf_arguments(out, **overrides),
            train_dataset=Samples(),
            callbacks=[callback] if callback else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    plain = run(tmp_path / "plain")
    dev = SimulatedDevice(capacity_bytes=2**31)
    log = tmp_path / "run.jsonl"
    first = AdaptMemTrainerCallback(budget="1GiB", device=dev, blocks="AlbertLayer", log=str(log), **kept)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), dev:
        managed = run(tmp_path / "out", RetryingTrainer, first, save_strategy="steps", save_steps=2)
    assert [h.name.rsplit(".", 1)[-1] for h in first.manager.handles] == ["0", "0#2", "0#3", "0#4"]
    assert all(torch.equal(p, q) for p, q in zip(managed.parameters(), plain.parameters()))
    caplog.clear()
    second = AdaptMemTrainerCallback(budget="1GiB", device=dev, blocks="AlbertLayer", log=str(log), **kept)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), dev:
        run(tmp_path / "out", RetryingTrainer, second, resume=str(tmp_path / "out" / "checkpoint-2"))
    steps = [r for r in read_log(log) if r["type"] == "step"]
    assert [len(s["plan"]) for s in steps] == [1] + [4] * 7  # 6 steps, then the resumed 5 and 6
    assert [s["step"] for s in steps][-2:] == [5, 6] and second.manager.summary()["steps"] == 6
    assert not any("more than once" in r.getMessage() for r in caplog.records)
