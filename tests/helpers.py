"""Models and steps shared by the tests: real architectures, random weights, generated data."""

from __future__ import annotations

import torch

from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch


def tiny(**overrides) -> TinyTransformer:
    torch.manual_seed(0)
    cfg = TinyConfig(**{"n_layers": 4, "dim": 64, "n_heads": 4, "vocab_size": 128, **overrides})
    return TinyTransformer(cfg)


def tiny_batch(model: TinyTransformer, batch: int = 2, seq: int = 32) -> dict:
    return random_batch(model.cfg, batch, seq, generator=torch.Generator().manual_seed(1))


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def llama(layers: int = 4, hidden: int = 128, dropout: float = 0.1):
    """A Hugging Face Llama built from a small config (random weights, attention dropout > 0)."""
    _quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers, num_attention_heads=max(2, hidden // 32),
        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=2048,
        attention_dropout=dropout, use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def gpt2(layers: int = 3, hidden: int = 64, dropout: float = 0.1):
    """A Hugging Face GPT-2 built from a small config (dropout > 0 everywhere)."""
    _quiet_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=4, vocab_size=512, n_positions=1024,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def hf_batch(batch: int = 2, seq: int = 32, vocab: int = 512) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def step(model: torch.nn.Module, batch: dict, seed: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward with a fixed RNG seed; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: tuple, b: tuple) -> None:
    """Loss and every gradient equal bit for bit."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b), f"loss differs: {loss_a.item()!r} vs {loss_b.item()!r}"
    assert grads_a.keys() == grads_b.keys()
    bad = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not bad, f"{len(bad)} gradients differ, first {bad[:3]}"


def min_cosine(grads: dict, reference: dict) -> float:
    return min(
        torch.nn.functional.cosine_similarity(grads[n].flatten().double(), reference[n].flatten().double(), dim=0).item()
        for n in reference
    )
