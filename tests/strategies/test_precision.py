"""Lossless modes stay bit-identical under bf16 and fp16 autocast (with a GradScaler, through
retries too), and with frozen embeddings and frozen base weights plus small trainable adapters
(LoRA-like)."""

import contextlib
import copy

import pytest
import torch
from helpers import (
    assert_same,
    assert_same_state,
    budget_between,
    cnn,
    hf_batch,
    image_batch,
    llama,
    step,
    tiny,
    tiny_batch,
    tiny_lora,
    training_state,
)

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice

MODES = [m for m in LOSSLESS_MODES if m is not Mode.NONE]


def autocast_step(model, batch, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return step(model, batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.label)
@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_autocast_keeps_lossless_modes_bit_identical(name, mode, dtype):
    make, make_batch = (tiny, tiny_batch) if name == "transformer" else (cnn, lambda m: image_batch())
    model = make()
    batch = make_batch(model)
    expected = autocast_step(model, batch, dtype)
    handles = adaptmem.instrument(model, mode=mode)
    assert_same(autocast_step(model, batch, dtype), expected)
    assert all(h.calls == 1 for h in handles)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.label)
def test_frozen_base_with_adapters_is_bit_identical(mode):
    model = tiny_lora()
    batch = tiny_batch(model)
    expected = step(model, batch)
    assert set(expected[1]) == {n for n, p in model.named_parameters() if p.requires_grad}  # adapters only
    handles = adaptmem.instrument(model, mode=mode)
    assert_same(step(model, batch), expected)
    if Mode.OFFLOAD in mode:
        assert all(h.host_bytes > 0 for h in handles)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_recorder_measures_frozen_and_autocast_steps(dtype):
    """The first block's input needs no gradient (frozen embeddings): the step is still cut
    at every block, predicted closely, and kept under a budget that needs managing."""
    make = lambda: tiny_lora(dim=128, n_layers=4)
    batch = tiny_batch(make(), batch=4, seq=128)

    def forward_backward(model):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(**batch).loss
        loss.backward()

    budget, _ = budget_between(make, batch, 0.5)
    model = make()
    truth, dev = SimulatedDevice(), SimulatedDevice(capacity_bytes=2**31)
    truth.track(model)
    dev.track(model)
    peaks, errors, measured = [], [], 0
    with truth, dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for _ in range(6):
            truth.reset_peak()
            with mem.step():
                forward_backward(model)
            model.zero_grad(set_to_none=True)
            peaks.append(truth.peak_bytes)
            errors.append(mem.last_step["prediction_error"])
            measured += mem.last_step["measured"] == "blocks"
        sample_blocks = mem.steps_learned
    assert sample_blocks == measured >= 3  # every step measured block by block was learned
    assert max(peaks[1:]) <= budget, [round(p / budget, 3) for p in peaks]
    assert -0.02 < errors[-1] < 0.10, errors  # close, and if off then on the safe side


def test_an_fp16_loop_with_a_grad_scaler_and_retries_is_bit_identical():
    """fp16 autocast with `torch.amp.GradScaler`: the scaled loss's backward inside the managed step,
    the scaler's step and update after it, as its documentation shows. A first scale at which some
    steps' gradients overflow (skipped, the scale backed off) and others grow it, and two steps that
    run out of memory and are retried: weights, gradients, AdamW's state, the RNG and the scaler's
    state end as in the same loop unmanaged."""

    def train(model, managed: bool):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        dev = SimulatedDevice(2**31)
        dev.track(model)
        kept = adaptmem.load_policy().model_copy(update={"head": "kept"})  # lossless: the head whole too
        manager = adaptmem.manage(model, device=dev, budget=None, policy=kept) if managed else None
        with dev, manager or contextlib.nullcontext():
            run = manager.run_step if managed else lambda fn: fn()  # unmanaged: the step as it is
            injector = OutOfMemoryInjector(model.model.layers) if managed else None
            for i, seq in enumerate((64, 96, 64, 128, 96, 64)):
                if injector is not None and i in (2, 4):
                    injector.arm(1, "backward" if i == 2 else "forward")
                torch.manual_seed(i)
                batch = hf_batch(2, seq, 512)

                def fn():
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = model(**batch).loss
                    scaler.scale(loss).backward()

                run(fn)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            if injector is not None:
                assert injector.fired == 2 and manager.summary()["ooms_recovered"] == 2
        return training_state(model, opt), scaler.state_dict()

    model = llama(layers=2, hidden=64, vocab=512)
    reference = copy.deepcopy(model)
    got, got_scaler = train(model, managed=True)
    expected, expected_scaler = train(reference, managed=False)
    assert_same_state(got, expected)
    assert got_scaler == expected_scaler
