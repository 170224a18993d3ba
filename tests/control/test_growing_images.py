"""A Hugging Face ResNet trained at growing image sizes, as a new user would write the loop:
the stem before the first block is counted once, the plan a warning announces is the plan
that runs, and an out-of-memory error inside `with mem.step():` names `run_step` and leaves
the next step planned lower."""

from __future__ import annotations

import gc
import logging
import re

import pytest
import torch
from helpers import quiet_transformers

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.config.units import format_bytes
from adaptmem.control.retry import counts_text
from adaptmem.testing import SimulatedDevice

MiB = 2**20
QUIET = load_policy("balanced").model_copy(update={"sample_interval_s": 10.0})  # no pressure reading mid-step


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    quiet_transformers()
    torch.manual_seed(0)
    cfg = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2], layer_type="basic", num_labels=10
    )
    return ResNetForImageClassification(cfg)


def images(px: int, batch: int = 4) -> dict:
    gen = torch.Generator().manual_seed(px)
    return {
        "pixel_values": torch.randn(batch, 3, px, px, generator=gen),
        "labels": torch.randint(0, 10, (batch,), generator=gen),
    }


def train(mem, model, opt, px: int, *, retried: bool = False) -> dict:
    if retried:
        mem.run_step(lambda: model(**images(px)).loss.backward())
    else:
        with mem.step():
            model(**images(px)).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return mem.last_step


def test_the_stem_before_the_first_block_is_counted_once():
    """A ResNet's stem (convolution, norm, pooling at full resolution) runs before the first block:
    its activations are in what is allocated at the plan point. Learned from the step's start, the
    peak after the blocks counted them a second time, and every prediction was that much high."""
    model = resnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(2**30)
    dev.track(model, opt)
    with dev, adaptmem.manage(model, device=dev, policy=QUIET) as mem:
        for px in (32, 48, 64, 48, 64, 64):
            record = train(mem, model, opt, px)
    assert record["plan"] == ["NONE"] * len(record["plan"])
    error = abs(record["predicted_peak_bytes"] - record["observed_peak_bytes"]) / record["observed_peak_bytes"]
    assert error < 0.03, (record["predicted_peak_bytes"], record["observed_peak_bytes"])


ANNOUNCED = re.compile(r"Running (?:the tightest plan, |a retry's plan, )?(.*?), predicted at ([\d.]+ \w+)")


def test_the_plan_a_warning_announces_is_the_plan_the_step_runs(caplog):
    """Growing images on a device too small for the largest: each "no plan is predicted to fit"
    warning names the plan that runs and its predicted peak, as the step's record (or its
    out-of-memory record) has them."""
    model = resnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(16 * MiB)
    dev.track(model, opt)
    announced = []
    with (
        caplog.at_level(logging.WARNING, logger="adaptmem"),
        dev,
        adaptmem.manage(model, device=dev, policy=QUIET) as mem,
    ):
        for px in (32, 48, 64, 80, 96, 112, 128, 128):
            first = len(caplog.records)
            try:
                train(mem, model, opt, px)
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
            said = [m.groups() for r in caplog.records[first:] if (m := ANNOUNCED.search(r.getMessage()))]
            if said:
                announced.append((said[-1], mem.events.records[-1]))
    ran = [(said, record) for said, record in announced if record["type"] in ("step", "oom")]
    assert ran, "the device was meant to be too small for the largest images"
    for (plan, predicted), record in ran:
        assert plan.split("; head")[0] == counts_text(record["plan_counts"]), (plan, record)
        assert predicted == format_bytes(record["predicted_peak_bytes"]), (predicted, record)


def test_an_oom_inside_step_names_run_step_and_the_same_batch_next_runs_lower():
    model = resnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    capacity = 32 * MiB
    dev = SimulatedDevice(capacity)
    dev.track(model, opt)
    with dev, adaptmem.manage(model, device=dev, policy=QUIET) as mem:
        for px in (32, 48, 64, 64, 64):
            train(mem, model, opt, px)
        plain = mem.last_step
        assert plain["plan"] == ["NONE"] * len(mem.handles)
        # others take the device but for a little less than the step needs: the sampler is not
        # due, so the plan is made without knowing it, and the step runs out of memory
        floor = dev.allocated_bytes
        room = floor + 0.95 * (plain["observed_peak_bytes"] - floor)
        dev.occupy(int(capacity - room))
        with pytest.raises(torch.OutOfMemoryError) as err:
            train(mem, model, opt, 64)
        opt.zero_grad(set_to_none=True)
        assert "mem.run_step(fn" in str(err.value) + "".join(getattr(err.value, "__notes__", []))
        del err  # its traceback holds the failed forward's tensors (an `except ... as e:` block lets go of it)
        gc.collect()
        failed = mem.events.of_type("oom")[-1]
        again = train(mem, model, opt, 64)  # the same batch again: a plan predicted lower, and it fits
        assert again["type"] == "step" and again["plan"] != plain["plan"]
        assert again["predicted_peak_bytes"] < failed["predicted_peak_bytes"]
        other = train(mem, model, opt, 48)  # another batch after the failure: planned afresh, not refused
        assert other["type"] == "step"
        assert mem.summary()["ooms"] == 1
