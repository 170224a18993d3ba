"""A loop driven by Hugging Face Accelerate: the prepared model managed, `accelerator.backward`
inside `run_step`, accumulation through `accelerator.accumulate`, and bf16 mixed precision."""

import contextlib
import copy

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from helpers import assert_same_state, llama, training_state  # noqa: E402

import adaptmem  # noqa: E402
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice  # noqa: E402


def _reset() -> None:
    """Accelerate keeps its state per process: unset it, for an Accelerator made afresh."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    """Each test starts and leaves Accelerate's state unset."""
    _reset()
    yield
    _reset()


def batches(n: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for seq in (24, 40, 32, 48)[:n]:
        ids = torch.randint(0, 512, (2, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train(model, managed: bool, *, oom_at: int | None = None, mixed_precision: str = "no"):
    """Four micro-batches, two a step, under an Accelerator; with `oom_at`, one out-of-memory error
    in the backward of block 1 at that micro-batch. Returns (model, optimizer, the step records, the
    errors injected)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    records = []
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    policy = "long-context" if mixed_precision != "no" else adaptmem.load_policy().model_copy(update={"head": "kept"})
    injector = OutOfMemoryInjector(model.model.layers)
    torch.manual_seed(1)
    with dev, adaptmem.manage(model, device=dev, policy=policy) if managed else contextlib.nullcontext() as mem:
        for i, batch in enumerate(batches()):
            if i == oom_at:
                injector.arm(1, "backward")
            with accelerator.accumulate(model):
                if managed:
                    mem.run_step(lambda b=batch: accelerator.backward(model(**b).loss))
                else:
                    accelerator.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if managed:
                records.append(mem.last_step)
    injector.remove()
    return model, opt, records, injector.fired


def test_an_accelerate_loop_with_accumulation_and_a_retry_is_bit_exact(fresh_accelerate):
    model = llama(layers=2, hidden=64, dropout=0.0)
    twin = copy.deepcopy(model)
    reference, ref_opt, _, _ = train(twin, managed=False)
    expected = training_state(reference, ref_opt)
    _reset()
    managed, opt, records, fired = train(model, managed=True, oom_at=3)
    assert fired == 1 and records[3]["attempt"] == 1  # the second micro-batch of the second step, retried
    assert len(records) == 4 and records[2]["attempt"] == 0
    assert_same_state(training_state(managed, opt), expected)  # weights, buffers, RNG, AdamW's state


def test_under_bf16_mixed_precision_the_head_stays_chunked(fresh_accelerate):
    """Accelerate casts the prepared model's outputs with `.float()`, the chunked logits among them."""
    _, _, records, _ = train(llama(layers=2, hidden=64, dropout=0.0), managed=True, mixed_precision="bf16")
    assert len(records) == 4 and all(r["head"].startswith("CHUNKED:") for r in records), [r["head"] for r in records]
