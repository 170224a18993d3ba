"""A loop driven by PyTorch-Ignite: the engine's process function runs each batch through
`run_step`, the manager rides in Ignite's `Checkpoint` with the model, the optimizer, the engine
and the LR scheduler, and a run stopped mid-epoch and resumed in fresh objects ends bit-exact."""

import copy

import pytest
import torch

ignite = pytest.importorskip("ignite")
from helpers import assert_same_state, llama, training_state  # noqa: E402
from ignite.engine import DeterministicEngine, Events  # noqa: E402
from ignite.handlers import Checkpoint, CosineAnnealingScheduler, DiskSaver  # noqa: E402

import adaptmem  # noqa: E402
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice  # noqa: E402

LENGTHS = (24, 48, 32, 64, 40, 56)


def data() -> list[dict]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for seq in LENGTHS:
        ids = torch.randint(0, 512, (2, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run(model, managed: bool, folder, *, stop_at: int | None = None, resume: bool = False, oom_at=()):
    """Train one epoch of `data()` with a `DeterministicEngine` (AdamW, clipping, a cosine LR
    schedule), saving everything every two iterations; `stop_at` ends the run there, `resume`
    starts from the checkpoint at iteration 2. `oom_at`: iterations whose block 1 runs out of
    memory in backward once. Returns the model, the optimizer and the manager's summary."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    policy = adaptmem.load_policy().model_copy(update={"head": "kept"})
    mem = adaptmem.manage(model, device=dev, policy=policy) if managed else None
    injector = OutOfMemoryInjector(model.model.layers)

    def train_step(engine, batch):
        if engine.state.iteration in oom_at:
            injector.arm(1, "backward")

        def forward_backward():
            loss = model(**batch).loss
            loss.backward()
            return loss.item()

        loss = mem.run_step(forward_backward) if mem is not None else forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    trainer = DeterministicEngine(train_step)
    schedule = CosineAnnealingScheduler(opt, "lr", 1e-3, 1e-5, cycle_size=len(LENGTHS))
    trainer.add_event_handler(Events.ITERATION_STARTED, schedule)
    objects = {"model": model, "optimizer": opt, "trainer": trainer, "lr_scheduler": schedule}
    if mem is not None:
        objects["mem"] = mem
    saver = Checkpoint(objects, DiskSaver(str(folder), require_empty=False), n_saved=None, filename_prefix="ck")
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), saver)
    if stop_at is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda engine: engine.terminate())
    if resume:
        Checkpoint.load_objects(objects, torch.load(folder / "ck_checkpoint_2.pt", weights_only=False))
    torch.manual_seed(1)
    with dev:
        trainer.run(data(), max_epochs=1)
    summary = mem.summary() if mem is not None else None
    if mem is not None:
        mem.close()
    return model, opt, summary


def test_an_ignite_engine_resumed_mid_epoch_with_retries_is_exact(tmp_path):
    torch.manual_seed(0)
    base = llama(layers=3, hidden=64, vocab=512)
    plain, plain_opt, _ = run(copy.deepcopy(base), False, tmp_path / "plain")
    straight, straight_opt, summary = run(copy.deepcopy(base), True, tmp_path / "straight", oom_at=(2, 5))
    assert summary["steps"] == len(LENGTHS) and summary["ooms_recovered"] == 2
    assert_same_state(training_state(straight, straight_opt), training_state(plain, plain_opt))
    # stopped after iteration 3, resumed from the checkpoint of iteration 2 in fresh objects
    run(copy.deepcopy(base), True, tmp_path / "split", stop_at=3, oom_at=(2,))
    resumed, resumed_opt, summary = run(copy.deepcopy(base), True, tmp_path / "split", resume=True, oom_at=(5,))
    assert summary["steps"] == len(LENGTHS) and summary["ooms_recovered"] == 2  # the saved run's one, and its own
    assert_same_state(training_state(resumed, resumed_opt), training_state(plain, plain_opt))
