"""retain_graph=True and create_graph=True in every lossless mode: bit-identical to
unmanaged, forced or chosen by a manager. SELECTIVE's second recompute runs every weight
layer (their held outputs went to the first)."""

import pytest
import torch
from helpers import budget_between, cnn, image_batch, tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice

TWICE_OK = list(LOSSLESS_MODES)
MODELS = {
    "transformer": (lambda: tiny(attention="eager"), lambda m: tiny_batch(m)),  # CPU SDPA has no double backward
    "cnn": (cnn, lambda m: image_batch()),
}


def backward_twice(model, batch, kind):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = model(**batch).loss
    if kind == "retain_graph":
        loss.backward(retain_graph=True)
        loss.backward()
    else:  # a gradient penalty
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("mode", TWICE_OK, ids=lambda m: m.label)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_second_backward_is_exact(name, mode, kind):
    make, make_batch = MODELS[name]
    model = make()
    batch = make_batch(model)
    expected = backward_twice(make(), batch, kind)
    handles = adaptmem.instrument(model, mode=mode)
    got = backward_twice(model, batch, kind)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    if mode.recomputes:
        assert all(h.recomputes >= 2 for h in handles)  # recomputed for each backward


def test_a_manager_plans_selective_under_a_second_backward_and_stays_exact(every_layer_held):
    policy = load_policy().model_copy(update={"modes": ("NONE", "SELECTIVE")})
    make = lambda: tiny(attention="eager", dim=128, n_layers=4)
    batch = tiny_batch(make(), batch=4, seq=128)
    budget, _ = budget_between(make, batch, 0.5)
    model = make()
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    chosen, grads = [], []
    with dev, adaptmem.manage(model, policy=policy, budget=budget, device=dev) as mem:
        for _ in range(4):
            with mem.step():
                grads.append(backward_twice(model, batch, "retain_graph"))
            chosen.append(set(mem.plan.values()))
    assert sum(Mode.SELECTIVE in modes for modes in chosen) >= 2  # at half the budget some blocks recompute
    expected = backward_twice(make(), batch, "retain_graph")
    assert all(torch.equal(g[n], expected[n]) for g in grads for n in expected)
