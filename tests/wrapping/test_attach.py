"""Wrapping is invisible, restore is its exact inverse, bad input is explained."""

import copy
import gc
import io
import weakref

import pytest
import torch
from helpers import assert_same, gpt2, hf_batch, llama, step, tiny, tiny_batch
from torch import nn

import adaptmem
from adaptmem import ALLOWED_MODES, Mode
from adaptmem import strategies as strategies_mod


def snapshot(model):
    return {
        "keys": list(model.state_dict().keys()),
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "classes": [(n, type(m)) for n, m in model.named_modules()],
        "repr": repr(model),
        "dict_keys": {n: sorted(m.__dict__) for n, m in model.named_modules()},
    }


@pytest.mark.parametrize("make", [tiny, lambda: llama(layers=2)], ids=["tiny", "llama"])
def test_instrument_changes_no_name_parameter_class_or_repr(make):
    model = make()
    before = snapshot(model)
    handles = adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    after = snapshot(model)
    for key in ("keys", "params", "classes", "repr"):
        assert before[key] == after[key], key
    assert all(type(h.module) is type(model.get_submodule(h.name)) for h in handles)
    adaptmem.restore(model)
    assert snapshot(model) == before


def test_restore_gives_bit_identical_gradients():
    model = tiny()
    batch = tiny_batch(model)
    plain = step(model, batch)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    adaptmem.restore(model)
    assert_same(step(model, batch), plain)
    assert adaptmem.get_handles(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_restore_on_a_plain_model_is_a_no_op():
    model = tiny()
    adaptmem.restore(model)
    assert "forward" not in model.blocks[0].__dict__


def test_an_earlier_instance_forward_is_kept_and_put_back():
    model = tiny()
    block = model.blocks[1]
    calls = []
    original = block.forward

    def patched(x):
        calls.append(1)
        return original(x)

    block.forward = patched
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    step(model, tiny_batch(model))
    assert len(calls) == 2  # forward + recompute in backward
    adaptmem.restore(model)
    assert block.__dict__["forward"] is patched


def test_restore_refuses_when_forward_was_replaced_on_top_and_changes_nothing():
    model = tiny()
    adaptmem.instrument(model)
    ours = model.blocks[2].forward
    model.blocks[2].forward = lambda x: x
    with pytest.raises(RuntimeError, match="block 'blocks.2': its forward was replaced"):
        adaptmem.restore(model)
    assert len(adaptmem.get_handles(model)) == 4
    assert isinstance(model.blocks[0].__dict__["forward"], type(ours))


def test_existing_optimizer_keeps_working():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.blocks[0].mlp[0].weight.detach().clone()
    adaptmem.instrument(model, mode=Mode.CHECKPOINT | Mode.OFFLOAD)
    step(model, tiny_batch(model))
    opt.step()
    assert not torch.equal(before, model.blocks[0].mlp[0].weight)


def test_user_hooks_run_once_per_forward():
    model = tiny()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model.blocks[1].register_forward_hook(lambda m, args, out: seen.append("post"))
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    step(model, tiny_batch(model))
    assert seen == ["pre", "post"]


class Fancy(nn.Module):
    """A block taking positional, keyword and non-tensor arguments, returning a structure."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x, scale, *, gate=None, shift=0.0, tag="t"):
        y = torch.tanh(self.lin(x)) * scale + shift
        if gate is not None:
            y = y * torch.sigmoid(gate)
        if self.kind == "tuple":
            return y, tag
        if self.kind == "dict":
            return {"y": y, "tag": tag}
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=y)


class Stack(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(Fancy(kind) for _ in range(3))

    def forward(self, x, gate):
        for block in self.blocks:
            out = block(x, 0.5, gate=gate, shift=0.25, tag="hello")
            if self.kind == "tuple":
                x, tag = out
                assert tag == "hello"
            elif self.kind == "dict":
                x = out["y"]
                assert out["tag"] == "hello"
            else:
                x = out.last_hidden_state
        return x.square().mean()


@pytest.mark.parametrize("kind", ["tuple", "dict", "model_output"])
@pytest.mark.parametrize("mode", ALLOWED_MODES, ids=lambda m: m.label)
def test_arguments_and_returns_pass_through(kind, mode):
    torch.manual_seed(0)
    model = Stack(kind)
    x = torch.randn(4, 8, requires_grad=True)
    gate = torch.randn(4, 8, requires_grad=True)
    expected = model(x, gate)
    expected.backward()
    ref = [x.grad.clone(), gate.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = gate.grad = None
    adaptmem.instrument(model, mode=mode, compress=adaptmem.CompressOptions(min_bytes=0))
    got = model(x, gate)
    got.backward()
    grads = [x.grad, gate.grad] + [p.grad for p in model.parameters()]
    if mode.lossless:
        assert torch.equal(got, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    else:
        assert torch.allclose(got, expected, rtol=0.05, atol=1e-3)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "eval"])
def test_plain_path_without_grad_or_in_eval(monkeypatch, context):
    model = tiny()
    handles = adaptmem.instrument(model, mode=Mode.CHECKPOINT)

    def forbidden(call):
        raise AssertionError("a strategy ran where the plain path was expected")

    monkeypatch.setitem(strategies_mod.STRATEGIES, Mode.CHECKPOINT, forbidden)
    batch = tiny_batch(model)
    if context == "eval":
        model.eval()
        model(**batch).loss.backward()
    elif context == "no_grad":
        with torch.no_grad():
            model(**batch)
    else:
        with torch.inference_mode():
            model(**batch)
    assert all(h.calls == 0 for h in handles)
    model.train()
    with pytest.raises(AssertionError, match="strategy ran"):
        model(**batch)


def test_a_block_in_none_runs_its_class_forward_as_it_stands_counted_and_bit_equal():
    """A NONE block nobody watches runs its own forward directly (no strategy), and is counted; its
    class's forward replaced after instrumenting is the one that runs next."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 8)
    plain = copy.deepcopy(model)
    handles = adaptmem.instrument(model, r"layers\.\d+", head=None)
    model(x).backward()
    plain(x).backward()
    assert all(h.calls == 1 for h in handles)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    Layer.forward = lambda self, x: torch.relu(self.lin(x))  # replaced on the class
    with torch.no_grad():
        expected = plain(x)
    assert torch.equal(model(x), expected) and all(h.calls == 2 for h in handles)
    block = weakref.ref(model.layers[0])
    gc.collect()
    gc.disable()  # what a cycle holds stays held: the block must go with its last reference
    try:
        del model, handles
        assert block() is None
    finally:
        gc.enable()


def test_instrument_again_is_idempotent_and_a_new_selection_is_refused():
    model = tiny()
    first = adaptmem.instrument(model)
    again = adaptmem.instrument(model, "Block")
    assert [id(h) for h in again] == [id(h) for h in first]
    with pytest.raises(ValueError, match=r"already instrumented with 4 blocks .* Call adaptmem.restore\(model\) first"):
        adaptmem.instrument(model, r"blocks\.0")


def test_a_block_shared_with_another_instrumented_root_is_refused():
    model = tiny()
    adaptmem.instrument(model)
    wrapper = nn.Sequential(model.blocks[0], model.blocks[1])
    with pytest.raises(ValueError, match="already instrumented through another model object"):
        adaptmem.instrument(wrapper)


def test_bad_mode_on_a_handle_keeps_the_old_mode():
    handles = adaptmem.instrument(tiny(), mode="checkpoint")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        handles[0].mode = "fast"
    with pytest.raises(ValueError, match="not supported"):
        handles[0].mode = Mode.SELECTIVE | Mode.OFFLOAD
    assert handles[0].mode is Mode.CHECKPOINT
    handles[0].mode = "offload"
    assert handles[0].mode is Mode.OFFLOAD
    assert "mode=OFFLOAD" in repr(handles[0])


def test_state_dict_moves_between_instrumented_and_plain_models():
    source = tiny()
    adaptmem.instrument(source, mode=Mode.CHECKPOINT)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01)
    plain = tiny()
    plain.load_state_dict(source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), source.state_dict().values()))
    target = tiny()
    adaptmem.instrument(target, mode=Mode.OFFLOAD)
    target.load_state_dict(plain.state_dict())
    batch = tiny_batch(plain)
    assert_same(step(target, batch), step(plain, batch))


