"""All module state is exact in every lossless mode: parameters, gradients, buffers
(batch-norm running statistics and counters), RNG and optimizer state, after several steps."""

import pytest
import torch
from helpers import assert_same_state, cnn, image_batch, mixed, mixed_batch, tiny, tiny_batch, training_state

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode

MODELS = {
    "cnn": (cnn, lambda i: image_batch(seed=i)),
    "transformer": (tiny, lambda i: {**tiny_batch(tiny()), "input_ids": tiny_batch(tiny())["input_ids"].roll(i)}),
    "mixed": (mixed, lambda i: mixed_batch(seed=i)),
}


def train(model, make_batch, steps=3, install=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if install is not None:
        install(model)
    torch.manual_seed(5)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        model(**make_batch(i)).loss.backward()
        opt.step()
    return training_state(model, opt)


@pytest.fixture(scope="module")
def reference():
    return {name: train(make(), batch) for name, (make, batch) in MODELS.items()}


@pytest.mark.parametrize("mode", LOSSLESS_MODES, ids=lambda m: m.label)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_lossless_mode_leaves_the_whole_state_exact(reference, name, mode):
    make, make_batch = MODELS[name]
    handles = []

    def install(model):
        handles.extend(adaptmem.instrument(model, mode=mode))

    got = train(make(), make_batch, install=install)
    assert_same_state(got, reference[name])
    if mode.recomputes:
        assert all(h.recomputes == 3 for h in handles)  # the recompute ran, and did not update twice


def test_the_model_evaluates_the_same_after_training_under_checkpoint():
    """The symptom users see: running statistics updated twice change evaluation."""
    plain, managed = cnn(), cnn()
    adaptmem.instrument(managed, mode=Mode.CHECKPOINT)
    for model in (plain, managed):
        torch.manual_seed(5)
        model(**image_batch()).loss.backward()
        model.eval()
    batch = image_batch(seed=9)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, managed(**batch).logits)


class ScaledNorm(torch.nn.Module):
    """A block whose buffer autograd saves (the scale it multiplies by), beside a BatchNorm
    whose running statistics a recompute updates again."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.norm = torch.nn.BatchNorm1d(dim)
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x) * self.scale)


class Scaled(torch.nn.Module):
    """Two such blocks after a step that multiplies by the first block's scale outside any
    block: autograd saves that buffer there, unhooked, and checks its version in backward,
    after the block's recompute has put its buffers back."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([ScaledNorm(), ScaledNorm()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.blocks[0].scale
        for block in self.blocks:
            x = block(x)
        return x


def scaled_pair(mode):
    """An input, and two `Scaled` models alike: one plain, one with its blocks in `mode`."""

    def make():
        torch.manual_seed(0)
        return Scaled()

    plain, managed = make(), make()
    adaptmem.instrument(managed, blocks=list(managed.blocks), mode=mode)
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), plain, managed


def assert_same_buffers(plain, managed):
    for (name, a), b in zip(plain.named_buffers(), managed.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", [m for m in LOSSLESS_MODES if m.recomputes], ids=lambda m: m.label)
def test_a_buffer_saved_for_backward_survives_the_recompute_putting_buffers_back(mode):
    """The recompute's buffers are put back without a new version: a buffer that autograd
    saved elsewhere is not refused as modified in place, and gradients and statistics are exact."""

    x, plain, managed = scaled_pair(mode)
    for model in (plain, managed):
        for _ in range(2):
            model(x.clone().requires_grad_()).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), managed.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert_same_buffers(plain, managed)


@pytest.mark.parametrize("mode", [m for m in LOSSLESS_MODES if m.recomputes], ids=lambda m: m.label)
def test_a_buffer_registered_into_a_block_after_its_first_recompute_is_put_back_too(mode):
    """The recompute reads a block's buffers from a list of its modules made once: a module
    registered later (its running statistics) is in it, or the recompute would update them twice."""

    x, plain, managed = scaled_pair(mode)
    for model in (plain, managed):
        model(x.clone().requires_grad_()).square().sum().backward()
        block = model.blocks[1]
        block.norm = torch.nn.Sequential(block.norm, torch.nn.BatchNorm1d(8))  # a new module, new buffers
        model(x.clone().requires_grad_()).square().sum().backward()
    assert_same_buffers(plain, managed)


