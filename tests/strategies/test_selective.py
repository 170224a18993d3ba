"""SELECTIVE by structure: weight layers' outputs held in forward and answered in the recompute,
bit for bit as NONE, with no weight op of forward run again, the rest recomputed."""

import pytest
import torch
from helpers import assert_same, cnn, gpt2, hf_batch, image_batch, llama, mixed, mixed_batch, step, tiny, tiny_batch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import adaptmem
from adaptmem import Mode
from adaptmem.strategies import selective
from adaptmem.testing import SimulatedDevice

MODELS = {
    "tiny-sdpa": (lambda: tiny(attention="sdpa"), lambda m: tiny_batch(m, seq=48)),
    "tiny-eager": (lambda: tiny(attention="eager"), lambda m: tiny_batch(m, seq=48)),
    "hf-llama": (lambda: llama(layers=3), lambda m: hf_batch(seq=64)),
    "hf-gpt2": (lambda: gpt2(layers=3), lambda m: hf_batch(seq=64)),  # Conv1D: addmm with its bias
    "cnn": (cnn, lambda m: image_batch()),  # convolutions, batch norm in the recompute
    "mixed": (mixed, lambda m: mixed_batch()),  # BatchNorm1d over a linear layer's transposed output
}


@pytest.mark.usefixtures("every_layer_held")
@pytest.mark.parametrize("name", list(MODELS))
def test_every_weight_layer_held_equals_none_for_two_steps(name):
    make, make_batch = MODELS[name]
    model = make()
    batch = make_batch(model)
    reference = step(model, batch)
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    assert_same(step(model, batch), reference)  # the first step: the last layer call presumed unneeded
    assert_same(step(model, batch), reference)  # the second: what the first recompute taught


