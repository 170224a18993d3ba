"""AdaptMemCallback with a real lightning.Trainer on the CPU, under SimulatedDevice:
accumulation 2, validation during fit, OOMs injected in forward and in backward and
retried exactly, figures in the loggers, save and resume."""

import pytest
import torch

lightning = pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from helpers import lightning_trainer, tiny, tiny_batch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import adaptmem  # noqa: E402
from adaptmem import read_log  # noqa: E402
from adaptmem.integrations.lightning import AdaptMemCallback  # noqa: E402
from adaptmem.testing import SimulatedDevice  # noqa: E402


class Batches(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 32) -> None:
        model = tiny()
        self.items = [tiny_batch(model, batch=2, seq=seq) for _ in range(n)]
        for i, item in enumerate(self.items):
            item["input_ids"] = item["input_ids"].roll(i, dims=1)
            item["labels"] = item["input_ids"].clone()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def loader(n: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Batches(n), batch_size=None)


class LitTiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny()
        self.fail_at: tuple[str, int] | None = None  # (where, batch_idx): one injected OOM
        self.failed = 0
        self.model.blocks[1].register_forward_hook(self._arm_backward)
        self.model.blocks[1].attn.register_forward_pre_hook(self._maybe_fail_forward)

    def _due(self, where: str) -> bool:
        return (
            self.fail_at is not None
            and self.fail_at[0] == where
            and self.training
            and self.fail_at[1] == self._batch_idx
            and not self.failed
        )

    def _maybe_fail_forward(self, module, args):
        if self._due("forward") and torch._C._current_graph_task_id() == -1:
            self.failed += 1
            raise torch.OutOfMemoryError("injected out of memory in forward")

    def _arm_backward(self, module, args, output):
        if self._due("backward") and output.requires_grad:

            def fail(grad):
                if not self.failed:
                    self.failed += 1
                    raise torch.OutOfMemoryError("injected out of memory in backward")

            output.register_hook(fail)

    def training_step(self, batch, batch_idx):
        self._batch_idx = batch_idx
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(tmp_path, *, callback=None, fail_at=None, steps=4, ckpt=None, module=None, checkpoint_every=None):
    pl.seed_everything(0, verbose=False)
    module = module or LitTiny()
    module.fail_at = fail_at
    callbacks = [callback] if callback is not None else []
    if checkpoint_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    trainer = lightning_trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
        val_check_interval=2,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=bool(checkpoint_every),
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(2 * steps), loader(2), ckpt_path=ckpt)
    return trainer, module


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("where", [None, "forward", "backward"])
def test_a_fit_with_accumulation_validation_and_an_oom_is_exact(tmp_path, where):
    _, plain = fit(tmp_path / "plain")
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev, log=str(tmp_path / "run.jsonl"))
    with dev:
        trainer, managed = fit(tmp_path / "managed", callback=callback, fail_at=(where, 3) if where else None)
    mem = callback.manager
    summary = mem.summary()
    assert mem.closed and adaptmem.get_handles(managed) == []  # closed on fit end, model given back
    assert summary["steps"] == 8  # one managed step per micro-batch
    assert summary["ooms_recovered"] == (1 if where else 0) and managed.failed == (1 if where else 0)
    expected = params(plain)
    assert all(torch.equal(p, expected[n]) for n, p in params(managed).items())  # validation changed nothing
    steps = [r for r in read_log(tmp_path / "run.jsonl") if r["type"] == "step"]
    assert [r["label"]["batch_idx"] for r in steps] == list(range(8))
    assert {"adaptmem/peak_bytes", "adaptmem/budget_bytes", "adaptmem/plan_changes", "adaptmem/ooms_recovered"} <= set(
        trainer.logged_metrics
    )


def test_a_resumed_fit_continues_counters_costs_and_the_log(tmp_path):
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    first = AdaptMemCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        fit(tmp_path / "a", callback=first, steps=2, checkpoint_every=2)
    run = first.manager.summary()["run"]
    ckpt = next((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)["callbacks"]["AdaptMemCallback"]["manager"]
    measured = [r for r in read_log(log, run=run) if r["type"] == "step" and r["measured"] == "blocks"]
    assert state["counters"]["steps"] == 4 and state["costs"]["steps_learned"] == len(measured) >= 3
    second = AdaptMemCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        fit(tmp_path / "b", callback=second, steps=4, ckpt=str(ckpt))
    assert second.manager.summary()["steps"] == 8 and second.manager.summary()["run"] == run
    records = read_log(log, run=run)
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 9))
    assert any(r["type"] == "resume" for r in records)


def test_a_resumed_fit_on_the_stand_in_counts_the_optimizer_state_it_loaded(tmp_path):
    """The optimizer state `fit(ckpt_path=...)` loads is made outside the stand-in, by an optimizer
    Lightning builds inside `fit()`: the callback counts it as training starts, and the resumed steps
    peak as the same steps of the fit never interrupted."""

    def run(out, ckpt=None, every=None):
        dev = SimulatedDevice(capacity_bytes=2**31)
        callback = AdaptMemCallback(budget="1GiB", device=dev)
        with dev:
            fit(out, callback=callback, steps=4, ckpt=ckpt, checkpoint_every=every)
        return [(r["step"], r["observed_peak_bytes"]) for r in callback.manager.events.of_type("step")]

    whole = run(tmp_path / "a", every=2)
    ckpt = next(p for p in (tmp_path / "a" / "ckpt").glob("*.ckpt") if "step=2" in p.name)
    resumed = run(tmp_path / "b", ckpt=str(ckpt))
    assert [s for s, _ in resumed] == [5, 6, 7, 8], resumed
    assert all(abs(a - b) <= 64 for (_, a), (_, b) in zip(resumed, whole[-4:])), (whole, resumed)


