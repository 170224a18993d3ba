"""Out-of-memory errors on demand: a user's check that `run_step` retries a step exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_state, llama, training_state

import adaptmem
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice


def batch(seed: int) -> dict:
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("place", ["forward", "recompute", "backward"])
def test_an_injected_error_is_retried_and_training_equals_unmanaged(place):
    """A Hugging Face Llama's blocks (whose outputs are tensors or tuples), every block checkpointed
    so that a recompute runs: the error fires once where armed, `run_step` runs the step again, and
    the weights and AdamW's state after three steps equal unmanaged training's."""
    model = llama(layers=2, vocab=256)
    reference = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    dev = SimulatedDevice(2**31)
    dev.track(model)
    policy = adaptmem.load_policy("every-2").model_copy(update={"every_k": 1, "head": "kept"})
    with dev, adaptmem.manage(model, device=dev, policy=policy) as mem:
        injector = OutOfMemoryInjector(model.model.layers)
        for step in range(3):
            if step == 1:
                injector.arm(1, place)
            torch.manual_seed(step)
            mem.run_step(lambda: model(**batch(step)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert injector.fired == 1 and injector.armed is None
        assert mem.summary()["ooms_recovered"] == 1
        assert mem.summary()["ooms"] == 1
    for step in range(3):
        torch.manual_seed(step)
        reference(**batch(step)).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    assert_same_state(training_state(model, opt), training_state(reference, opt_ref))


def test_bad_input_is_named():
    model = llama(layers=2, vocab=256)
    with pytest.raises(ValueError, match="non-empty list of modules"):
        OutOfMemoryInjector([])
    injector = OutOfMemoryInjector(model.model.layers)
    with pytest.raises(ValueError, match="one of 'forward', 'recompute', 'backward'"):
        injector.arm(0, "optimizer")
    with pytest.raises(ValueError, match="there are 2 blocks"):
        injector.arm(2)
    injector.arm(-1, "forward")
    assert injector.armed == (1, "forward")
    injector.remove()
    model(**batch(0)).loss.backward()  # the hooks are off: nothing fires
    assert injector.fired == 0


@pytest.mark.parametrize("policy", ["none", "checkpoint"])
def test_the_log_says_where_an_injected_error_ran_out_at_the_first_and_last_block(policy):
    """An error armed at a block's forward is raised inside the block, as a real one is, and one armed
    at its backward once that block's backward has begun: the log's `phase` says "forward" and
    "backward" at the first block and the last, with or without a recompute (armed at the first
    block's forward it read "before the first managed block"; at the last one's backward, "forward"
    under NONE and "the loss head" under CHECKPOINT)."""
    model = llama(layers=2, vocab=256)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    policy = (
        adaptmem.Policy(modes=("NONE",), head="kept")
        if policy == "none"
        else adaptmem.load_policy("every-2").model_copy(update={"every_k": 1, "head": "kept"})
    )
    places = [(0, "forward"), (1, "forward"), (0, "backward"), (1, "backward")]
    with dev, adaptmem.manage(model, device=dev, policy=policy) as mem:
        injector = OutOfMemoryInjector(model.model.layers)
        mem.run_step(lambda: model(**batch(0)).loss.backward())
        for step, (index, place) in enumerate(places, 1):
            injector.arm(index, place)
            mem.run_step(lambda step=step: model(**batch(step)).loss.backward())
            assert injector.fired == step and mem.last_step["attempt"] == 1
            assert mem.events.of_type("oom")[-1]["phase"] == place, (index, place)