class MLPBlock(nn.Module):
    def __init__(self, width: int, inplace: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        if self.inplace:
            h.mul_(0.5)  # changes the up projection's output after forward
        return x + self.down(torch.nn.functional.gelu(h))


class MLPNet(nn.Module):
    def __init__(self, width: int = 256, depth: int = 3, inplace: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(MLPBlock(width, inplace) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_the_recompute_runs_no_weight_op_of_forward():
    """Width 256: every linear layer above the threshold. Backward's matmul FLOPs are NONE's:
    the held up projection is answered, and the early stop ends the recompute before the down
    projection; CHECKPOINT's recompute runs the up projection again."""
    model, x = MLPNet(), torch.randn(4, 64, 256)
    handles = adaptmem.instrument(model, mode=Mode.NONE)
    none = backward_flops(model, x)
    flops = {}
    for mode in (Mode.SELECTIVE, Mode.CHECKPOINT):
        for h in handles:
            h.mode = mode
        flops[mode] = [backward_flops(model, x) for _ in range(2)]
    up = 2 * (4 * 64) * 256 * 1024  # one up projection's matmul: B*S rows, 256 in, 1024 out
    assert flops[Mode.SELECTIVE] == [none, none]
    assert flops[Mode.CHECKPOINT] == [none + 3 * up] * 2  # its early stop, too, comes before the down projection


def test_selective_saves_about_half_of_none_and_more_than_checkpoint():
    """What the blocks hold from forward to backward (the first block's input is the caller's):
    CHECKPOINT the other two blocks' inputs; SELECTIVE those and each up projection's output
    (4 widths); NONE the norm's output, the up projection's and the activation's besides."""
    model, x = MLPNet(), torch.randn(4, 64, 256)
    handles = adaptmem.instrument(model, mode=Mode.NONE)
    held = {}
    for mode in (Mode.NONE, Mode.SELECTIVE, Mode.CHECKPOINT):
        for h in handles:
            h.mode = mode
        model(x).sum().backward()  # SELECTIVE's first step teaches what the recompute needs
        with SimulatedDevice() as dev:
            dev.track(model, x)
            before = dev.allocated_bytes
            out = model(x)
            held[mode] = dev.allocated_bytes - before - out.numel() * 4
            out.sum().backward()
    width = 4 * 64 * 256 * 4  # bytes of one block input
    assert held[Mode.CHECKPOINT] == 2 * width
    assert held[Mode.SELECTIVE] == 2 * width + 3 * 4 * width
    assert held[Mode.NONE] >= 2 * width + 3 * (width + 2 * 4 * width)


def test_an_output_changed_in_place_is_not_used_and_not_held_again():
    model, x = MLPNet(inplace=True), torch.randn(4, 64, 256)
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    handles = adaptmem.instrument(model, mode=Mode.SELECTIVE)
    for _ in range(2):
        got = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(selective.block_layers(b).spoiled == {b.up} for b in model.blocks)
    assert all(h.recomputes == 2 for h in handles)


def test_weight_layers_below_the_threshold_are_recomputed():
    assert selective.flops_per_element(nn.Linear(256, 8)) == 512
    assert selective.keeps_output(nn.Linear(256, 8)) and not selective.keeps_output(nn.Linear(8, 256))
    depthwise = nn.Conv2d(64, 64, 7, padding=3, groups=64)
    assert selective.flops_per_element(depthwise) == 2 * 49 and not selective.keeps_output(depthwise)
    assert selective.keeps_output(nn.Conv2d(64, 64, 3))  # 2 * 9 * 64
    assert selective.flops_per_element(nn.ConvTranspose2d(256, 8, 4, stride=2)) == 2 * 256 * 16 // 4
    assert selective.flops_per_element(nn.modules.linear.NonDynamicallyQuantizableLinear(300, 3)) == 600

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x).relu()

    assert selective.flops_per_element(OwnForward(300, 3)) is None  # other ops than the one matmul
    assert selective.flops_per_element(nn.LayerNorm(300)) is None


@pytest.mark.usefixtures("every_layer_held")
def test_a_linear_layer_whose_bias_is_added_after_its_matmul_is_recomputed_exactly():
    """A non-contiguous input to a linear layer with a bias: PyTorch multiplies, then adds the
    bias in place; the held output is the sum, not the product, so the layer runs."""

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(x.transpose(0, 1)).transpose(0, 1).tanh()

    torch.manual_seed(0)
    model = nn.Sequential(Transposed(), Transposed())
    x = torch.randn(8, 4, 16, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    adaptmem.instrument(model, blocks=list(model), mode=Mode.SELECTIVE)
    for _ in range(2):
        got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_forward_set_on_a_layer_instance_is_kept():
    model, x = MLPNet(depth=2), torch.randn(2, 8, 256)
    layer = model.blocks[0].up
    calls = []
    own = layer.forward

    def counted(*args):
        calls.append(1)
        return own(*args)

    layer.forward = counted
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    model(x).sum().backward()
    assert layer.forward is counted and len(calls) == 2  # forward, and the recompute's answered run


def flops_of_backward(model, batch) -> int:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    loss = model(**batch).loss
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.usefixtures("every_layer_held")
def test_fused_attention_is_held_and_answered_unless_it_draws_dropout(monkeypatch):
    """With nothing left to the recompute, backward's FLOPs (matmuls and attention) are NONE's:
    the fused attention of forward is answered, not run again; with dropout in attention it is
    recomputed, so that the recompute draws forward's random numbers, and stays exact."""
    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dropout, answered in ((0.0, True), (0.1, False)):
        model = tiny(attention="sdpa", dropout=dropout)
        batch = tiny_batch(model, seq=48)
        reference = step(model, batch)
        none = flops_of_backward(model, batch)
        adaptmem.instrument(model, mode=Mode.SELECTIVE)
        step(model, batch)  # the first step: what the recompute needs is learned
        assert_same(step(model, batch), reference)
        assert (flops_of_backward(model, batch) == none) is answered
        assert torch.nn.functional.scaled_dot_product_attention is sdpa  # put back after each run


def test_the_recompute_share_leaves_the_cheapest_bytes_to_the_recompute(monkeypatch):
    """Held: q, k, v, o (1, 0.5, 0.5, 1 widths at 2 * width FLOPs an element) and attention
    (4 * seq FLOPs an element). A share of 0.15 of their FLOPs leaves the largest of the cheapest
    per byte to the recompute: the query and key projections (the output projection would pass it).
    The default share, none, leaves every held output held."""
    by_default = selective.BlockLayers()
    width, seq = 512, 512
    held = {
        ("q", 0): (width, 2 * width),
        ("k", 0): (width // 2, 2 * width),
        ("v", 0): (width // 2, 2 * width),
        ("attention", 0): (width, 4 * seq),
        ("o", 0): (width, 2 * width),
        ("gate", 0): (1376, 2 * width),
        ("up", 0): (1376, 2 * width),
        ("down", 0): (width, 2 * 1376),
    }
    by_default.choose({k: _held(elements, flops) for k, (elements, flops) in held.items()})
    assert by_default.unneeded == {("down", 0)} and by_default.dropped == set()
    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.15)
    known = selective.BlockLayers()
    known.choose({k: _held(elements, flops) for k, (elements, flops) in held.items()})
    assert known.unneeded == {("down", 0)}
    assert known.dropped == {("q", 0), ("k", 0)}


def _held(elements: int, flops_per_element: int) -> "selective.Held":
    return selective.Held((torch.empty(elements),), elements * flops_per_element)


_THREADS = """
import torch
from concurrent.futures import ThreadPoolExecutor
from helpers import step, tiny, tiny_batch
import adaptmem
from adaptmem import Mode
from adaptmem.strategies import selective

selective.MIN_FLOPS_PER_ELEMENT, selective.RECOMPUTE_SHARE = 0, 0.0
sdpa = torch.nn.functional.scaled_dot_product_attention
models = [tiny(attention="sdpa", dropout=0.0, dim=64 + 32 * i) for i in range(2)]
batches = [tiny_batch(m, seq=48) for m in models]
references = [[step(m, b) for _ in range(3)] for m, b in zip(models, batches)]
for m in models:
    adaptmem.instrument(m, mode=Mode.SELECTIVE)


def train(i):
    return [step(models[i], batches[i]) for _ in range(3)]


with ThreadPoolExecutor(2) as pool:
    results = list(pool.map(train, range(2)))
for got, expected in zip(results, references):
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
assert torch.nn.functional.scaled_dot_product_attention is sdpa
print("exact")
"""


def test_blocks_in_two_threads_at_once_each_hold_their_own_attention():
    """As `nn.DataParallel` runs replicas: two models in SELECTIVE stepping at the same time in two
    threads, each exact, and the attention function put back once both are done. In a process of its
    own: dispatch modes entered in worker threads leave torch.compile recompiling later code."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "exact", done.stderr[-2000:]


class Counted:
    """Counts SELECTIVE's two ways of answering a held layer in the recompute."""

    def __init__(self, monkeypatch) -> None:
        self.dispatched = self.given = 0
        answer, give = selective._AnswerLayer.__init__, selective.Recipe.give

        def counted_answer(mode, *args):
            self.dispatched += 1
            answer(mode, *args)

        def counted_give(recipe, frame, args):
            given = give(recipe, frame, args)
            self.given += given
            return given

        monkeypatch.setattr(selective._AnswerLayer, "__init__", counted_answer)
        monkeypatch.setattr(selective.Recipe, "give", counted_give)


def test_a_held_linear_layer_is_answered_without_running_it_or_any_op_in_python(monkeypatch):
    """Its saved tensors (views of its input and weight) are handed to the checkpoint as forward
    laid them out, and its output is the held one: no dispatch mode, no op of the layer, in the
    recompute; gradients are NONE's."""
    counted = Counted(monkeypatch)
    model, batch = llama(layers=2, hidden=256), hf_batch(seq=64)
    reference = step(model, batch)
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    for _ in range(2):
        assert_same(step(model, batch), reference)
    assert counted.given >= 2 * 2 * 4 and counted.dispatched == 0  # 2 steps x 2 blocks x q, k, v, o at least


def test_a_layer_whose_saves_are_not_views_of_its_input_and_weights_is_answered_by_dispatch(monkeypatch):
    """Under autocast a linear layer saves its weight cast to bf16, a tensor of its own: the layer
    runs in the recompute with its matmul answered, and gradients stay NONE's."""
    counted = Counted(monkeypatch)
    model, x = MLPNet(depth=2), torch.randn(2, 16, 256)

    def grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads()
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads(), expected))
    assert counted.given == 0 and counted.dispatched >= 2


def test_a_layer_inside_a_checkpoint_of_pytorchs_within_the_block_is_answered_by_dispatch(monkeypatch):
    """A block that checkpoints part of itself with `torch.utils.checkpoint`: the layers inside save
    to PyTorch's holders, not SELECTIVE's checkpoint, so no recipe is taken from them."""
    from torch.utils.checkpoint import checkpoint

    class Inner(MLPBlock):
        def forward(self, x):
            return checkpoint(super().forward, x, use_reentrant=False)

    torch.manual_seed(0)
    model, x = nn.Sequential(Inner(256), Inner(256)), torch.randn(2, 16, 256, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    counted = Counted(monkeypatch)
    adaptmem.instrument(model, blocks=list(model), mode=Mode.SELECTIVE)
    for _ in range(2):
        got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert counted.given == 0


@pytest.mark.usefixtures("every_layer_held")
def test_fused_attention_is_held_and_answered_with_no_dispatch_mode(monkeypatch):
    """What fused attention saves (its queries, keys and values, its output, its log-sum-exp) is
    noted in forward and handed to the checkpoint in the recompute: no dispatch mode runs, either
    way, and backward's FLOPs and gradients are NONE's."""
    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.0)
    modes = []
    for name in ("_Capture", "_AnswerAttention", "_AnswerLayer"):
        cls = getattr(selective, name)
        monkeypatch.setattr(cls, "__enter__", lambda self, cls=cls: modes.append(cls) or cls.__mro__[1].__enter__(self))
    model = tiny(attention="sdpa", dropout=0.0)
    batch = tiny_batch(model, seq=48)
    reference = step(model, batch)
    none = flops_of_backward(model, batch)
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    for _ in range(2):
        assert_same(step(model, batch), reference)
    assert flops_of_backward(model, batch) == none and modes == []


@pytest.mark.usefixtures("every_layer_held")
def test_attention_whose_saves_no_recipe_rebuilds_is_held_through_a_dispatch_mode(monkeypatch):
    """Written-out math (a backend chosen around forward and backward) saves seq x seq scores, no
    view of its inputs or output: the block's attention goes to the dispatch mode for good, which
    holds nothing of the math, and gradients stay NONE's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.0)
    model = tiny(attention="sdpa", dropout=0.0)
    batch = tiny_batch(model, seq=48)
    with sdpa_kernel(SDPBackend.MATH):
        reference = step(model, batch)
        adaptmem.instrument(model, mode=Mode.SELECTIVE)
        for _ in range(2):
            assert_same(step(model, batch), reference)
    assert all(selective.block_layers(b).attention_by_dispatch for b in model.blocks)


class GatedAttention(nn.Module):
    """Attention whose output is multiplied by a gate before its projection: that product saves
    the gate only if the attention output needs a gradient, so the recompute's answered output
    must need one too, as forward's did."""

    def __init__(self, width: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.gate, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, w)
        return x + self.out(a * torch.sigmoid(self.gate(x)))


def test_an_answered_attention_output_needs_a_gradient_as_forwards_did(monkeypatch):
    monkeypatch.setattr(selective, "RECOMPUTE_SHARE", 0.0)
    torch.manual_seed(0)
    model, x = nn.Sequential(GatedAttention(), GatedAttention()), torch.randn(2, 32, 256, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().mean(), [x, *model.parameters()])
    adaptmem.instrument(model, blocks=list(model), mode=Mode.SELECTIVE)
    for _ in range(2):
        got = torch.autograd.grad(model(x).square().mean(), [x, *model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(not selective.block_layers(b).attention_by_dispatch for b in model)
