"""FSDP2 on a real GPU: one rank over NCCL (two ranks need two GPUs, as NCCL gives each rank
a device of its own). The allocator frees what FSDP2 frees, the lossless modes stay exact
against FSDP2 without adaptmem, and a managed run keeps its budget with its predictions within
10% of the peaks the allocator reports."""

import gc

import pytest
import torch
import torch.distributed as dist
from fsdp_worker import full, storages
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES
from adaptmem.config.policy import load_policy

pytestmark = pytest.mark.cuda
fsdp = pytest.importorskip("torch.distributed.fsdp")

ALIGN = 512  # the caching allocator's smallest block: every allocation is rounded up to it


@pytest.fixture
def nccl(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded(reshard=True):
    """Each block its own FSDP2 unit, resharded after forward or kept gathered; the root (the
    embeddings, the final norm and the head) kept gathered, as torchtitan shards a model: before
    torch 2.13 FSDP2 looked for the tensors to hook for backward's re-gather with
    ``tree_flatten``, which does not open the model's dataclass output, so a root resharded after
    forward met backward with its head's weight freed."""
    model = tiny(dim=256, vocab_size=4096).cuda()
    for block in model.blocks:
        fsdp.fully_shard(block, reshard_after_forward=reshard)
    fsdp.fully_shard(model, reshard_after_forward=False)
    return model


def batch(model, seq=256):
    return {k: v.cuda() for k, v in tiny_batch(model, seq=seq).items()}


def cuda_storages():
    """{data pointer: bytes, rounded as the allocator rounds them} of every CUDA storage Python
    reaches (a DTensor's in its local shard)."""
    reached = storages((o for o in gc.get_objects() if isinstance(o, torch.Tensor)), "cuda")
    return {ptr: -(-n // ALIGN) * ALIGN for ptr, n in reached.items()}


def test_the_allocator_holds_what_fsdp2_keeps_after_each_phase(nccl):
    """After backward and after AdamW's step, the bytes the allocator reports (what the manager's
    probe reads) are the bytes of the storages torch holds: FSDP2's freed gathers are freed."""
    warm = tiny(dim=256, vocab_size=4096).cuda()  # cuBLAS's workspaces, forward's and backward's thread's,
    warm(**batch(warm, 64)).loss.backward()  # come from the allocator and stay: held before `base`
    del warm
    torch.cuda.synchronize()
    gc.collect()
    base, before = torch.cuda.memory_allocated(), set(cuda_storages())
    model = sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seq in (192, 256):
        model(**batch(model, seq)).loss.backward()
        for phase in ("backward", "step"):
            if phase == "step":
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            gc.collect()
            held = sum(n for ptr, n in cuda_storages().items() if ptr not in before)
            allocated = torch.cuda.memory_allocated() - base
            assert abs(allocated - held) <= 0.01 * held, (seq, phase, allocated, held)


def test_every_lossless_mode_is_exact_under_fully_shard_on_a_gpu(nccl):
    """Dropout on: losses and full gradients of two steps bit-equal to FSDP2 without adaptmem."""

    def run(mode):
        model = sharded()
        if mode is not None:
            adaptmem.instrument(model, mode=mode)
        torch.manual_seed(3)
        out = []
        for seq in (192, 256):
            loss = model(**batch(model, seq)).loss
            loss.backward()
            out.append((loss.detach().clone(), {n: full(p.grad) for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out

    expected = run(None)
    for mode in LOSSLESS_MODES:
        for (loss, grads), (want_loss, want) in zip(run(mode), expected, strict=True):
            assert torch.equal(loss, want_loss), mode.label
            assert all(torch.equal(grads[n], want[n]) for n in want), mode.label


@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept gathered"])
def test_a_managed_run_keeps_its_budget_and_predicts_its_peaks_on_a_gpu(nccl, reshard):
    """A budget halfway between all-CHECKPOINT's and all-NONE's peak needs a mixed plan: from the
    fourth step on, no retry, every peak within the budget and predicted within 10%."""
    data = [512, 384, 448]

    def peak(mode):
        model = sharded(reshard)
        adaptmem.instrument(model, mode=mode)
        model(**batch(model, max(data))).loss.backward()
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(**batch(model, max(data))).loss.backward()
        torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated() - start
        del model
        gc.collect()
        return top

    low, high = peak(adaptmem.Mode.CHECKPOINT), peak(adaptmem.Mode.NONE)
    model = sharded(reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch(model, 64)).loss.backward()  # AdamW's state made before the budget is set
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    budget = torch.cuda.memory_allocated() + int(low + 0.5 * (high - low))
    policy = load_policy().model_copy(update={"modes": ("NONE", "CHECKPOINT")})
    records = []
    with adaptmem.manage(model, policy=policy, budget=budget) as mem:
        for i in range(12):
            ids = batch(model, data[i % len(data)])
            mem.run_step(lambda ids=ids: model(**ids).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(dict(mem.last_step))
    assert any(len(set(r["plan"])) > 1 for r in records)
    for i, r in enumerate(records[3:], 3):
        assert r["attempt"] == 0 and r["observed_peak_bytes"] <= r["budget_bytes"], (i, r)
        assert 0.90 <= r["predicted_peak_bytes"] / r["observed_peak_bytes"] <= 1.10, (i, r)
