"""What the stress scenarios share: a small model, its batches, a meter, and how a scenario reports.

Each scenario is a script: `python -m stress.scenario_NAME [--short]`. It runs under a
time bound, prints what it measured, and exits non-zero when a promise was broken
(each broken promise is one line). `run(short=True)` is the version the test suite
runs; `make stress` runs the long ones.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch


def tiny(dropout: float = 0.1, layers: int = 4, dim: int = 64) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(TinyConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=4, dropout=dropout))


def batch(model: TinyTransformer, seq: int, seed: int = 1, size: int = 2) -> dict:
    return random_batch(model.cfg, size, seq, generator=torch.Generator().manual_seed(seed))


class Scenario:
    """A scenario's broken promises (`violations`, one line each) and its time bound."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.violations: list[str] = []

    def steps(self, n: int):
        """0..n-1, stopping early (a violation) once the time bound has passed."""
        for i in range(n):
            if time.monotonic() > self.end:
                self.violations.append(f"time bound passed at step {i}")
                return
            yield i

    def survived(self, i: int, step: Callable[[], object], what: str = "") -> bool:
        """Run one step; an exception escaping it is the violation (False: stop there)."""
        try:
            step()
            return True
        except Exception as err:
            self.violations.append(f"step {i}{what} failed: {type(err).__name__}: {err}")
            return False

    def all_recovered(self, summary: dict) -> None:
        """Every out-of-memory error the manager saw was recovered."""
        if summary["ooms"] != summary["ooms_recovered"]:
            self.violations.append(f"{summary['ooms'] - summary['ooms_recovered']} OOMs not recovered")


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
