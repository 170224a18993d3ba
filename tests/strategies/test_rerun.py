"""adaptmem's own non-reentrant checkpoint (`adaptmem.strategies.rerun`), against running the
function plainly and against PyTorch's checkpoint: the same gradients bit for bit, the same
memory, and a clear error where a rerun differs from forward."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointError
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from adaptmem.strategies import rerun
from adaptmem.testing import SimulatedDevice


class Block(nn.Module):
    """Norm, dropout, a gated MLP, a saved output (exp) and a buffer: what a block saves."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.gate = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
        h = F.dropout(self.norm(x), p=p, training=True)
        h = F.silu(self.gate(h)) * self.up(h)
        return x + self.down(h).exp().mul(self.scale) * mask


def run(blocks, x, mask, how, p=0.3):
    torch.manual_seed(7)
    for block in blocks:
        if how == "plain":
            x = block(x, mask, p)
        elif how == "torch":
            x = torch_checkpoint(block, x, mask, p, use_reentrant=False)
        else:
            x = rerun.checkpoint(block, x, mask, p)
    return x


def grads(blocks, x, how, **kwargs):
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    mask = torch.ones(x.shape[-1])
    out = run(blocks, x, mask, how, **kwargs)
    out.square().mean().backward()
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


@pytest.fixture
def blocks():
    torch.manual_seed(0)
    return [Block() for _ in range(3)]


def test_gradients_equal_the_plain_run_and_pytorchs_checkpoint_with_dropout(blocks):
    x = torch.randn(4, 16, 32)
    plain = grads(blocks, x, "plain")
    ours = grads(blocks, x, "rerun")
    theirs = grads(blocks, x, "torch")
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_autocast_of_forward_is_put_back_for_the_rerun(blocks):
    def bf16(how):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(blocks, x, torch.ones(32), how)
        out.float().square().mean().backward()  # backward, and so the rerun, outside autocast
        return [x.grad] + [p.grad for b in blocks for p in b.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(bf16("rerun"), bf16("plain")))


def test_a_second_backward_and_a_gradient_of_a_gradient_are_exact(blocks):
    def twice(how):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = run(blocks, x, torch.ones(32), how, p=0.0).square().mean()
        (gx,) = torch.autograd.grad(out, x, create_graph=True, retain_graph=True)
        out.backward(retain_graph=True)
        (out + gx.square().sum()).backward()
        return [p.grad for b in blocks for p in b.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(twice("rerun"), twice("plain")))


def test_the_rerun_stops_at_the_last_saved_tensor_and_its_tensors_go_once_used():
    ran = []

    def fn(x):
        y = x.sin()  # saves x
        ran.append(True)
        return y.detach() + 0 + y  # nothing saved after sin

    x = torch.randn(8, requires_grad=True)
    rerun.checkpoint(fn, x).sum().backward()
    assert ran == [True]  # the rerun stopped once sin's input was back, before the append
    assert torch.equal(x.grad, x.detach().cos())

    # Memory: 12 checkpointed layers hold their inputs only, and backward holds one layer's
    # recomputed tensors at a time (a leak of the rerun's graph held them all).
    torch.manual_seed(0)
    layers = [Block(64) for _ in range(12)]
    x = torch.randn(8, 64, 64)
    mask = torch.ones(64)
    peaks = {}
    for how in ("plain", "rerun"):
        for b in layers:
            b.zero_grad(set_to_none=True)
        with SimulatedDevice() as dev:
            out = run(layers, x.requires_grad_(), mask, how)
            out.sum().backward()
        peaks[how] = dev.peak_bytes
    assert peaks["rerun"] < 0.3 * peaks["plain"]


def test_a_saved_tensor_read_outside_backward_is_recomputed_each_time():
    x = torch.randn(8, requires_grad=True)
    y = rerun.checkpoint(lambda t: t.exp(), x)
    assert torch.equal(y.grad_fn._saved_result, x.detach().exp())
    assert torch.equal(y.grad_fn._saved_result, x.detach().exp())  # read again: another rerun
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_a_pack_hook_around_the_checkpoint_sees_the_inputs_and_nothing_inside(blocks):
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    x = torch.randn(2, 4, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = rerun.checkpoint(blocks[0], x, torch.ones(32), 0.0)
    assert seen == [x.shape, torch.Size([32])]  # the two tensor arguments, saved for the rerun
    out.sum().backward()
    assert x.grad is not None


def test_no_grad_runs_the_function_plainly(blocks):
    with torch.no_grad():
        out = rerun.checkpoint(blocks[0], torch.randn(2, 4, 32), torch.ones(32), 0.0)
    assert out.grad_fn is None


def test_a_rerun_that_saves_another_shape_is_refused_with_what_differed():
    calls = []

    def changing(x):
        calls.append(1)
        return (x[: 4 if len(calls) == 1 else 3]).sin().sum()

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"shape \(3,\) and torch.float32 where forward saved \(4,\)"):
        rerun.checkpoint(changing, x).backward()


def test_a_rerun_that_saves_fewer_tensors_is_refused():
    calls = []

    def shrinking(x):
        calls.append(1)
        y = x.sin()
        return y.cos() if len(calls) == 1 else y.detach().cos()

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(CheckpointError, match="fewer tensors for backward in its recompute than in forward"):
        rerun.checkpoint(shrinking, x).sum().backward()


def test_a_block_that_checkpoints_part_of_itself_with_pytorchs_checkpoint_is_exact(blocks):
    """User code inside a block may run `torch.utils.checkpoint` itself: the inner checkpoint's
    inputs are saved through the outer's holders, and both reruns give the plain gradients."""

    class Outer(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x, mask, p):
            h = x.tanh()
            h = torch_checkpoint(self.inner, h, mask, p, use_reentrant=False)
            return h.sigmoid() * x

    outer = [Outer(b) for b in blocks]
    x = torch.randn(2, 8, 32)
    assert all(torch.equal(a, b) for a, b in zip(grads(outer, x, "rerun"), grads(outer, x, "plain")))


def test_a_gradient_taken_inside_the_checkpointed_forward_is_exact():
    """A block that differentiates inside its forward (a penalty on its own input gradient) reads
    holders before forward ends: they are filled from a rerun up to there, and backward reruns it whole."""

    def f(x):
        y = x.sin() * x
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return (g * y).exp()

    def grad_of(how):
        x = torch.randn(5, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = f(x) if how == "plain" else rerun.checkpoint(f, x)
        out.sum().backward()
        return x.grad

    assert torch.equal(grad_of("rerun"), grad_of("plain"))
