"""A long soak that flips every block's mode every step: nothing is left behind.

    python -m stress.scenario_soak [--short]

A tiny transformer, instrumented, trains for 1000 steps (50 short); before each
step every block gets a random lossless mode, offload over a stand-in link
included. After the run, with gradients cleared: the stand-in's device and host
bytes are back at what they were after the first step, copies in flight have
landed, and the offload runtime's pinned pool has not grown (on a CPU it stays
empty; on CUDA it is the pool's own counter). Violations: a step that fails, or
any of those figures off.
"""

from __future__ import annotations

import gc
import random
import sys

import adaptmem
from adaptmem import LOSSLESS_MODES
from adaptmem.testing import SimulatedDevice
from adaptmem.wrapping import get_instrumentation
from stress.scenario_kit import Scenario, batch, main_for, tiny


def run(short: bool = False) -> list[str]:
    steps = 50 if short else 1000
    model = tiny(dropout=0.1)
    data = batch(model, 64)
    handles = adaptmem.instrument(model)
    pool = get_instrumentation(model).runtime.offload.pool
    dev = SimulatedDevice(link_bytes_per_s=2 * 2**30)
    dev.track(model)
    rng = random.Random(3)
    scenario = Scenario(120 if short else 900)
    violations, baseline = scenario.violations, None
    flips = 0
    with dev:
        for i in scenario.steps(steps):
            for h in handles:
                mode = rng.choice(LOSSLESS_MODES)
                flips += mode is not h.mode
                h.mode = mode
            if not scenario.survived(i, lambda: model(**data).loss.backward()):
                break
            model.zero_grad(set_to_none=True)
            if i == 0:
                gc.collect()
                baseline = (dev.allocated_bytes, dev.host_bytes, pool.pinned_bytes)
        gc.collect()
        dev.link.poll()
        end = (dev.allocated_bytes, dev.host_bytes, pool.pinned_bytes)
    in_flight = dev.link.in_flight_bytes
    print(
        f"{steps} steps, {flips} mode flips: device bytes {baseline[0]} -> {end[0]}, host bytes "
        f"{baseline[1]} -> {end[1]}, pinned pool {baseline[2]} -> {end[2]}, copies in flight {in_flight}"
    )
    for what, before, after in zip(("device bytes", "host bytes", "pinned pool bytes"), baseline, end):
        if after > before:
            violations.append(f"{what} grew from {before} to {after}")
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