def test_deepcopy_gives_an_independent_instrumented_model():
    model = tiny()
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    clone = copy.deepcopy(model)
    handles = adaptmem.get_handles(clone)
    assert [h.module for h in handles] == list(clone.blocks)
    handles[0].mode = Mode.OFFLOAD
    assert adaptmem.get_handles(model)[0].mode is Mode.CHECKPOINT
    batch = tiny_batch(model)
    assert_same(step(clone, batch), step(model, batch))
    assert handles[0].calls == 1
    adaptmem.restore(clone)
    assert "forward" not in clone.blocks[0].__dict__
    assert "forward" in model.blocks[0].__dict__


def test_whole_model_pickles_with_its_instrumentation():
    model = tiny()
    adaptmem.instrument(model, mode=Mode.SELECTIVE)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert [h.mode for h in adaptmem.get_handles(loaded)] == [Mode.SELECTIVE] * 4
    batch = tiny_batch(model)
    assert_same(step(loaded, batch), step(model, batch))


def test_hf_cache_is_dropped_for_recomputed_blocks(caplog):
    model = llama(layers=2)
    model.config.use_cache = True
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    batch = hf_batch()
    with caplog.at_level("DEBUG", logger="adaptmem"):
        out = model(**batch, use_cache=True)
        out.loss.backward()
    assert "KV cache is not written in training" in caplog.text
    assert all(p.grad is not None for p in model.model.layers.parameters())


