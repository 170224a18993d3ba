"""A recovered out-of-memory error leaves the whole training state exact: parameters,
gradients, buffers (batch-norm statistics), RNG and optimizer state, whether the error
comes in forward, in a recompute or in backward, and also inside an accumulation window."""

import random
import weakref

import numpy
import pytest
import torch
from helpers import assert_same_state, cnn, host_random_cnn, image_batch, mixed, mixed_batch, training_state

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice

MODELS = {
    "cnn": (cnn, image_batch, lambda m: m.stages, lambda block: block.body[0]),
    "mixed": (mixed, mixed_batch, lambda m: m.blocks, lambda block: block.up),
    # draws from NumPy's and Python's generators in forward, as Wav2Vec2's SpecAugment does
    "host-random": (host_random_cnn, image_batch, lambda m: m.stages, lambda block: block.body[0]),
}


class Injector:
    """Raises one out-of-memory error at a chosen place, on the first attempt of one micro-batch."""

    def __init__(self, block: torch.nn.Module, inner: torch.nn.Module, where: str) -> None:
        self.where, self.armed, self.fired = where, False, 0
        inner.register_forward_pre_hook(self.pre_hook)
        block.register_forward_hook(self.output_hook)

    def _fire(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise torch.OutOfMemoryError(f"injected out of memory in {self.where}")

    def pre_hook(self, module, args):
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute runs inside backward
        if (self.where == "forward" and not in_backward) or (self.where == "recompute" and in_backward):
            self._fire()

    def output_hook(self, module, args, output):
        if self.where == "backward" and output.requires_grad:
            output.register_hook(lambda grad: self._fire())


def run(make, make_batch, *, managed: bool, where: str | None = None):
    """Three optimizer steps; the second accumulates two micro-batches, and its second
    micro-batch runs out of memory once at `where` (every second block is checkpointed)."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    micro = [[make_batch(seed=1)], [make_batch(seed=2), make_batch(seed=3)], [make_batch(seed=4)]]
    injector = None
    if managed:
        blocks, inner = MODELS_BY_MAKE[make]
        injector = Injector(blocks(model)[1], inner(blocks(model)[1]), where)
        policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0})
        mem = adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31))
    torch.manual_seed(11)
    random.seed(11)
    numpy.random.seed(11)
    for s, batches in enumerate(micro):
        for m, batch in enumerate(batches):
            if managed:
                injector.armed = (s, m) == (1, 1)
                mem.run_step(lambda b=batch: model(**b).loss.backward())
            else:
                model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if managed:
        summary = mem.summary()
        mem.close()
        assert injector.fired == 1 and summary["ooms_recovered"] == 1, summary
    return training_state(model, opt)


MODELS_BY_MAKE = {make: (blocks, inner) for make, _, blocks, inner in MODELS.values()}


@pytest.mark.parametrize("where", ["forward", "recompute", "backward"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_recovered_oom_leaves_the_whole_state_exact(name, where):
    make, make_batch, _, _ = MODELS[name]
    expected = run(make, make_batch, managed=False)
    assert_same_state(run(make, make_batch, managed=True, where=where), expected)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_a_step_that_zeroes_gradients_between_forward_and_backward_is_retried_exactly(set_to_none, where, accumulate):
    """Lightning's closure calls zero_grad between forward and backward, at the first
    micro-batch of each accumulation window; every micro-batch runs out of memory once."""

    def run(managed):
        model = mixed()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mem = injector = None
        if managed:
            injector = Injector(model.blocks[1], model.blocks[1].up, where)
            policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0})
            mem = adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31))
        torch.manual_seed(11)
        for i in range(4):

            def closure(batch=mixed_batch(seed=i), first=(i % accumulate == 0)):
                loss = model(**batch).loss
                if first:
                    opt.zero_grad(set_to_none=set_to_none)
                loss.backward()

            if managed:
                injector.armed = True
                mem.run_step(closure)
            else:
                closure()
            if (i + 1) % accumulate == 0:
                opt.step()
        if managed:
            assert injector.fired == 4 and mem.summary()["ooms_recovered"] == 4
            mem.close()
        return training_state(model, opt)

    assert_same_state(run(managed=True), run(managed=False))


def _after_one_step():
    """A managed model with gradients from one step, an out-of-memory error ready in a block's
    backward: (model, its optimizer, the injector, the manager, entered)."""
    model = mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    injector = Injector(model.blocks[1], model.blocks[1].up, "backward")
    policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0})
    mem = adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31))
    mem.run_step(lambda: model(**mixed_batch()).loss.backward())
    return model, opt, injector, mem


def test_a_step_that_scales_gradients_in_place_is_refused_with_the_cause():
    model, opt, injector, mem = _after_one_step()
    with mem:

        def scaled():
            loss = model(**mixed_batch(seed=2)).loss
            for p in model.parameters():
                p.grad.mul_(0.5)
            loss.backward()

        injector.armed = True
        with pytest.raises(adaptmem.InexactRetryError, match="changed .* existing gradient.* in place before backward"):
            mem.run_step(scaled)
    del opt


def test_gradients_the_step_drops_are_freed_inside_it_and_a_replaced_one_is_refused():
    """Lightning's closure drops the last step's gradients between forward and backward: the guard
    holds them weakly, so they are freed there as without adaptmem (it held a whole set of them
    through the step); a retry drops them again. A gradient replaced by a tensor of the step
    function's own before backward cannot be given back: that retry is refused with the cause."""
    model, opt, injector, mem = _after_one_step()
    with mem:
        alive = []

        def closure():
            loss = model(**mixed_batch(seed=2)).loss
            last = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
            opt.zero_grad(set_to_none=True)
            alive.append(sum(ref() is not None for ref in last))
            loss.backward()

        injector.armed = True
        mem.run_step(closure)
        assert alive == [0, 0] and mem.summary()["ooms_recovered"] == 1

        def replaced():
            loss = model(**mixed_batch(seed=3)).loss
            for p in model.parameters():
                p.grad = p.grad * 0.5
            loss.backward()

        injector.armed = True
        with pytest.raises(adaptmem.InexactRetryError, match="replaced .* gradient.* by tensors of its own"):
            mem.run_step(replaced)


def test_buffers_past_the_snapshot_limit_are_refused_with_the_setting():
    model = cnn()
    injector = Injector(model.stages[1], model.stages[1].body[0], "forward")
    policy = load_policy("every-2").model_copy(update={"sample_interval_s": 30.0, "buffer_snapshot_limit": 16})
    with adaptmem.manage(model, policy=policy, budget=2**30, device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        injector.armed = True
        with pytest.raises(adaptmem.InexactRetryError, match="buffer_snapshot_limit"):
            mem.run_step(lambda: model(**image_batch()).loss.backward())


def test_the_guard_reads_the_models_parameters_and_buffers_as_they_stand_without_walking_it():
    """The modules are listed once, again after a module is registered into one; parameters and buffers are
    read from them in place: the same tensors in the same order as `model.parameters()` and
    `model.buffers()`, a parameter replaced or a submodule added seen at once."""
    from adaptmem.registrations import ListedModules

    model = cnn()
    model.tied = torch.nn.Linear(16, 10)
    model.tied.weight = model.head.weight  # one parameter in two modules: listed once
    listed = ListedModules(model)

    def same(kind, reference):
        got = listed.tensors(kind)
        return len(got) == len(reference) and all(a is b for a, b in zip(got, reference))

    assert same("_parameters", list(model.parameters())) and same("_buffers", list(model.buffers()))
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    first.weight = torch.nn.Parameter(first.weight.detach().clone())  # replaced in place of the old
    model.extra = torch.nn.BatchNorm1d(3)  # a module registered after the list was made
    assert same("_parameters", list(model.parameters())) and same("_buffers", list(model.buffers()))
    model.extra.inner = torch.nn.Linear(3, 3)  # and into that one, listed since
    assert same("_parameters", list(model.parameters()))


def test_modules_registered_outside_a_listed_model_do_not_make_it_listed_again():
    """Hugging Face models slice their list of layers in every forward, registering each layer into
    a new `nn.ModuleList`: the listed model is unchanged, and the count that says so too."""
    from adaptmem.registrations import listed, registrations

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]))
    modules, count = listed(model)
    assert len(modules) == 5
    model[0][:2]  # a new ModuleList of two of the layers
    torch.nn.Sequential(torch.nn.Linear(2, 2))  # a model of its own
    assert registrations() == count
    model[0].append(torch.nn.Linear(2, 2))
    assert registrations() != count


