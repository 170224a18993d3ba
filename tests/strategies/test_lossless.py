"""Lossless modes give the loss and every gradient of NONE, bit for bit (dropout on)."""

import itertools

import pytest
import torch
from helpers import assert_same, gpt2, hf_batch, llama, step, tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode

RECOMPUTED_OR_MOVED = [m for m in LOSSLESS_MODES if m is not Mode.NONE]

MODELS = {
    "tiny-sdpa": (lambda: tiny(attention="sdpa"), lambda m: tiny_batch(m, seq=48)),
    "tiny-eager": (lambda: tiny(attention="eager"), lambda m: tiny_batch(m, seq=48)),
    "hf-llama": (lambda: llama(layers=3), lambda m: hf_batch(seq=64)),
    "hf-gpt2": (lambda: gpt2(layers=3), lambda m: hf_batch(seq=64)),
}


@pytest.mark.parametrize("mode", RECOMPUTED_OR_MOVED, ids=lambda m: m.label)
@pytest.mark.parametrize("name", list(MODELS))
def test_lossless_mode_equals_none(name, mode):
    make, make_batch = MODELS[name]
    model = make()
    batch = make_batch(model)
    reference = step(model, batch)
    handles = adaptmem.instrument(model, mode=mode)
    assert_same(step(model, batch), reference)
    assert_mode_ran(handles, mode)


def assert_mode_ran(handles, mode):
    """Equal gradients prove nothing if the mode did not run: each block's counters show it did."""
    for h in handles:
        assert h.calls == 1, h
        assert h.recomputes == (1 if mode.recomputes else 0), (h, h.recomputes)
        if Mode.OFFLOAD in mode:
            assert h.host_bytes > 0, h
        else:
            assert h.host_bytes == 0, h
        if mode in (Mode.OFFLOAD, Mode.CHECKPOINT | Mode.OFFLOAD):
            assert h.packed_bytes > 0, h


def test_mixed_modes_across_blocks_equal_none():
    model = llama(layers=5)
    batch = hf_batch(seq=64)
    reference = step(model, batch)
    handles = adaptmem.instrument(model)
    for handle, mode in zip(handles, RECOMPUTED_OR_MOVED + [Mode.NONE]):
        handle.mode = mode
    assert_same(step(model, batch), reference)
    for handle, mode in zip(handles, RECOMPUTED_OR_MOVED + [Mode.NONE]):
        assert_mode_ran([handle], mode)


def _train(model, batches, on_step=None, install=None, steps=3):
    """Adam steps over fixed batches; returns the parameters at the end."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if install is not None:
        install(model)
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        step(model, batches[i % len(batches)], seed=10 + i)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def never_switched():
    model = tiny()
    batches = [tiny_batch(model, seq=24 + 8 * i) for i in range(3)]
    return batches, _train(model, batches)


PAIRS = list(itertools.permutations(LOSSLESS_MODES, 2))


@pytest.mark.parametrize("a,b", PAIRS, ids=lambda m: m.label)
def test_switching_between_steps_is_exact(never_switched, a, b):
    batches, expected = never_switched
    model = tiny()
    handles = adaptmem.instrument(model, mode=a)

    def flip(i):
        for h in handles:
            h.mode = (a, b)[i % 2]

    got = _train(model, batches, on_step=flip)
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


@pytest.mark.parametrize("a,b", PAIRS, ids=lambda m: m.label)
def test_switching_in_the_middle_of_a_forward_is_exact(never_switched, a, b):
    """Blocks 0-1 run under `a`; at block 2's forward every block flips to `b`
    (blocks 0-1 then backward under a mode other than the one they packed with)."""
    batches, expected = never_switched
    model = tiny()
    handles = adaptmem.instrument(model, mode=a)
    seen = []

    def flip_all(module, args):
        seen.append([h.mode for h in handles])
        for h in handles:
            h.mode = b

    model.blocks[2].register_forward_pre_hook(flip_all)

    def reset(i):
        for h in handles:
            h.mode = a

    got = _train(model, batches, on_step=reset)
    assert seen == [[a] * 4] * 3
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


@pytest.mark.parametrize("make", [lambda: llama(layers=4), lambda: gpt2(layers=4)], ids=["hf-llama", "hf-gpt2"])
def test_hf_switching_mid_forward_round_robin(make):
    """Every block goes round the lossless modes, shifted per block and per step."""
    batch = hf_batch(seq=48)
    expected = _train(make(), [batch])
    model = make()
    handles = adaptmem.instrument(model)
    modes = list(LOSSLESS_MODES)

    forwards = itertools.count(1)

    def rotate(module, args):
        n = next(forwards)
        for k, h in enumerate(handles):
            h.mode = modes[(n + k) % len(modes)]

    for h in handles:
        h.module.register_forward_pre_hook(rotate)
    got = _train(model, [batch])
    assert all(torch.equal(x, y) for x, y in zip(got, expected))
