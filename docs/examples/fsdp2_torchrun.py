"""FSDP2 with adaptmem, one process per rank as torchrun starts them.

    torchrun --nproc-per-node 2 docs/examples/fsdp2_torchrun.py          # one GPU per rank, NCCL
    torchrun --nproc-per-node 2 docs/examples/fsdp2_torchrun.py --cpu    # CPU, gloo, a stand-in GPU per rank

A Qwen2 built from a small config (random weights: nothing is downloaded) trains
on token sequences whose length changes from batch to batch. The adaptmem part is
three lines: `fully_shard` each decoder layer, then the model, then
`adaptmem.manage`. Shard first, then manage: the manager then sees FSDP2's
modules from its first step (managing first works too, as long as the model is
sharded before the first step). Every rank runs the same plan at every step, and
an out-of-memory error on one rank is retried by all.

With --cpu each rank gets a `SimulatedDevice` of --capacity-mib (real
out-of-memory errors, counted on the CPU) in place of a GPU. --json PATH writes
each rank's step records to PATH with the rank before its suffix.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import adaptmem


def build_model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same weights on every rank before sharding
    return Qwen2ForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, a SimulatedDevice per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--capacity-mib", type=int, default=48, help="with --cpu: each rank's stand-in device")
    p.add_argument("--budget", default="80%")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    cuda = not args.cpu and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    model = build_model(args.hidden, args.layers, args.vocab).to(device)
    for layer in model.model.layers:  # 1. each decoder layer its own FSDP2 unit
        fully_shard(layer)
    fully_shard(model)  # 2. then the model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    from adaptmem.testing import SimulatedDevice

    stand_in = None if cuda else SimulatedDevice(capacity_bytes=args.capacity_mib * 2**20, name=f"rank{rank}")
    records = []
    generator = torch.Generator().manual_seed(rank)
    with stand_in or torch.enable_grad():
        if stand_in is not None:
            stand_in.track(model)  # the shards made before it, counted as a GPU holds them
        with adaptmem.manage(model, budget=args.budget, device=stand_in) as mem:  # 3. then adaptmem
            for step in range(args.steps):
                length = int(torch.randint(64, 257, (1,), generator=generator))
                ids = torch.randint(0, args.vocab, (2, length), generator=generator).to(device)
                loss = mem.run_step(lambda: _backward(model, ids))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                last = mem.last_step
                records.append({k: last[k] for k in ("plan", "head", "observed_peak_bytes", "budget_bytes", "attempt")})
                if rank == 0:
                    print(
                        f"step {step + 1}/{args.steps}: {length} tokens, loss {loss.item():.3f}, "
                        f"peak {last['observed_peak_bytes'] / 2**20:.1f} MiB of {last['budget_bytes'] / 2**20:.1f}",
                        flush=True,
                    )
            summary = mem.summary()
    if rank == 0:
        print({k: summary[k] for k in ("steps", "ooms", "ooms_recovered", "plan_changes")}, flush=True)
    if args.json is not None:
        out = args.json.with_name(f"{args.json.stem}.rank{rank}{args.json.suffix}")
        out.write_text(json.dumps({"records": records, "summary": summary}, default=str))
    dist.barrier()
    dist.destroy_process_group()


def _backward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


if __name__ == "__main__":
    main()