class Stateful(torch.nn.Module):
    """A layer that keeps its last state on the module for the next call (RecurrentGemma's
    recurrent layers do), computed from the weights, so it carries a graph."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.last = None

    def forward(self, x):
        y = torch.tanh(self.proj(x))
        self.last = y[:, -1] * 2  # then more of the forward, which the recompute runs too
        return x + self.out(y)


@pytest.mark.parametrize("mode", [Mode.CHECKPOINT, Mode.SELECTIVE], ids=lambda m: m.label)
def test_what_a_block_keeps_on_itself_is_its_forwards_not_the_recomputes(mode):
    """A recompute set the layer's state again, to a tensor of its own graph, which no backward runs:
    it held the recompute's activations until the next forward (48 MiB of a RecurrentGemma's 2 x 768
    tokens on a stand-in, which every answer to "how long" counted as the next step's start). The
    state is the forward's, as in the model's own run, and nothing of the recompute stays."""
    from adaptmem.testing import SimulatedDevice

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Stateful(), Stateful())
    model = torch.nn.Sequential(Stateful(), Stateful())
    model.load_state_dict(plain.state_dict())
    adaptmem.instrument(model, list(model), mode=mode)
    x = torch.randn(4, 256, 32)
    left = {}
    for name, net in (("plain", plain), ("managed", model)):
        dev = SimulatedDevice()
        dev.track(net)
        with dev:
            net(x.clone()).sum().backward()
        left[name] = dev.allocated_bytes  # the weights, their gradients and the layers' states
    assert left["managed"] == left["plain"]
    assert all(torch.equal(a.last, b.last) for a, b in zip(model, plain))


class Flip(torch.nn.Module):
    """A layer whose forward branches on a count it keeps: its recompute runs other ops."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.proj(x if self.runs % 2 else x[:, :1])


def test_a_recompute_that_runs_other_ops_names_the_block_and_what_to_do():
    model = torch.nn.Sequential(Flip(), Flip())
    adaptmem.instrument(model, list(model), mode=Mode.CHECKPOINT)
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as raised:
        model(torch.randn(2, 8, 16)).sum().backward()
    said = str(raised.value)
    assert "checkpointed block's (Flip) recompute saved a tensor of shape" in said
    assert "model.config.use_cache = False" in said and 'adaptmem.Policy(modes=("NONE", "OFFLOAD"))' in said


class Carry(torch.nn.Module):
    """A layer that goes on from the state its last call left (a recurrent layer fed its cache)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.last = None

    def forward(self, x):
        y = torch.tanh(self.proj(x))
        if self.last is not None and self.last.shape[0] == x.shape[0]:
            y = y + self.last.detach().unsqueeze(1)
        self.last = y[:, -1]
        return x + self.out(y)


def test_a_retry_starts_from_the_state_the_layers_kept_before_the_failed_attempt():
    """The failed attempt's first layers set their state before the third ran out of memory; the
    retry went on from it, where the run unmanaged goes on from the step before's. And a batch given
    up leaves its forward's graph held by nothing (the layers' states held it until the next step)."""
    from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Carry(), Carry(), Carry())
    model = torch.nn.Sequential(Carry(), Carry(), Carry())
    model.load_state_dict(plain.state_dict())
    xs = [torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (8, 12, 10)]
    for x in xs:
        plain(x).sum().backward()
    dev = SimulatedDevice(capacity_bytes=8 * 2**20)
    dev.track(model)
    injector = OutOfMemoryInjector(list(model))
    with dev, adaptmem.manage(model, blocks=list(model), device=dev) as mem:
        for i, x in enumerate(xs):
            if i == 1:
                injector.arm(2, "forward")
            mem.run_step(lambda: model(x).sum().backward())
        assert mem.ooms_recovered == 1
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
        assert all(torch.equal(a.last, b.last) for a, b in zip(model, plain))
        # a batch no plan can fit: given up, and what its forward set on the layers with it
        before = dev.allocated_bytes
        with pytest.raises(adaptmem.StepOutOfMemoryError):
            mem.run_step(lambda: model(torch.randn(2, 2**17, 16)).sum().backward())
        assert dev.allocated_bytes == before
