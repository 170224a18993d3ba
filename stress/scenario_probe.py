"""A probe that throws: training goes on, exactly, and the failures are told.

    python -m stress.scenario_probe [--short]

The manager reads memory through a probe whose readings fail now and then (5%
of them, as a flaky driver would), and then for a stretch of steps, all of them
(a GPU whose management library is gone). Training must go on with gradients
bit-identical to unmanaged training (a lossless policy), steps whose readings
failed are not learned from, and the failures are logged. Violations: a step
that fails, a gradient that differs, or no failure counted.
"""

from __future__ import annotations

import random
import sys

import torch

import adaptmem
from adaptmem.testing import SimulatedDevice, SimulatedProbe
from stress.scenario_kit import Scenario, batch, main_for, tiny


class FlakyProbe(SimulatedProbe):
    """A stand-in's probe whose readings raise at `rate`, or always while `down`."""

    def __init__(self, device: SimulatedDevice, rate: float) -> None:
        super().__init__(device)
        self.rate, self.down, self.raised = rate, False, 0
        self.rng = random.Random(0)

    def _maybe_fail(self) -> None:
        if self.down or self.rng.random() < self.rate:
            self.raised += 1
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    def allocated(self) -> int:
        self._maybe_fail()
        return super().allocated()

    def peak(self) -> int:
        self._maybe_fail()
        return super().peak()

    def external(self) -> int:
        self._maybe_fail()
        return super().external()

    def take_peak(self) -> tuple[int, int]:
        """Peak and allocation in one reading, as CudaProbe reads them at block boundaries."""
        self._maybe_fail()
        top, now = super().peak(), super().allocated()
        self.reset_peak()
        return top, now


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(short: bool = False) -> list[str]:
    steps = 12 if short else 80
    down = range(steps // 2, steps // 2 + 4)
    reference, managed = tiny(dropout=0.1), tiny(dropout=0.1)
    data = [batch(reference, 64, seed=s) for s in range(4)]
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(managed)
    probe = FlakyProbe(dev, rate=0.05)
    scenario = Scenario(60 if short else 300)
    violations = scenario.violations
    with dev, adaptmem.manage(managed, budget=2**28, device=probe) as mem:
        for i in scenario.steps(steps):
            probe.down = i in down
            b = data[i % len(data)]
            torch.manual_seed(i)
            reference(**b).loss.backward()
            torch.manual_seed(i)
            if not scenario.survived(i, lambda: mem.run_step(lambda: managed(**b).loss.backward())):
                break
            expected, got = grads(reference), grads(managed)
            if any(not torch.equal(expected[n], got[n]) for n in expected):
                violations.append(f"step {i}: gradients differ from unmanaged training")
            reference.zero_grad(set_to_none=True)
            managed.zero_grad(set_to_none=True)
        failures = mem._controller.recorder.probe.failures
    print(
        f"{steps} steps; the probe raised {probe.raised} times ({failures} counted in steps), "
        f"all of its readings failed for steps {down.start}..{down.stop - 1}"
    )
    if probe.raised and not failures:
        violations.append("the probe raised, and no failure was counted")
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
