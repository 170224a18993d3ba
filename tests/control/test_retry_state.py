"""A recovered out-of-memory error leaves the whole training state exact: parameters,
gradients, buffers (batch-norm statistics), RNG and optimizer state, whether the error
comes in forward, in a recompute or in backward, and also inside an accumulation window."""

import pytest
import torch

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice

from helpers import assert_same_state, cnn, image_batch, mixed, mixed_batch, training_state

MODELS = {
    "cnn": (cnn, image_batch, lambda m: m.stages, lambda block: block.body[0]),
    "mixed": (mixed, mixed_batch, lambda m: m.blocks, lambda block: block.up),
}


class Injector:
    """Raises one out-of-memory error at a chosen place, on the first attempt of one micro-batch."""

    def __init__(self, block: torch.nn.Module, inner: torch.nn.Module, where: str) -> None:
        self.where, self.armed, self.fired = where, False, 0
        inner.register_forward_pre_hook(self.pre_hook)
        block.register_forward_hook(self.output_hook)

    def _fire(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise torch.OutOfMemoryError(f"injected out of memory in {self.where}")

    def pre_hook(self, module, args):
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute runs inside backward
        if (self.where == "forward" and not in_backward) or (self.where == "recompute" and in_backward):
            self._fire()

    def output_hook(self, module, args, output):
        if self.where == "backward" and output.requires_grad:
            output.register_hook(lambda grad: self._fire())


def run(make, make_batch, *, managed: bool, where: str | None = None):
    """Three optimizer steps; the second accumulates two micro-batches, and its second
    micro-batch runs out of memory once at `where` (every second block is checkpointed)."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    micro = [[make_batch(seed=1)], [make_batch(seed=2), make_batch(seed=3)], [make_batch(seed=4)]]
    injector = None
    if managed:
        blocks, inner = MODELS_BY_MAKE[make]
        injector = Injector(blocks(model)[1], inner(blocks(model)[1]), where)
        policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0})
        mem = adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31))
    torch.manual_seed(11)
    for s, batches in enumerate(micro):
        for m, batch in enumerate(batches):
            if managed:
                injector.armed = (s, m) == (1, 1)
                mem.run_step(lambda b=batch: model(**b).loss.backward())
            else:
                model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if managed:
        summary = mem.summary()
        mem.close()
        assert injector.fired == 1 and summary["ooms_recovered"] == 1, summary
    return training_state(model, opt)


MODELS_BY_MAKE = {make: (blocks, inner) for make, _, blocks, inner in MODELS.values()}


@pytest.mark.parametrize("where", ["forward", "recompute", "backward"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_recovered_oom_leaves_the_whole_state_exact(name, where):
    make, make_batch, _, _ = MODELS[name]
    expected = run(make, make_batch, managed=False)
    assert_same_state(run(make, make_batch, managed=True, where=where), expected)
