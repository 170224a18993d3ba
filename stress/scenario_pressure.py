"""Outside pressure appears and vanishes mid-run: the budget shrinks at once and comes back.

    python -m stress.scenario_pressure [--short]

Another "process" takes a third of the stand-in's memory in the middle of a run
and gives it back later.
Violations: a step that fails, an OOM not recovered, no pressure reaction within
one sampling tick, a step whose peak plus what the others hold passes the
capacity, or a budget not given back by the end.
"""

from __future__ import annotations

import sys

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice
from stress.scenario_kit import Scenario, batch, main_for, tiny


def run(short: bool = False) -> list[str]:
    model = tiny()
    data = batch(model, 128)
    dev, meter = SimulatedDevice(capacity_bytes=24 * 2**20), SimulatedDevice()
    dev.track(model)
    meter.track(model)
    steps, on, off = (16, 4, 8) if short else (60, 10, 30)
    taken = dev.capacity_bytes // 3
    policy = load_policy().model_copy(update={"calm_steps": 3})
    scenario = Scenario(60 if short else 300)
    violations = scenario.violations
    with meter, dev, adaptmem.manage(model, budget="80%", device=dev, policy=policy) as mem:
        user = mem.budget
        for i in scenario.steps(steps):
            if i == on:
                dev.occupy(taken)
                mem.sampler.wait_ticks(1)
                if mem.pressure_events < 1 or mem.budget >= user:
                    violations.append(f"step {i}: {taken} bytes taken, no reaction within a tick")
            if i == off:
                dev.occupy(-taken)
            meter.reset_peak()
            if not scenario.survived(i, lambda: mem.run_step(lambda: model(**data).loss.backward())):
                break
            model.zero_grad(set_to_none=True)
            if meter.peak_bytes + dev.external_bytes > dev.capacity_bytes:
                violations.append(f"step {i}: peak {meter.peak_bytes} + others {dev.external_bytes} > capacity")
        s = mem.summary()
        if mem.budget < user:
            violations.append(f"budget {mem.budget} not given back to {user} by the end")
    print(
        f"{steps} steps, pressure from {on} to {off}: {s['pressure_events']} pressure events, {s['ooms']} OOMs "
        f"({s['ooms_recovered']} recovered), {s['plan_changes']} plan changes"
    )
    scenario.all_recovered(s)
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
