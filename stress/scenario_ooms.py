"""Out-of-memory errors injected at random points of forward, recompute and backward, all
recovered with the whole training state exact.

    python -m stress.scenario_ooms [--short]

A tiny transformer with dropout, every second block checkpointed (so recomputes
run in backward), trains with AdamW. A seeded injector raises
`torch.OutOfMemoryError` at a random block, in a random place (its forward, its
recompute, or its backward), on some steps' first attempt; `run_step` retries.
The same steps run unmanaged, without injections. Violations: a step that fails,
an injection not recovered, or any parameter, gradient, buffer or optimizer
state that differs (torch.equal) from the unmanaged run's.
"""

from __future__ import annotations

import random
import sys

import torch

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.devices.faults import PLACES
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice
from stress.scenario_kit import Scenario, batch, main_for, tiny


def train(steps: int, inject: int | None, scenario: Scenario) -> tuple[dict, int, int]:
    model = tiny(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [batch(model, 64, seed=s) for s in range(8)]
    rng = random.Random(5)
    injector, mem = None, None
    if inject is not None:
        policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0})
        mem = adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31))
        injector = OutOfMemoryInjector(model.blocks)
    torch.manual_seed(11)
    for s in scenario.steps(steps):
        b = data[s % len(data)]
        if mem is not None:
            if injector.fired < inject and rng.random() < 0.8:
                injector.arm(rng.randrange(len(model.blocks)), rng.choice(PLACES))
            if not scenario.survived(s, lambda: mem.run_step(lambda: model(**b).loss.backward())):
                break
            injector.disarm()  # an armed place the step never reached (recompute of a NONE block)
        else:
            model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {
        **{f"p.{n}": p.detach().clone() for n, p in model.named_parameters()},
        **{f"b.{n}": t.clone() for n, t in model.named_buffers()},
        **{f"o.{i}.{k}": v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()},
        "rng": torch.get_rng_state(),
    }
    recovered = 0
    if mem is not None:
        recovered = mem.summary()["ooms_recovered"]
        mem.close()
    fired = injector.fired if injector else 0
    return state, fired, fired - recovered


def run(short: bool = False) -> list[str]:
    target = 10 if short else 100
    steps = 2 * target  # about 80% of the steps are armed; some armed places are not on the step's path
    scenario = Scenario(120 if short else 600)
    violations = scenario.violations
    expected, _, _ = train(steps, None, scenario)
    got, fired, unrecovered = train(steps, target, scenario)
    if fired < target:
        violations.append(f"only {fired} of {target} OOMs were injected")
    if unrecovered:
        violations.append(f"{unrecovered} injected OOMs not recovered")
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    if differ:
        violations.append(f"{len(differ)} state tensors differ from unmanaged training, e.g. {differ[:3]}")
    print(
        f"{steps} steps, {fired} OOMs injected and {fired - unrecovered} recovered; "
        f"state compared over {len(expected)} tensors"
    )
    return violations


if __name__ == "__main__":
    sys.exit(main_for(run, __doc__))
