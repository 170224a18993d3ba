"""The manager's state outlives the fit: a checkpoint saved after training ends (Lightning's
`trainer.save_checkpoint`, the Trainer's `save_state()`) resumes the run; a resumed run logs
under its saved run id only, from its `start` record on; a resume that finds no adaptmem
state says so. A real lightning.Trainer on an MLP stack of its own, a real transformers.Trainer
on a Qwen2 built from a config, both under SimulatedDevice on the CPU."""

import json
import logging

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")
import lightning.pytorch as pl
from helpers import hf_arguments, lightning_trainer, quiet_transformers
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer

from adaptmem import read_log
from adaptmem.integrations.lightning import AdaptMemCallback
from adaptmem.integrations.transformers import AdaptMemTrainerCallback
from adaptmem.testing import SimulatedDevice

COLD = "holds no adaptmem state"


def cold_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "adaptmem" and r.levelno == logging.WARNING and COLD in r.getMessage()
    ]


# ------------------------------------------------------------------ Lightning
class Residual(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.LayerNorm(dim),
            torch.nn.Linear(dim, 4 * dim),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(4 * dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class LitMLP(pl.LightningModule):
    """A regression MLP: an input layer, a stack of residual MLP blocks (adaptmem's blocks), a head."""

    def __init__(self, dim: int = 32, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.Sequential(*[Residual(dim) for _ in range(blocks)])
        self.out = torch.nn.Linear(dim, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.out(self.blocks(self.inp(x))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def regression(n: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n * 4, 16, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True)), batch_size=4)


def lightning_fit(root, callback, steps: int, ckpt=None, checkpoint_every=None):
    pl.seed_everything(0, verbose=False)
    callbacks = [callback] if callback is not None else []
    if checkpoint_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    trainer = lightning_trainer(
        max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(checkpoint_every), default_root_dir=root
    )
    trainer.fit(LitMLP(), regression(12), ckpt_path=ckpt)
    return trainer


def saved_manager(path) -> dict | None:
    return torch.load(path, weights_only=False)["callbacks"].get("AdaptMemCallback", {}).get("manager")


def test_lightning_a_checkpoint_saved_after_fit_resumes_the_run_under_its_run_id(tmp_path, caplog):
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    first = AdaptMemCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        trainer = lightning_fit(tmp_path / "a", first, steps=3, checkpoint_every=2)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    run = first.manager.summary()["run"]
    final = saved_manager(tmp_path / "after.ckpt")
    assert final is not None and final["run"] == run and final["counters"]["steps"] == 3
    assert saved_manager(next((tmp_path / "a" / "ckpt").glob("*step=2.ckpt")))["counters"]["steps"] == 2
    learned = final["costs"]["steps_learned"]
    assert learned >= 2

    second = AdaptMemCallback(budget="1GiB", device=dev, log=str(log))
    with dev, caplog.at_level(logging.WARNING, logger="adaptmem"):
        lightning_fit(tmp_path / "b", second, steps=5, ckpt=str(tmp_path / "after.ckpt"))
    assert cold_warnings(caplog) == []
    resumed = next(r for r in read_log(log) if r["type"] == "resume")
    assert resumed["step"] == 3 and resumed["run"] == run
    assert second.manager.summary()["run"] == run and second.manager.summary()["steps"] == 5
    assert second.manager.steps_learned >= learned  # loaded, then learned on
    records = read_log(log)
    assert {r["run"] for r in records} == {run}  # the resumed fit's start record included
    assert [r["type"] for r in records].count("start") == 2
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3, 4, 5]


def test_lightning_a_resume_without_adaptmem_state_says_so_once(tmp_path, caplog):
    ckpt = tmp_path / "plain.ckpt"
    lightning_fit(tmp_path / "plain", None, steps=2).save_checkpoint(ckpt)  # no adaptmem among its callbacks
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev)
    with dev, caplog.at_level(logging.WARNING, logger="adaptmem"):
        lightning_fit(tmp_path / "resumed", callback, steps=4, ckpt=str(ckpt))
    (line,) = cold_warnings(caplog)
    assert str(ckpt) in line and "starts cold" in line and "AdaptMemCallback" in line
    assert callback.manager.summary()["steps"] == 2  # counted from 0: cold, as it said


# ------------------------------------------------------------------ transformers
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 24, vocab: int = 256) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def qwen2() -> Qwen2ForCausalLM:
    """A two-layer Qwen2 from a config (grouped-query attention, biased q/k/v projections)."""
    quiet_transformers()
    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            attention_dropout=0.1,
        )
    )


