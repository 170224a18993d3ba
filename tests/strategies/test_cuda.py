"""CUDA paths: side streams, events, pinned pool, record_stream, prefetch. Skipped without a GPU."""

import pytest
import torch
from helpers import assert_same, hf_batch, llama, min_cosine, tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES, CompressOptions, Mode, OffloadOptions
from adaptmem.strategies.cuda_offload import CudaTier
from adaptmem.wrapping import get_instrumentation

pytestmark = pytest.mark.cuda


def cuda_step(model, batch, seed=2):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("mode", [m for m in LOSSLESS_MODES if m is not Mode.NONE], ids=lambda m: m.label)
def test_lossless_modes_on_cuda_equal_none(mode, prefetch):
    model = llama(layers=4, hidden=256).cuda()
    batch = hf_batch(batch=2, seq=256)
    reference = cuda_step(model, batch)
    adaptmem.instrument(model, mode=mode, offload=OffloadOptions(prefetch=prefetch))
    assert_same(cuda_step(model, batch), reference)


def test_pinned_buffers_are_reused_across_steps():
    model = tiny(dim=256, n_layers=4).cuda()
    batch = tiny_batch(model, batch=4, seq=256)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    pool = get_instrumentation(model).runtime.offload.pool
    cuda_step(model, batch)
    allocated = pool.allocations
    for _ in range(3):
        cuda_step(model, batch)
    assert pool.allocations == allocated
    assert pool.reuses > 0
    assert pool.in_use_bytes == 0  # every payload gave its buffer back


def test_prefetch_starts_the_previous_block_before_it_is_needed(monkeypatch):
    model = tiny(dim=256, n_layers=4).cuda()
    batch = tiny_batch(model, batch=4, seq=256)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    events = []
    fetch, finish = CudaTier.fetch, CudaTier.finish
    monkeypatch.setattr(CudaTier, "fetch", lambda self, c: (events.append(("fetch", id(c))), fetch(self, c))[1])
    monkeypatch.setattr(
        CudaTier, "finish", lambda self, c, f: (events.append(("finish", id(c))), finish(self, c, f))[1]
    )
    cuda_step(model, batch)
    finished = [e[1] for e in events if e[0] == "finish"]

    def ahead(c):  # its copy back began before another copy's use: while another block's backward ran
        start, end = events.index(("fetch", c)), events.index(("finish", c))
        return any(kind == "finish" for kind, _ in events[start + 1 : end])

    assert sum(map(ahead, finished)) >= len(finished) // 2  # all but the last block's were prefetched


def test_cuda_peak_per_mode():
    model = llama(layers=8, hidden=512).cuda()
    batch = hf_batch(batch=2, seq=1024)
    handles = adaptmem.instrument(model)
    peaks = {}
    for mode in (Mode.NONE, Mode.CHECKPOINT, Mode.OFFLOAD, Mode.COMPRESS):
        for h in handles:
            h.mode = mode
        cuda_step(model, batch)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cuda_step(model, batch)
        peaks[mode] = torch.cuda.max_memory_allocated() - base
    assert peaks[Mode.CHECKPOINT] < 0.5 * peaks[Mode.NONE]
    assert peaks[Mode.OFFLOAD] < 0.6 * peaks[Mode.NONE]
    assert peaks[Mode.COMPRESS] < 0.7 * peaks[Mode.NONE]


def test_compress_under_bf16_autocast_on_cuda():
    model = llama(layers=3, hidden=256).cuda()
    batch = hf_batch(seq=256)

    def run():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        return {n: p.grad.float().cpu() for n, p in model.named_parameters()}

    exact = run()
    adaptmem.instrument(model, mode=Mode.COMPRESS | Mode.OFFLOAD, compress=CompressOptions(min_bytes=0))
    assert min_cosine(run(), exact) >= 0.99