@pytest.mark.parametrize("mode", [Mode.SELECTIVE, Mode.CHECKPOINT], ids=["selective", "checkpoint"])
def test_a_cache_handed_positionally_is_dropped_for_recomputed_blocks(mode, caplog):
    """GPT-2 hands its KV cache to each block as the second positional argument. Left in, the
    recompute wrote it a second time and attended over twice the keys: SELECTIVE raised (its
    recompute ran other ops than forward) and CHECKPOINT held a longer cache in backward."""
    from adaptmem.testing import SimulatedDevice

    batch = hf_batch(seq=48)
    reference = gpt2(layers=2, use_cache=True)
    expected = step(reference, batch)
    peaks = {}
    for use_cache in (True, False):
        model = gpt2(layers=2, use_cache=use_cache)
        adaptmem.instrument(model, mode=mode)
        dev = SimulatedDevice()
        dev.track(model)
        with caplog.at_level("DEBUG", logger="adaptmem"), dev:
            got = step(model, batch)
        peaks[use_cache] = dev.peak_bytes
        assert_same(got, expected)
    assert "KV cache is not written in training" in caplog.text
    assert peaks[True] == peaks[False]


@pytest.mark.parametrize("mode", [Mode.SELECTIVE, Mode.CHECKPOINT], ids=["selective", "checkpoint"])
def test_use_cache_handed_positionally_is_off_for_recomputed_blocks(mode):
    """RecurrentGemma's model hands `use_cache` (True from its default config) to each layer as a
    positional argument, and a recurrent layer given it keeps its last state and its convolution's
    window on the module: the recompute started from the state forward left, and raised
    CheckpointError at the first step (recompute saved (2, 64) where forward saved (2, 64, 64))."""
    transformers = pytest.importorskip("transformers")
    config = transformers.RecurrentGemmaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, attention_window_size=32, conv1d_width=4,
    )  # fmt: skip
    assert config.use_cache  # the default, left as it is
    torch.manual_seed(0)
    reference = transformers.RecurrentGemmaForCausalLM(config).train()
    model = copy.deepcopy(reference)
    adaptmem.instrument(model, mode=mode)
    batch = hf_batch(seq=64)
    assert_same(step(model, batch), step(reference, batch))
