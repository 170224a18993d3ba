"""Hugging Face architectures from small configs (random weights, their default dropout and
cache settings): the blocks are found, and one training step in every lossless mode gives
the loss and gradients of the unmanaged model bit for bit.

Each family has its own way of handing state to its blocks: GPT-2 passes its KV cache
positionally, Bloom and Falcon build ALiBi biases, Mistral a sliding window over SDPA,
Gemma 2 soft-caps its scores, Mamba runs a sequential scan, ConvNeXt drops paths at
random, ResNet keeps batch-norm statistics."""

import copy

import pytest
import torch

tf = pytest.importorskip("transformers")

import adaptmem  # noqa: E402
from adaptmem import Mode  # noqa: E402
from adaptmem.testing import SimulatedDevice  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
TEXT = {
    "gpt2": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    ),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(**SMALL, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.1)
    ),
    "bloom": lambda: tf.BloomForCausalLM(
        tf.BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.1, attention_dropout=0.1)
    ),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(**SMALL, alibi=True, attention_dropout=0.1)),
    "gptj": lambda: tf.GPTJForCausalLM(
        tf.GPTJConfig(vocab_size=256, n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=64)
    ),
    "phi": lambda: tf.PhiForCausalLM(
        tf.PhiConfig(**SMALL, intermediate_size=64, max_position_embeddings=64, resid_pdrop=0.1)
    ),
    "qwen3": lambda: tf.Qwen3ForCausalLM(
        tf.Qwen3Config(**SMALL, intermediate_size=64, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    ),
    "mistral-sdpa": lambda: tf.MistralForCausalLM(
        tf.MistralConfig(
            **SMALL,
            intermediate_size=64,
            num_key_value_heads=1,
            sliding_window=16,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    ),
    "gemma2": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(
            **SMALL,
            intermediate_size=64,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=16,
            max_position_embeddings=64,
            attn_implementation="eager",
        )
    ),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL, intermediate_size=64, max_position_embeddings=64)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(**SMALL, intermediate_size=64, max_position_embeddings=64)),
    "mamba": lambda: tf.MambaForCausalLM(
        tf.MambaConfig(vocab_size=256, hidden_size=32, state_size=4, num_hidden_layers=2, use_mambapy=False)
    ),
}
IMAGES = {
    "vit": lambda: tf.ViTForImageClassification(
        tf.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
            hidden_dropout_prob=0.1,
        )
    ),
    "convnext": lambda: tf.ConvNextForImageClassification(
        tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2, num_labels=3, drop_path_rate=0.2)
    ),
    "resnet": lambda: tf.ResNetForImageClassification(
        tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    ),
}
MODES = [Mode.SELECTIVE, Mode.CHECKPOINT, Mode.OFFLOAD, Mode.CHECKPOINT | Mode.OFFLOAD]


def batch_for(name: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    if name in IMAGES:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen), "labels": torch.tensor([0, 2])}
    ids = torch.randint(3, 256, (2, 24), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def train_step(model, batch) -> tuple:
    """One step on a stand-in device: loss, gradients and buffers afterwards."""
    dev = SimulatedDevice()
    dev.track(model)
    torch.manual_seed(7)
    with dev:
        loss = model(**batch).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("name", [*TEXT, *IMAGES])
def test_every_lossless_mode_is_exact_on_the_architecture(name):
    make = {**TEXT, **IMAGES}[name]
    try:
        torch.manual_seed(0)
        base = make()
    except (AttributeError, TypeError, ValueError) as e:  # an older transformers without the class
        pytest.skip(f"{name} cannot be built by this transformers: {e}")
    base.train()
    batch = batch_for(name)
    loss, grads, buffers = train_step(copy.deepcopy(base), batch)
    for mode in MODES:
        model = copy.deepcopy(base)
        handles = adaptmem.instrument(model, mode=mode)
        assert len(handles) >= 2, [h.name for h in handles]
        got_loss, got_grads, got_buffers = train_step(model, batch)
        assert torch.equal(got_loss, loss), (mode, got_loss.item(), loss.item())
        assert got_grads.keys() == grads.keys(), mode
        bad = [n for n in grads if not torch.equal(got_grads[n], grads[n])]
        assert not bad, f"{mode}: {len(bad)} gradients differ, first {bad[:3]}"
        assert all(torch.equal(got_buffers[n], buffers[n]) for n in buffers), mode


@pytest.mark.parametrize("name", [*TEXT, *IMAGES])
def test_selective_holding_every_weight_layer_is_exact_for_two_steps(name, every_layer_held):
    """The configs are small, so SELECTIVE would hold few layers: here it holds every one, and
    the second step runs on what the first recompute taught (which calls it never reaches)."""
    make = {**TEXT, **IMAGES}[name]
    try:
        torch.manual_seed(0)
        base = make()
    except (AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"{name} cannot be built by this transformers: {e}")
    base.train()
    batch = batch_for(name)
    plain, managed = copy.deepcopy(base), copy.deepcopy(base)
    adaptmem.instrument(managed, mode=Mode.SELECTIVE)
    for _ in range(2):
        loss, grads, buffers = train_step(plain, batch)
        got_loss, got_grads, got_buffers = train_step(managed, batch)
        assert torch.equal(got_loss, loss)
        bad = [n for n in grads if not torch.equal(got_grads[n], grads[n])]
        assert not bad, f"{len(bad)} gradients differ, first {bad[:3]}"
        assert all(torch.equal(got_buffers[n], buffers[n]) for n in buffers)
