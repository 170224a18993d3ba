"""What the stress scenarios share: a small model, its batches, a meter, and how a scenario reports.

Each scenario is a script: `python -m stress.scenario_NAME [--short]`. It runs under a
time bound, prints what it measured, and exits non-zero when a promise was broken
(each broken promise is one line). `run(short=True)` is the version the test suite
runs; `make stress` runs the long ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch


def tiny(dropout: float = 0.1, layers: int = 4, dim: int = 64) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(TinyConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, dropout=dropout))


def batch(model: TinyTransformer, seq: int, seed: int = 1, size: int = 2) -> dict:
    return random_batch(model.cfg, size, seq, generator=torch.Generator().manual_seed(seed))


class Deadline:
    """A scenario's time bound: `expired` once `seconds` have passed."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.end


def main_for(run: Callable[..., list[str]], doc: str, argv=None) -> int:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the short version the test suite runs")
    args = p.parse_args(argv)
    start = time.perf_counter()
    violations = run(short=args.short)
    for v in violations:
        print(f"VIOLATION {v}")
    print(f"{'FAILED' if violations else 'ok'} in {time.perf_counter() - start:.0f} s")
    return 1 if violations else 0
