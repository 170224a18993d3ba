"""The host work of a checkpoint per saved tensor: adaptmem's (`adaptmem.strategies.rerun`)
against `torch.utils.checkpoint(use_reentrant=False)`, side by side in one run.

    python -m stress.bench_rerun                  # 8 checkpointed functions of 40 tiny ops each, 15 rounds
    python -m stress.bench_rerun --device cuda    # the same ops launched on a GPU (synchronized per round)

Each function saves one tensor per op, and its tensors are tiny, so a step is the host's
work: the plain run's time is the ops', and what a checkpoint adds over it, less the
recompute's own ops (as many as forward ran), is the checkpoint's work, shared out over
the saved tensors. Rounds rotate the three ways, so drift hits all alike; the interval is
over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from adaptmem.strategies import rerun

try:
    from stress.verdicts import at_most, interval
except ImportError:  # run as a script
    from verdicts import at_most, interval

OPS = 40  # ops per function, each saving its input
FUNCTIONS = 8
LINE = 0.5  # adaptmem's work per saved tensor against PyTorch's


def chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(OPS):
        x = x.sin()
    return x


WAYS = {
    "plain": chain,
    "torch.utils.checkpoint": lambda x: torch_checkpoint(chain, x, use_reentrant=False),
    "adaptmem": lambda x: rerun.checkpoint(chain, x),
}


def step(run, x0: torch.Tensor) -> None:
    x = x0
    for _ in range(FUNCTIONS):
        x = run(x)
    x.sum().backward()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="steps per way and round")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x0 = torch.randn(4, device=args.device, requires_grad=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rounds: dict[str, list[float]] = {name: [] for name in WAYS}
    for r in range(args.rounds):
        names = list(WAYS)[r % len(WAYS) :] + list(WAYS)[: r % len(WAYS)]
        for name in names:
            step(WAYS[name], x0)  # warm
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(WAYS[name], x0)
            sync()
            rounds[name].append((time.perf_counter() - t) / args.steps)
    saved = OPS * FUNCTIONS
    plain = rounds["plain"]
    # the recompute runs forward's ops again: half the plain step's ops, roughly
    work = {
        name: [(t - p - p / 2) / saved * 1e6 for t, p in zip(rounds[name], plain)] for name in WAYS if name != "plain"
    }
    plain_ms = 1e3 * statistics.median(plain)
    print(f"{FUNCTIONS} checkpointed functions of {OPS} tiny ops on {args.device}; plain step {plain_ms:.2f} ms")
    for name, us in work.items():
        low, high = interval(us)
        print(f"  {name:<24} {statistics.median(us):5.1f} us of host work per saved tensor [{low:.1f}, {high:.1f}]")
    shares = [a / b for a, b in zip(work["adaptmem"], work["torch.utils.checkpoint"])]
    print(at_most(f"adaptmem's work per saved tensor <= {LINE:g} of PyTorch's", shares, LINE).line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
