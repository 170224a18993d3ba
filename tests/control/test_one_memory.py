"""No offload where there is no second memory: on the host itself (no CUDA, device None
or "cpu"), OFFLOAD and its combinations are never planned, not even as the tightest plan."""

import pytest
import torch
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import Mode
from adaptmem.config.policy import load_policy


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=None is the GPU here")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_host_never_offloads(device):
    model = tiny()
    policy = load_policy("max-savings")  # every mode, OFFLOAD combinations included
    # a budget under what the process already holds: every plan is infeasible, the tightest is chosen
    with adaptmem.manage(model, policy=policy, budget="64MiB", device=device) as mem:
        for seq in (32, 64, 48):
            mem.run_step(lambda s=seq: model(**tiny_batch(model, seq=s)).loss.backward())
            model.zero_grad(set_to_none=True)
        start = mem.events.of_type("start")[0]
        plans = [set(r["plan"]) for r in mem.events.of_type("step")]
    assert not any(Mode.OFFLOAD in m for m in mem.allowed_modes)
    assert all("OFFLOAD" not in label for label in start["modes"])
    assert all(not any("OFFLOAD" in mode for mode in plan) for plan in plans)
    assert any(plan != {"NONE"} for plan in plans)  # it did plan tightly
