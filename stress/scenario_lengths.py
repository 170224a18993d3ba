"""Sequence lengths that ramp up and spike 4x: the budget holds on every length seen before.

    python -m stress.scenario_lengths [--short]

A tiny transformer under a budget halfway between every block CHECKPOINT and
unmanaged at the longest length, on a stand-in a little larger than the budget.
Lengths ramp up, then a base length is interrupted by 4x spikes. Violations: a
step that fails, a step over the stand-in's capacity (an unrecovered OOM), or a
step over the budget at a length already seen (a first sight may be
extrapolated short: it must be recovered, and the next sight must fit).
"""

from __future__ import annotations

import sys

import adaptmem
from adaptmem import Mode
from adaptmem.testing import SimulatedDevice, measure_peak
from stress.scenario_kit import Scenario, batch, main_for, tiny


def run(short: bool = False) -> list[str]:
    ramp = list(range(32, 257, 32 if short else 16))
    spikes = [64, 64, 256, 64, 64, 256, 64] * (1 if short else 4)
    lengths = ramp + spikes
    top = max(lengths)
    low = measure_peak(tiny(), lambda: batch(tiny(), top), mode=Mode.CHECKPOINT)
    high = measure_peak(tiny(), lambda: batch(tiny(), top))
    budget = int(low + 0.5 * (high - low))
    model = tiny()
    dev, meter = SimulatedDevice(capacity_bytes=int(budget / 0.9)), SimulatedDevice()
    dev.track(model)
    meter.track(model)
    scenario = Scenario(60 if short else 300)
    violations = scenario.violations
    seen, firsts = set(), 0
    with meter, dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for i in scenario.steps(len(lengths)):
            seq = lengths[i]
            meter.reset_peak()
            data = batch(model, seq, seed=i)
            if not scenario.survived(
                i, lambda: mem.run_step(lambda: model(**data).loss.backward()), f" (length {seq})"
            ):
                break
            model.zero_grad(set_to_none=True)
            peak = meter.peak_bytes
            if seq in seen and i > 0 and peak > budget:
                violations.append(f"step {i}: length {seq}, seen before, peaked at {peak / budget:.3f}x the budget")
            firsts += seq not in seen and peak > budget
            seen.add(seq)
        s = mem.summary()
    print(
        f"{len(lengths)} steps over lengths {min(lengths)}..{top}: {s['ooms']} OOMs, {s['ooms_recovered']} recovered, "
        f"{firsts} first sights over the budget, {s['plan_changes']} plan changes"
    )
    scenario.all_recovered(s)
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
