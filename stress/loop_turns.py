"""A recurrent-depth model whose loop's count is drawn per batch, managed on a tight stand-in.

    python -m stress.loop_turns                  # 12 batches, turns 1..6, on 14 MiB
    python -m stress.loop_turns --capacity-mib 20 --seed 1

A prelude of two layers, a core of two layers run `turns` times, a coda (width 64, vocab 64),
trained with AdamW at batch 4 on 64 to 128 tokens, its turns drawn per batch as recurrent-depth
training draws them. One line a step: the turns, the blocks the manager has (each call of the core
is a block of its own, and a forward with more turns than any before adds its turns as blocks), the
step's peak against its budget, and the plan. Then the run's summary, and whether the weights and
AdamW's state are `torch.equal` to the same training unmanaged.
"""

from __future__ import annotations

import argparse
import copy
import logging

import torch
from torch import nn

import adaptmem
from adaptmem.testing import SimulatedDevice

TURNS = (3, 3, 2, 4, 3, 1, 5, 3, 4, 2, 6, 3)
LENGTHS = (64, 96, 128, 64, 128, 96, 128, 64, 128, 96, 128, 112)


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class RecurrentDepth(nn.Module):
    """A prelude of two layers, a core of two layers run `loops` times, a coda; returns logits."""

    def __init__(self, width: int = 32, vocab: int = 64, loops: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.prelude = nn.ModuleList([Layer(width) for _ in range(2)])
        self.core = nn.ModuleList([Layer(width) for _ in range(2)])
        self.coda = Layer(width)
        self.out = nn.Linear(width, vocab)
        self.loops = loops

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.prelude:
            x = layer(x)
        for _ in range(self.loops):
            for layer in self.core:
                x = layer(x)
        return self.out(self.coda(x))


def loss_of(model: RecurrentDepth, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def batch(i: int, length: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, length), generator=torch.Generator().manual_seed(i))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-mib", type=float, default=14.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)
    model = RecurrentDepth(width=64)
    plain = copy.deepcopy(model)
    blocks = [*model.prelude, *model.core, model.coda]
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    with SimulatedDevice(capacity_bytes=int(args.capacity_mib * 2**20)) as dev:
        dev.track(model)
        with adaptmem.manage(model, blocks=blocks, budget="90%", device=dev) as mem:
            print("step turns tokens blocks      peak / budget  plan")
            for i, (turns, length) in enumerate(zip(TURNS, LENGTHS)):
                model.loops = turns
                mem.run_step(lambda: loss_of(model, batch(i, length)).backward())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                r = mem.last_step
                peak = r["observed_peak_bytes"]
                plan = " ".join(m[0] for m in r["plan"])
                print(
                    f"{i + 1:4d} {turns:5d} {4 * length:6d} {len(mem.handles):6d} "
                    f"{peak / 2**20:7.2f} MiB {peak / r['budget_bytes']:6.0%}  {plan}"
                )
            summary = mem.summary()
    print(
        f"\npeak {summary['peak_bytes'] / 2**20:.2f} MiB against a budget of {summary['budget_bytes'] / 2**20:.2f} MiB "
        f"({summary['peak_bytes'] / summary['budget_bytes']:.0%}); out-of-memory errors {summary['ooms']}, "
        f"recovered {summary['ooms_recovered']}"
    )
    reference = torch.optim.AdamW(plain.parameters(), 1e-3)
    for i, (turns, length) in enumerate(zip(TURNS, LENGTHS)):
        plain.loops = turns
        loss_of(plain, batch(i, length)).backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    states = zip(optimizer.state.values(), reference.state.values())
    same = same and all(torch.equal(a[k], b[k]) for a, b in states for k in a)
    print(f"weights and AdamW state torch.equal to the unmanaged run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
