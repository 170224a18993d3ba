"""Compression drift: int8 COMPRESS on every block for 200 steps, against exact training.

    python -m stress.scenario_drift [--short]

Two copies of a tiny transformer train on the same batches with the same
seeds: one exact, one with every block's saved activations quantized to int8
(`Mode.COMPRESS`, lossy). Their losses are compared step by step. Violations: a
step that fails, a non-finite loss, or the compressed run's loss over the last
20 steps (5 short) more than 2% away from the exact run's.
"""

from __future__ import annotations

import math
import sys

import torch

import adaptmem
from adaptmem import CompressOptions, Mode
from stress.scenario_kit import Scenario, batch, main_for, tiny


def run(short: bool = False) -> list[str]:
    steps, tail = (40, 5) if short else (200, 20)
    exact, lossy = tiny(dropout=0.0), tiny(dropout=0.0)
    adaptmem.instrument(lossy, mode=Mode.COMPRESS, compress=CompressOptions(codec="int8", min_bytes=0))
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (exact, lossy)]
    data = [batch(exact, 64, seed=s) for s in range(16)]
    scenario = Scenario(120 if short else 600)
    losses: list[tuple[float, float]] = []
    violations = scenario.violations
    for i in scenario.steps(steps):
        pair = []
        for model, opt in zip((exact, lossy), opts):
            loss = model(**data[i % len(data)]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pair.append(loss.item())
        if not all(math.isfinite(v) for v in pair):
            violations.append(f"step {i}: loss not finite {pair}")
            break
        losses.append((pair[0], pair[1]))
    last = losses[-tail:]
    exact_mean = sum(a for a, _ in last) / len(last)
    lossy_mean = sum(b for _, b in last) / len(last)
    drift = abs(lossy_mean - exact_mean) / exact_mean
    differ = sum(a != b for a, b in losses)
    print(
        f"{len(losses)} steps: loss {losses[0][0]:.3f} -> exact {exact_mean:.5f}, int8 {lossy_mean:.5f} "
        f"over the last {tail} steps (drift {drift:.3%}; {differ} steps' losses differ)"
    )
    if not differ:
        violations.append("the compressed run never differed: nothing was compressed")
    if drift > 0.02:
        violations.append(f"compressed training drifted {drift:.2%} from exact (over 2%)")
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