def hf_train(out, callback, steps: int, resume=None, save_steps=None):
    args = hf_arguments(
        out, max_steps=steps, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500
    )
    callbacks = [callback] if callback is not None else None
    trainer = Trainer(model=qwen2(), args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_transformers_save_state_after_train_holds_the_final_state_and_resumes_the_run(tmp_path, caplog):
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    first = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        trainer = hf_train(tmp_path / "out", first, steps=2)  # no checkpoint during training
    trainer.save_model()
    trainer.save_state()  # writes the Trainer's state as it is, after train
    run = first.manager.summary()["run"]
    assert first.state()["attributes"]["pending_state"]["counters"]["steps"] == 4
    saved = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["AdaptMemTrainerCallback"]["attributes"]["pending_state"]
    assert state["run"] == run and state["counters"]["steps"] == 4  # 2 optimizer steps x 2 micro-batches

    second = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    with dev, caplog.at_level(logging.WARNING, logger="adaptmem"):
        hf_train(tmp_path / "out", second, steps=3, resume=str(tmp_path / "out"))
    assert cold_warnings(caplog) == []
    assert second.manager.summary()["run"] == run and second.manager.summary()["steps"] == 6
    records = read_log(log)
    assert {r["run"] for r in records} == {run}  # the resumed run's start record included
    assert [r["type"] for r in records].count("start") == 2
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 7))


def test_transformers_a_resume_from_a_checkpoint_logs_under_the_saved_run_id_only(tmp_path):
    log = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    first = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        hf_train(tmp_path / "out", first, steps=2, save_steps=2)
    run = first.manager.summary()["run"]
    second = AdaptMemTrainerCallback(budget="1GiB", device=dev, log=str(log))
    with dev:
        hf_train(tmp_path / "out", second, steps=3, resume=str(tmp_path / "out" / "checkpoint-2"))
    records = read_log(log)
    assert {r["run"] for r in records} == {run}
    starts = [i for i, r in enumerate(records) if r["type"] == "start"]
    (resume,) = [i for i, r in enumerate(records) if r["type"] == "resume"]
    assert len(starts) == 2 and starts[1] < resume  # the resumed run's start, then its resume record
    assert records[resume]["started_as"] == run and records[resume]["step"] == 4


def test_transformers_a_resume_without_adaptmem_state_says_so_once_and_saves_it_at_the_next_checkpoint(
    tmp_path, caplog
):
    """The resumed Trainer's `stateful_callbacks` are the checkpoint's, with no entry for this callback:
    its next save looked the entry up and raised KeyError (as it does for any stateful callback added
    on resume), losing the steps since the last save."""
    hf_train(tmp_path / "out", None, steps=2, save_steps=2)  # trained without adaptmem
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemTrainerCallback(budget="1GiB", device=dev)
    with dev, caplog.at_level(logging.WARNING, logger="adaptmem"):
        hf_train(tmp_path / "out", callback, steps=4, resume=str(tmp_path / "out" / "checkpoint-2"), save_steps=2)
    (line,) = cold_warnings(caplog)
    assert "step 2" in line and "starts cold" in line
    assert callback.manager.summary()["steps"] == 4  # the two steps left, 2 micro-batches each, counted from 0
    saved = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["AdaptMemTrainerCallback"]["attributes"]["pending_state"]
    assert state["run"] == callback.manager.summary()["run"] and state["counters"]["steps"] == 4


# ------------------------------------------------------------------ the manager itself
def test_a_manager_built_with_state_logs_under_the_saved_run_id_and_a_wrong_state_changes_nothing(tmp_path):
    import adaptmem

    log = tmp_path / "run.jsonl"
    module = LitMLP()
    with adaptmem.MemoryManager(
        module, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31), log=str(log)
    ) as first:
        state = first.state_dict()
    with adaptmem.MemoryManager(
        module, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31), log=str(log), state=state
    ) as second:
        assert second.summary()["run"] == state["run"]
    assert {r["run"] for r in read_log(log)} == {state["run"]}
    assert [r["type"] for r in read_log(log)] == ["start", "end", "start", "resume", "end"]
    other = LitMLP(blocks=3)
    forward = other.blocks[0].forward
    with pytest.raises(ValueError, match="resume with the same model and block selection"):
        adaptmem.MemoryManager(other, device=SimulatedDevice(capacity_bytes=2**31), state=state)
    assert adaptmem.get_handles(other) == [] and other.blocks[0].forward == forward  # given back as it was