def test_the_manager_closes_on_an_exception(tmp_path):
    class Boom(LitTiny):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise KeyError("boom")
            return super().training_step(batch, batch_idx)

    callback = AdaptMemCallback(budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31))
    with pytest.raises(KeyError):
        fit(tmp_path, callback=callback, module=Boom())
    assert callback.manager.closed and not callback.manager.sampler.is_alive()


def test_each_micro_batch_and_its_closure_are_freed_when_it_ends_not_at_the_next_collection():
    """The retrying closure holds Lightning's closure weakly: a cycle through it kept every
    micro-batch's inputs alive (on the device) until the garbage collector ran, and the
    manager saw them as memory in use."""
    import gc
    import weakref

    alive: list[weakref.ref] = []

    class Watched(LitTiny):
        def training_step(self, batch, batch_idx):
            alive.append(weakref.ref(batch["input_ids"]))
            return super().training_step(batch, batch_idx)

    class Fresh(Batches):  # each micro-batch made anew, as a loader's collate makes it
        def __getitem__(self, i: int) -> dict:
            return {k: v.clone() for k, v in self.items[i].items()}

    dev = SimulatedDevice(capacity_bytes=2**31)
    trainer = lightning_trainer(
        max_steps=3, accumulate_grad_batches=2, callbacks=[AdaptMemCallback(budget="1GiB", device=dev)]
    )
    gc.collect()
    gc.disable()  # what a cycle holds stays held: only reference counts free anything
    try:
        with dev:
            trainer.fit(Watched(), torch.utils.data.DataLoader(Fresh(6), batch_size=None))
        assert len(alive) == 6
        assert sum(r() is not None for r in alive) <= 1  # the last one, which the loop may still hold
    finally:
        gc.enable()


def test_a_second_fit_with_the_same_callback_is_managed_and_goes_on_with_the_run(tmp_path):
    """`trainer.fit` twice (a second stage, say) with one callback: the second fit builds a new
    manager from where the first one closed (its run id, counters and learned costs), not none."""
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev, log=str(log))
    module = LitTiny()
    with dev:
        fit(tmp_path / "a", callback=callback, steps=2, module=module)
        first = callback.manager
        run = first.summary()["run"]
        fit(tmp_path / "b", callback=callback, steps=2, module=module)
    second = callback.manager
    assert second is not first and first.closed and second.closed
    assert second.summary()["run"] == run and second.summary()["steps"] == 8  # 4 micro-steps a fit
    steps = [r["step"] for r in read_log(log, run=run) if r["type"] == "step"]
    assert steps == list(range(1, 9))


class LitManual(LitTiny):
    """Manual optimization: accumulation of 2 by hand, clipping, a scheduler stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self._batch_idx = batch_idx
        opt, sched = self.optimizers(), self.lr_schedulers()
        self.manual_backward(self.model(**batch).loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if self._due("after the step"):
                self.failed += 1
                raise torch.OutOfMemoryError("injected out of memory after the optimizer step")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))]


def fit_manual(tmp_path, *, callback=None, fail_at=None, steps=4):
    pl.seed_everything(0, verbose=False)
    module = LitManual()
    module.fail_at = fail_at
    trainer = lightning_trainer(
        max_steps=steps,
        val_check_interval=4,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        callbacks=[callback] if callback is not None else [],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(2 * steps), loader(2))
    return module


@pytest.mark.parametrize("where", [None, "forward", "backward"])
def test_a_manual_optimization_step_that_runs_out_of_memory_is_retried_exactly(tmp_path, where):
    plain = fit_manual(tmp_path / "plain")
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev, log=str(tmp_path / "run.jsonl"))
    with dev:
        managed = fit_manual(tmp_path / "managed", callback=callback, fail_at=(where, 3) if where else None)
    summary = callback.manager.summary()
    assert summary["steps"] == 8 and summary["ooms_recovered"] == (1 if where else 0)
    assert managed.failed == (1 if where else 0)
    expected = params(plain)
    assert all(torch.equal(p, expected[n]) for n, p in params(managed).items())
    assert managed.optimizers().optimizer.state_dict()["state"][0]["step"] == 4  # stepped once each window
    steps = [r for r in read_log(tmp_path / "run.jsonl") if r["type"] == "step"]
    assert [r["label"]["batch_idx"] for r in steps] == list(range(8))


def test_a_manual_step_that_runs_out_of_memory_after_its_optimizer_step_is_not_run_again(tmp_path):
    from adaptmem.integrations.lightning import OptimizerSteppedError

    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev)
    with dev, pytest.raises(OptimizerSteppedError, match=r"after 1 optimizer step\(s\) in it, so it is not retried"):
        fit_manual(tmp_path, callback=callback, fail_at=("after the step", 3))
    assert callback.manager.closed and callback.manager.summary()["ooms_recovered"] == 0