def test_a_failed_attempts_message_is_shortened_at_a_sentence_or_a_word_never_inside_one():
    """An allocator's out-of-memory message runs to several sentences; the record of a failed
    attempt keeps what fits in 300 characters without cutting a word (it read "...where a CUDA
    allocati")."""
    from adaptmem.control.retry import failure_record

    with SimulatedDevice(capacity_bytes=2**20) as dev, pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(2 * dev.capacity_bytes, dtype=torch.uint8)
    text = str(err.value)
    assert len(text) > 300
    message = failure_record(err.value, None, (), 0.0, 2**20, 0.97)["message"]
    assert len(message) <= 300 and text.startswith(message) and message.endswith(".")
    words = failure_record(torch.OutOfMemoryError("x" * 10 + " word" * 100), None, (), 0.0, 1, 0.97)["message"]
    assert len(words) <= 300 and words.endswith(" word ...")
    assert failure_record(torch.OutOfMemoryError("short. two."), None, (), 0.0, 1, 0.97)["message"] == "short. two."


@pytest.mark.slow
def test_a_retry_starts_without_the_failed_attempts_copies_still_in_flight():
    """On a slow link a failed attempt's copies to the host are still travelling, and their device
    tensors alive, when it fails: the retry lets go of them first, so it starts from what the step
    held before, and is planned from that."""
    from helpers import hf_batch, llama

    torch.manual_seed(0)
    model = llama(layers=4, hidden=64, dropout=0.0)
    dev = SimulatedDevice(2**30, link_bytes_per_s=5e6)  # a block's copies take seconds to arrive
    dev.track(model)
    policy = load_policy("balanced").model_copy(update={"modes": ("OFFLOAD",), "sample_interval_s": 30.0})
    starts, fail = [], []
    model.model.layers[0].register_forward_pre_hook(lambda *a: starts.append(dev.allocated_bytes))

    def once(*args):
        if fail:
            fail.clear()
            raise torch.OutOfMemoryError("out of memory in the last block")

    model.model.layers[3].register_forward_pre_hook(once)
    batch = hf_batch(2, 256)
    with dev, adaptmem.manage(model, device=dev, budget=2**29, policy=policy, head=None) as mem:
        mem.run_step(lambda: model(**batch).loss.backward())
        model.zero_grad(set_to_none=True)
        starts.clear()
        fail.append(True)
        mem.run_step(lambda: model(**batch).loss.backward())
        assert mem.summary()["ooms_recovered"] == 1
    assert len(starts) == 2 and starts[1] == starts[0], [s / 2**20 for s in starts]


def test_an_accumulating_step_that_never_fits_names_the_gradient_copies_it_held():
    """Each attempt of a micro-batch after the first copies the gradients it adds into (so that
    a retry is exact): where every attempt fails, the error says how much and which setting keeps
    them off the device."""
    model, _, injector, mem = _after_one_step()
    with mem:

        def micro_batch():
            injector.armed = True  # every attempt runs out of memory in block 1's backward
            model(**mixed_batch(seed=2)).loss.backward()

        with pytest.raises(adaptmem.StepOutOfMemoryError) as err:
            mem.run_step(micro_batch)
        assert injector.fired == mem.policy.max_retries + 1
        assert "of copies of the gradients earlier micro-batches left" in str(err.value)
        assert "accumulation_snapshot='device'): 'host' keeps them in host memory" in str(err.value)
