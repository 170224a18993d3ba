"""All module state is exact in every lossless mode: parameters, gradients, buffers
(batch-norm running statistics and counters), RNG and optimizer state, after several steps."""

import pytest
import torch

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode

from helpers import assert_same_state, cnn, image_batch, mixed, mixed_batch, tiny, tiny_batch, training_state

MODELS = {
    "cnn": (cnn, lambda i: image_batch(seed=i)),
    "transformer": (tiny, lambda i: {**tiny_batch(tiny()), "input_ids": tiny_batch(tiny())["input_ids"].roll(i)}),
    "mixed": (mixed, lambda i: mixed_batch(seed=i)),
}


def train(model, make_batch, steps=3, install=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if install is not None:
        install(model)
    torch.manual_seed(5)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        model(**make_batch(i)).loss.backward()
        opt.step()
    return training_state(model, opt)


@pytest.fixture(scope="module")
def reference():
    return {name: train(make(), batch) for name, (make, batch) in MODELS.items()}


@pytest.mark.parametrize("mode", LOSSLESS_MODES, ids=lambda m: m.label)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_lossless_mode_leaves_the_whole_state_exact(reference, name, mode):
    make, make_batch = MODELS[name]
    handles = []

    def install(model):
        handles.extend(adaptmem.instrument(model, mode=mode))

    got = train(make(), make_batch, install=install)
    assert_same_state(got, reference[name])
    if mode.recomputes:
        assert all(h.recomputes == 3 for h in handles)  # the recompute ran, and did not update twice


def test_the_model_evaluates_the_same_after_training_under_checkpoint():
    """The symptom users see: running statistics updated twice change evaluation."""
    plain, managed = cnn(), cnn()
    adaptmem.instrument(managed, mode=Mode.CHECKPOINT)
    for model in (plain, managed):
        torch.manual_seed(5)
        model(**image_batch()).loss.backward()
        model.eval()
    batch = image_batch(seed=9)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, managed(**batch).logits)
