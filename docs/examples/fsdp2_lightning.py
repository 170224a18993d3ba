"""FSDP2 with adaptmem in Lightning: `ModelParallelStrategy` and `AdaptMemCallback`.

    python docs/examples/fsdp2_lightning.py             # every GPU of the machine, NCCL
    python docs/examples/fsdp2_lightning.py --cpu       # 2 CPU processes, gloo, a stand-in GPU each

Lightning starts the other ranks itself (it runs this script again for each).
The model is sharded in `configure_model`, as `ModelParallelStrategy` asks: each
decoder layer, then the model, on the strategy's data-parallel mesh. The
callback builds its manager when training starts, after the sharding, and runs
each micro-batch's closure as one managed step: one plan on every rank, and an
out-of-memory error on one rank retried by all. A Qwen2 built from a small
config (random weights), trained on token sequences whose length changes from
batch to batch. --json PATH writes each rank's step records (the rank before
the suffix).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning
import torch
from fsdp2_torchrun import build_model  # this folder's other example (Lightning runs this script again per rank)
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from adaptmem.integrations.lightning import AdaptMemCallback


class Causal(lightning.LightningModule):
    def __init__(self, hidden: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.model = build_model(hidden, layers, vocab)  # the torchrun example's Qwen2

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Lengths(torch.utils.data.Dataset):
    """Batches of token ids whose length changes from one to the next (the same on every rank)."""

    def __init__(self, steps: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(64, 257, (steps,), generator=generator).tolist()
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab, (2, self.lengths[i]), generator=generator)


class Records(lightning.Callback):
    """Each step's plan, peak and budget, from the adaptmem callback's manager."""

    def __init__(self, adaptmem: AdaptMemCallback) -> None:
        self.adaptmem, self.records = adaptmem, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = self.adaptmem.manager.last_step
        self.records.append({k: last[k] for k in ("plan", "head", "observed_peak_bytes", "budget_bytes", "attempt")})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="2 CPU processes on gloo, a SimulatedDevice each")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--capacity-mib", type=int, default=48, help="with --cpu: each rank's stand-in device")
    p.add_argument("--budget", default="80%")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    cpu = args.cpu or not torch.cuda.is_available()
    stand_in = None
    if cpu:
        from adaptmem.testing import SimulatedDevice

        stand_in = SimulatedDevice(capacity_bytes=args.capacity_mib * 2**20)
    callback = AdaptMemCallback(budget=args.budget, device=stand_in)
    records = Records(callback)
    trainer = lightning.Trainer(
        accelerator="cpu" if cpu else "cuda",
        devices=2 if cpu else "auto",
        strategy=ModelParallelStrategy(data_parallel_size=2 if cpu else "auto", tensor_parallel_size=1),
        max_steps=args.steps,
        callbacks=[callback, records],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(Lengths(args.steps, args.vocab), batch_size=None)
    module = Causal(args.hidden, args.layers, args.vocab)
    with stand_in or torch.enable_grad():
        trainer.fit(module, data)
    rank = trainer.global_rank
    if rank == 0:
        print(
            f"{len(records.records)} steps; peaks / budget: "
            + ", ".join(f"{r['observed_peak_bytes'] / r['budget_bytes']:.2f}" for r in records.records),
            flush=True,
        )
    if args.json is not None:
        out = args.json.with_name(f"{args.json.stem}.rank{rank}{args.json.suffix}")
        out.write_text(json.dumps({"records": records.records}))


if __name__ == "__main__":
    main()
