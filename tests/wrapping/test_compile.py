"""torch.compile: whole-model and per-block (compile_blocks), every lossless mode, the
calibration step included, bit-identical to eager under the aot_eager backend; the
controller is never traced; plan changes cost no recompile per block once seen.

SimulatedDevice intercepts every op through a dispatch mode, which torch.compile does not
trace through, so these tests read the stand-in without entering it."""

import pytest
import torch
from helpers import cnn, hf_batch, image_batch, llama, min_cosine, step, tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES, Mode
from adaptmem.control.compiling import CompileCounter
from adaptmem.testing import SimulatedDevice

MODELS = {"transformer": (tiny, tiny_batch), "cnn": (cnn, lambda m: image_batch())}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def grads_after(model, batch, fn=None, seed=1):
    return step(model, batch, seed, fn)[1]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("how", ["whole", "blocks"])
@pytest.mark.parametrize("mode", LOSSLESS_MODES, ids=lambda m: m.label)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_mode_compiles_bit_identical_to_eager(name, mode, how):
    make, make_batch = MODELS[name]
    model = make()
    batch = make_batch(model)
    expected = grads_after(model, batch)
    adaptmem.instrument(model, mode=mode)
    if how == "whole":
        got = grads_after(model, batch, torch.compile(model, backend="aot_eager"))
    else:
        adaptmem.compile_blocks(model, backend="aot_eager", fullgraph=True)  # no graph break inside a block
        got = grads_after(model, batch)
    assert same(got, expected)


@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_a_managed_model_compiles_from_the_calibration_step_and_the_controller_is_never_traced(how):
    from torch._dynamo.utils import counters

    counters.clear()
    batches = [tiny_batch(tiny(), seq=s) for s in (32, 48, 32)]
    plain = tiny()
    expected = [grads_after(plain, b, seed=i) for i, b in enumerate(batches)]
    model = tiny()
    with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        fn = model
        if how == "whole":
            fn = torch.compile(model, backend="aot_eager")
        else:
            adaptmem.compile_blocks(model, backend="aot_eager", fullgraph=True)
        got = []
        for i, b in enumerate(batches):
            with mem.step():
                got.append(grads_after(model, b, fn, seed=i))
        plans = [r["plan_counts"] for r in mem.events.of_type("step")]
        compiles = mem.summary()["compiles"]
    assert plans[0] == {"CHECKPOINT": 4}  # the calibration step ran compiled too
    assert all(same(g, e) for g, e in zip(got, expected))
    assert compiles > 0
    breaks = list(counters["graph_break"])
    assert all("disable" in reason for reason in breaks), breaks  # only at adaptmem's eager boundary
    if how == "blocks":
        assert breaks == []  # the wrapper runs outside the compiled blocks


def test_compiled_blocks_compile_each_mode_once_and_back_and_forth_compiles_nothing():
    """compile_blocks compiles the block's forward, and the recomputing modes' checkpoints around
    it the first time a block runs in each, as many times for 4 identical blocks as for 2:
    switching between modes seen before compiles nothing."""
    counts = []
    for layers in (2, 4):
        torch._dynamo.reset()
        model = tiny(n_layers=layers)
        batch = tiny_batch(model)
        handles = adaptmem.instrument(model)
        adaptmem.compile_blocks(model, backend="aot_eager", fullgraph=True)
        counter = CompileCounter()
        for mode in LOSSLESS_MODES:
            for h in handles:
                h.mode = mode
            grads_after(model, batch)
        seen = counter.count
        for mode in reversed(LOSSLESS_MODES) if layers == 2 else ():
            for h in handles:
                h.mode = mode
            grads_after(model, batch)
        counter.close()
        assert seen > 0 and counter.count == seen
        counts.append(seen)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("mode", [Mode.CHECKPOINT, Mode.SELECTIVE], ids=lambda m: m.label)
