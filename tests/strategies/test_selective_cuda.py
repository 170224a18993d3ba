"""SELECTIVE on a GPU: CUDA's fused attention ops (flash under bf16, memory-efficient under fp32)
held in forward and answered in the recompute, their extra outputs (log-sum-exp, the dropout
generator's seed and offset, sizes) handed back as forward made them. Skipped without a GPU.

The model has as many key/value heads as heads: with grouped-query attention, fp32 SDPA on
CUDA runs the written-out math, which SELECTIVE recomputes as any other cheap op."""

import pytest
import torch
from helpers import hf_batch, llama
from torch.utils._python_dispatch import TorchDispatchMode

import adaptmem
from adaptmem import Mode
from adaptmem.strategies import selective

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


class AttentionOps(TorchDispatchMode):
    """The fused attention ops run (not their backward), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "scaled_dot_product" in name and "backward" not in name:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def run(model, batch):
    """(loss, gradients, attention ops of forward, attention ops run again in backward)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    with AttentionOps() as forward:
        loss = model(**batch).loss
    with AttentionOps() as backward:
        loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return loss.detach().float().cpu(), grads, forward.names, backward.names


def largest_difference(a, b) -> float:
    return max([(a[0] - b[0]).abs().item()] + [(a[1][n] - b[1][n]).abs().max().item() for n in a[1]])


@pytest.mark.usefixtures("every_layer_held")
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_attention_on_cuda_is_answered_without_dropout_and_exact_either_way(monkeypatch, dtype, dropout):
    """Equal to NONE bit for bit where NONE repeats itself bit for bit; where the attention
    kernel's backward does not (atomic adds), no further from NONE than NONE from itself.
    Without dropout backward runs no attention op (the attention answered, not run again); with
    it the attention is recomputed from forward's random numbers."""
    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.0)
    model = llama(layers=3, hidden=256, dropout=dropout, kv_heads=8).to(DEVICE, dtype)
    batch = {k: v.to(DEVICE) for k, v in hf_batch(batch=2, seq=256).items()}
    reference = run(model, batch)
    assert len(reference[2]) == 3 and not any("math" in n for n in reference[2]), reference[2]
    again = run(model, batch)
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    run(model, batch)  # the first step: what the recompute needs is learned
    got = run(model, batch)
    spread = largest_difference(again, reference)
    if spread == 0:
        assert torch.equal(got[0], reference[0])
        bad = [n for n in reference[1] if not torch.equal(got[1][n], reference[1][n])]
        assert not bad, f"{len(bad)} gradients differ, first {bad[:3]}"
    else:
        assert largest_difference(got, reference) <= 2 * spread
    assert got[2] == reference[2]
    assert got[3] == ([] if dropout == 0.0 else reference[2]), got[3]
