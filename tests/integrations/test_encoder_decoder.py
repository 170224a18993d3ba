"""An encoder-decoder from Hugging Face (T5 from a config, dropout on): blocks found in both
stacks, the first blocks' position bias passed on to the others, lengths changing from batch to
batch on both sides, and the whole training state equal to unmanaged training bit for bit."""

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from helpers import assert_same_state, quiet_transformers, training_state

import adaptmem
from adaptmem import Mode
from adaptmem.testing import SimulatedDevice, measure_peak

LENGTHS = [(48, 16), (96, 32), (32, 16), (96, 24), (64, 32), (48, 16)]  # (input, labels) per batch


def t5():
    quiet_transformers()
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.1,
            decoder_start_token_id=0,
            pad_token_id=0,
            use_cache=False,
        )
    )


def batch(source: int, target: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, 256, (2, source), generator=g),
        "labels": torch.randint(1, 256, (2, target), generator=g),
    }


def peak_with_adam(mode=None) -> int:
    """The peak of a second step on the longest batch, AdamW's state held (every block in `mode`)."""
    model = t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_peak(model, lambda: batch(96, 32, 0), mode=mode, optimizer=opt, steps=2)


def train(model, budget=None, capacity=None):
    """Steps over `LENGTHS` with AdamW, managed where there is a budget; returns the training
    state (the last step's gradients kept), each step's peak, and the manager's summary."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(capacity_bytes=capacity, link_bytes_per_s=2**30)
    dev.track(model)
    peaks, summary = [], None
    torch.manual_seed(1)
    managed = adaptmem.manage(model, budget=budget, device=dev) if budget else contextlib.nullcontext()
    with dev, managed as mem:
        for i, (source, target) in enumerate(LENGTHS):
            b = batch(source, target, i)
            dev.reset_peak()
            if mem is not None:
                mem.run_step(lambda: model(**b).loss.backward())
            else:
                model(**b).loss.backward()
            peaks.append(dev.peak_bytes)
            opt.step()
            if i < len(LENGTHS) - 1:
                opt.zero_grad(set_to_none=True)
        if mem is not None:
            summary = mem.summary()
            summary["modes_run"] = {m for e in mem.events.of_type("step") for m in e["plan"]}
            assert len(mem.handles) == 4  # two encoder and two decoder blocks
    return training_state(model, opt), peaks, summary


def test_a_t5_at_changing_lengths_trains_exactly_as_unmanaged_within_its_budget():
    low, high = peak_with_adam(Mode.CHECKPOINT), peak_with_adam()
    budget = int(low + 0.3 * (high - low))
    expected, _, _ = train(t5())
    got, peaks, summary = train(t5(), budget=budget, capacity=2 * high)
    assert_same_state(got, expected)
    assert summary["ooms"] == 0 and max(peaks[1:]) <= budget  # the first step calibrates
    assert summary["modes_run"] - {"NONE"}  # the longer batches need some blocks managed