def test_a_compiled_blocks_recompute_is_part_of_its_compiled_code(mode):
    """Under a recomputing mode a compiled block's code runs once a step: the checkpoint is compiled
    with the forward, so the recompute is the compiled function's own backward, not a second run of
    the compiled forward (SELECTIVE's op policy cannot see inside compiled code from outside)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    runs = []

    def counted(gm, example_inputs):  # aot_eager, counting the forward graph's runs
        def run(args):
            runs.append(1)
            return gm(*args)

        run._boxed_call = True
        return run

    model = tiny()
    batch = tiny_batch(model)
    expected = grads_after(model, batch)
    adaptmem.instrument(model, mode=mode)
    backend = aot_autograd(fw_compiler=counted, bw_compiler=lambda gm, _: make_boxed_func(gm))
    adaptmem.compile_blocks(model, backend=backend, fullgraph=True)
    got = grads_after(model, batch)
    assert len(runs) == len(model.blocks)
    assert same(got, expected)


@pytest.mark.parametrize(
    "name",
    [
        "tiny",
        pytest.param("llama, head kept", marks=pytest.mark.slow),
        pytest.param("llama, head chunked", marks=pytest.mark.slow),
    ],
)
def test_whole_model_compile_stops_recompiling_once_the_plans_were_seen(name):
    """Whole-model compile guards each block's code on its mode: the plans of a run compile
    their blocks' code, and going back and forth between plans seen before compiles nothing.
    A Hugging Face model has its loss head wrapped too, whose call counter, counted in traced
    code, made every step compile again."""
    if name == "tiny":
        model = tiny(n_layers=2)
        batch = tiny_batch(model)
    else:
        model = llama(layers=2, hidden=64, dropout=0.0)
        batch = hf_batch(seq=64)
    handles = adaptmem.instrument(model)
    head = adaptmem.get_head(model)
    assert (head is None) == (name == "tiny")
    if name == "llama, head chunked":
        head.mode, head.chunk_tokens = adaptmem.HeadMode.CHUNKED, 32
    fn = torch.compile(model, backend="aot_eager")
    plans = [(Mode.NONE, Mode.CHECKPOINT), (Mode.OFFLOAD, Mode.NONE)]
    counter = CompileCounter()
    counts = []
    for plan in plans * 4:
        for h, mode in zip(handles, plan):
            h.mode = mode
        grads_after(model, batch, fn)
        counts.append(counter.count)
    counter.close()
    assert counts[4:] == [counts[3]] * 4, counts  # back and forth between plans seen before: nothing


@pytest.mark.parametrize("mode", [Mode.NONE, Mode.CHECKPOINT, Mode.SELECTIVE], ids=lambda m: m.label)
def test_compiled_blocks_run_uncompiled_under_the_stand_in_and_compiled_after(mode):
    """torch.compile does not trace through a dispatch mode (with fullgraph=True it raises): under
    the stand-in's, compiled blocks run their eager forward, exactly; out of it, their compiled one."""
    model = llama(layers=2, hidden=64, dropout=0.0)
    batch = hf_batch(seq=64)
    expected = grads_after(model, batch)
    adaptmem.instrument(model, mode=mode)
    adaptmem.compile_blocks(model, backend="aot_eager", fullgraph=True)
    counter = CompileCounter()
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        dev.track(model)
        inside = grads_after(model, batch)
    compiled_inside = counter.count
    outside = grads_after(model, batch)
    counter.close()
    assert same(inside, expected) and same(outside, expected)
    assert compiled_inside == 0 and counter.count > 0 and dev.peak_bytes > 0


def test_compile_blocks_warns_of_a_hugging_face_cache_built_in_training(caplog):
    """With use_cache=True a Hugging Face model writes a cache in training too, each layer under
    its own index: each NONE block compiles its own code, and past 8 the recompile limit hits."""
    for use_cache in (True, False):
        model = llama(layers=2, hidden=64)
        model.config.use_cache = use_cache
        adaptmem.instrument(model)
        caplog.clear()
        adaptmem.compile_blocks(model, backend="aot_eager")
        warned = [r for r in caplog.records if "use_cache = True" in r.getMessage()]
        assert len(warned) == (1 if use_cache else 0)
        if use_cache:
            assert "model.config.use_cache = False" in warned[0].getMessage()


@pytest.mark.slow
def test_compiled_blocks_run_compress_with_the_strides_their_backward_expects():
    """Inductor's backward checks each saved tensor's strides; the codec gave transposed saves
    back contiguous, and the first backward of a compiled Llama under COMPRESS failed."""
    model = llama(layers=2, hidden=64, dropout=0.0)
    batch = hf_batch(seq=64)
    expected = grads_after(model, batch)
    handles = adaptmem.instrument(model, mode=Mode.COMPRESS)
    for h in handles:
        h.compress_options = adaptmem.CompressOptions(min_bytes=0)
    adaptmem.compile_blocks(model, fullgraph=True)
    got = grads_after(model, batch)
    assert got.keys() == expected.keys() and min_cosine(got, expected) > 0.999


def test_compile_blocks_needs_an_instrumented_model_and_restore_drops_it():
    model = tiny()
    with pytest.raises(ValueError, match="call adaptmem.instrument"):
        adaptmem.compile_blocks(model)
    adaptmem.instrument(model)
    adaptmem.compile_blocks(model, backend="aot_eager")
    adaptmem.restore(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_compiled_model_checkpointed_warns_of_no_cached_function():
    """torch.compile warned at every checkpointed block of a compiled model that the block's call went
    through a `functools.lru_cache`-wrapped function (adaptmem's look-up of a positional `use_cache`)."""
    import warnings

    model = tiny()
    batch = tiny_batch(model)
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(**batch).loss.backward()
    assert not [w for w in caught if "lru_cache" in str(w.message)]
