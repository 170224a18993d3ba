"""The adaptive loop on a real GPU: CudaProbe readings, budgets kept, real OOMs survived exactly."""

import copy

import pytest
import torch

import adaptmem
from adaptmem import Mode
from adaptmem.devices.cuda import CudaProbe

from helpers import hf_batch, llama

pytestmark = pytest.mark.cuda
MiB = 2**20


def cuda_llama():
    model = llama(layers=8, hidden=512)
    model.config._attn_implementation = "eager"  # deterministic backward, for exact comparisons
    return model.cuda()


def batch(seq=1024):
    return {k: v.cuda() for k, v in hf_batch(batch=2, seq=seq).items()}


def test_cuda_probe_reads_the_device():
    probe = CudaProbe()
    assert probe.capacity() == torch.cuda.get_device_properties(0).total_memory
    probe.reset_peak()
    before = probe.allocated()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert probe.allocated() - before >= 64 * MiB and probe.peak() >= probe.allocated()
    # the same counters torch.cuda's own functions read, from one call to the allocator
    assert (probe.allocated(), probe.peak()) == (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    assert probe.signals()["reserved"] == torch.cuda.memory_reserved()
    assert probe.external() >= 0
    assert {"alloc_retries", "reserved", "fragmented"} <= set(probe.signals())
    start = probe.mark()
    torch.cuda._sleep(1_000_000)
    end = probe.mark()
    probe.synchronize()
    assert probe.seconds(start, end) > 0
    del x


def peak_of(model, mode):
    adaptmem.restore(model)
    adaptmem.instrument(model, mode=mode)
    model.zero_grad(set_to_none=True)
    model(**batch()).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model(**batch()).loss.backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    adaptmem.restore(model)
    return torch.cuda.max_memory_allocated()


def test_budget_is_kept_on_cuda():
    """Checked twice: on the manager's own per-step peak, and on the allocator's reserved memory,
    which the manager does not reset and which also holds what the allocated figure can miss
    (blocks kept for side streams, fragmentation)."""
    model = cuda_llama()
    low, high = peak_of(model, Mode.CHECKPOINT), peak_of(model, Mode.NONE)
    budget = int(low + 0.5 * (high - low))
    peaks, reserved = [], []
    with adaptmem.manage(model, budget=budget) as mem:
        for i in range(6):
            with mem.step():
                model(**batch()).loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            # the manager resets CUDA's peak statistics at every block boundary, so
            # max_memory_allocated() covers only the last stretch: its per-step peak is the step's
            peaks.append(mem.last_step["observed_peak_bytes"])
            if i == 0:
                torch.cuda.empty_cache()  # the first step calibrates; from here on reserved only grows
            reserved.append(torch.cuda.memory_reserved())  # segments are kept: the high-water mark so far
        assert mem.probe.name.startswith("cuda:")
        assert mem.summary()["peak_bytes"] == max(peaks)
        assert mem.probe.signals()["alloc_retries"] == 0
    assert max(peaks[1:]) <= budget, [p / budget for p in peaks]
    assert max(reserved[1:]) <= 1.1 * budget, [r / budget for r in reserved]


def test_real_cuda_ooms_are_recovered_with_exact_gradients():
    """A per-process memory fraction makes the allocator refuse what the budget allows:
    real CUDA OOMs, which the retry must survive with the gradients of a clean step."""
    model = cuda_llama()
    data = batch()
    none_peak = peak_of(model, Mode.NONE)
    total = torch.cuda.get_device_properties(0).total_memory

    def train():
        model(**data).loss.backward()

    try:
        with adaptmem.manage(model, budget="90%") as mem:
            mem.run_step(train)  # the calibration step: every block checkpointed
            model.zero_grad(set_to_none=True)
            cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state_all()
            reference = copy.deepcopy(model)
            adaptmem.restore(reference)
            reference(**data).loss.backward()
            expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
            del reference
            torch.cuda.empty_cache()
            torch.set_rng_state(cpu_rng)
            torch.cuda.set_rng_state_all(cuda_rng)
            torch.cuda.set_per_process_memory_fraction(0.6 * none_peak / total)
            mem.run_step(train)  # planned for 90% of the card; the allocator allows far less
            assert mem.summary()["ooms_recovered"] >= 1
        assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
