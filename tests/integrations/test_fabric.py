"""A loop driven by Lightning Fabric: the model `fabric.setup` returns managed, `fabric.backward`
inside `run_step`, full precision and bf16 mixed precision."""

import contextlib
import copy

import pytest
import torch

lightning = pytest.importorskip("lightning")
from helpers import assert_same_state, llama, training_state  # noqa: E402

import adaptmem  # noqa: E402
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice  # noqa: E402


def batches() -> list[dict]:
    gen = torch.Generator().manual_seed(4)
    return [
        {"input_ids": (ids := torch.randint(0, 512, (2, seq), generator=gen)), "labels": ids.clone()}
        for seq in (24, 40, 32)
    ]


def train(model, managed: bool, *, oom_at: int | None = None, precision: str = "32-true"):
    """Three steps under Fabric; with `oom_at`, one out-of-memory error in the backward of block 1 at
    that step. Returns (model, optimizer, the step records, the errors injected)."""
    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    policy = "long-context" if precision != "32-true" else adaptmem.load_policy().model_copy(update={"head": "kept"})
    injector = OutOfMemoryInjector(model.model.layers)
    records = []
    torch.manual_seed(1)
    with dev, adaptmem.manage(model, device=dev, policy=policy) if managed else contextlib.nullcontext() as mem:
        for i, batch in enumerate(batches()):
            if i == oom_at:
                injector.arm(1, "backward")
            if managed:
                mem.run_step(lambda b=batch: fabric.backward(model(**b).loss))
                records.append(mem.last_step)
            else:
                fabric.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    injector.remove()
    return model, opt, records, injector.fired


def test_a_fabric_loop_with_a_retry_is_bit_exact():
    model = llama(layers=2, hidden=64, dropout=0.0)
    reference, ref_opt, _, _ = train(copy.deepcopy(model), managed=False)
    expected = training_state(reference, ref_opt)
    managed, opt, records, fired = train(model, managed=True, oom_at=1)
    assert fired == 1 and [r["attempt"] for r in records] == [0, 1, 0]
    assert_same_state(training_state(managed, opt), expected)  # weights, buffers, RNG, AdamW's state


def test_under_bf16_mixed_precision_the_head_stays_chunked():
    """Fabric's mixed precision asks `torch.is_floating_point` of each output, then casts it with
    `.to()`: the chunked logits answer the one and stay unmade through the other (the first made
    the head kept for good)."""
    _, _, records, _ = train(llama(layers=2, hidden=64, dropout=0.0), managed=True, precision="bf16-mixed")
    assert len(records) == 3 and all(r["head"].startswith("CHUNKED:") for r in records), [r["head"] for r in records]
