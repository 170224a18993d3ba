"""The adaptive loop on a real GPU: CudaProbe readings, budgets kept, real OOMs survived exactly."""

import copy

import pytest
import torch
from helpers import hf_batch, llama

import adaptmem
from adaptmem import Mode
from adaptmem.devices.cuda import CudaProbe

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
    del x
    top, now = probe.take_peak()  # the peak with x, the allocation without it, from one reading
    assert top >= before + 64 * MiB and now == torch.cuda.memory_allocated() < top
    assert torch.cuda.max_memory_allocated() == now  # then the peak starts again from here
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
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


def test_real_cuda_ooms_are_recovered_with_exact_gradients(monkeypatch):
    """A per-process memory fraction the manager is not shown (as memory another process takes
    between two steps) makes the allocator refuse what the budget allows: real CUDA OOMs,
    which the retry must survive with the gradients of a clean step."""
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
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


def test_a_per_process_memory_fraction_is_the_device_the_budget_is_a_share_of():
    """Cut to 60% of NONE's peak, the manager's device is the cut: its default budget fits in it
    and the steps train with no out-of-memory error to retry."""
    model = cuda_llama()
    data = batch()
    none_peak = peak_of(model, Mode.NONE)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    try:
        torch.cuda.set_per_process_memory_fraction(0.6 * none_peak / total)
        with adaptmem.manage(model) as mem:
            assert mem.budget <= 0.6 * none_peak
            for _ in range(3):
                mem.run_step(lambda: model(**data).loss.backward())
                model.zero_grad(set_to_none=True)
            assert mem.summary()["ooms_recovered"] == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


class NormBlock(torch.nn.Module):
    """Linear, BatchNorm1d (running statistics: buffers a failed attempt changes), ReLU."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


def norm_mlp(dim=1024, depth=6):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[NormBlock(dim) for _ in range(depth)]).cuda()


def norm_step(model, x):
    model(x).square().mean().backward()


def test_a_steady_step_does_not_wait_for_the_device(monkeypatch):
    """A light step (plan held, shapes seen) queues its work and returns: no copy to pageable
    host memory, no host read of a device tensor (torch's sync debug mode raises on either),
    and no synchronize but at the end of a step measured block by block."""
    model = norm_mlp()
    x = torch.randn(4096, 1024, device="cuda")
    policy = adaptmem.load_policy("balanced").model_copy(update={"measure_every": 4, "modes": ("NONE", "CHECKPOINT")})
    with adaptmem.manage(model, budget="90%", policy=policy) as mem:
        for _ in range(8):  # calibration and the first plans
            mem.run_step(norm_step, model, x)
            model.zero_grad(set_to_none=True)
        waits = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append(1) or real(*a, **k))
        measured = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(12):
                before = len(waits)
                mem.run_step(norm_step, model, x)
                model.zero_grad(set_to_none=True)
                measured.append((mem.last_step["measured"], len(waits) - before))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum(how == "peak" for how, _ in measured) >= 6, measured
    assert all(n == (1 if how == "blocks" else 0) for how, n in measured), measured


def test_a_recovered_oom_puts_cuda_buffers_back_exactly():
    """The buffers' copies are queued to pinned host memory, not waited for; a retry waits for
    them and puts back the running statistics the failed attempt updated."""
    x = [torch.randn(512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(3)]

    def train(managed):
        model = norm_mlp()
        fire = {"armed": False}

        def inject(module, args):
            if fire["armed"]:
                fire["armed"] = False
                raise torch.OutOfMemoryError("injected out of memory in forward")

        model[3].register_forward_pre_hook(inject)
        mem = adaptmem.manage(model, budget="90%") if managed else None
        for i, batch in enumerate(x):
            fire["armed"] = managed and i == 1  # after blocks 0-2 updated their statistics
            if managed:
                mem.run_step(norm_step, model, batch)
            else:
                norm_step(model, batch)
        recovered = mem.summary()["ooms_recovered"] if managed else None
        if managed:
            mem.close()
        return model, recovered

    plain, _ = train(False)
    managed, recovered = train(True)
    assert recovered == 1
    for (name, a), b in zip(plain.named_buffers(), managed.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), managed.parameters()):
        assert torch.equal(a.grad, b.grad), name
