"""Models and steps shared by the tests: real architectures, random weights, generated data."""

from __future__ import annotations

import random

import numpy
import torch

from adaptmem import Mode
from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch
from adaptmem.devices.simulated import SimulatedProbe
from adaptmem.testing import SimulatedDevice, measure_peak


def tiny(**overrides) -> TinyTransformer:
    torch.manual_seed(0)
    cfg = TinyConfig(**{"n_layers": 4, "dim": 64, "n_heads": 4, "vocab_size": 128, **overrides})
    return TinyTransformer(cfg)


def tiny_batch(model: TinyTransformer, batch: int = 2, seq: int = 32) -> dict:
    return random_batch(model.cfg, batch, seq, generator=torch.Generator().manual_seed(1))


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def llama(layers: int = 4, hidden: int = 128, dropout: float = 0.1, vocab: int = 512, kv_heads: int | None = None):
    """A Hugging Face Llama built from a small config (random weights, attention dropout > 0;
    grouped-query attention unless `kv_heads` is the number of heads)."""
    quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 32),
        num_key_value_heads=kv_heads or max(1, hidden // 64),
        max_position_embeddings=2048,
        attention_dropout=dropout,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def albert(layers: int = 4, hidden: int = 64, vocab: int = 512, dropout: float = 0.0):
    """A Hugging Face ALBERT masked LM built from a small config: one layer's weights, run `layers`
    times in each forward (random weights; `dropout` on the hidden states and the attention)."""
    quiet_transformers()
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    cfg = AlbertConfig(
        vocab_size=vocab,
        embedding_size=hidden // 2,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return AlbertForMaskedLM(cfg)


def gpt2(layers: int = 3, hidden: int = 64, dropout: float = 0.1, use_cache: bool = False):
    """A Hugging Face GPT-2 built from a small config (dropout > 0 everywhere); with `use_cache`
    it hands a KV cache to each block, positionally."""
    quiet_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=512,
        n_positions=1024,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=use_cache,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def lightning_trainer(**options):
    """A Lightning `Trainer` on the CPU that writes and prints nothing of its own (no logger, checkpoints,
    progress bar or model summary) unless `options` say so."""
    import lightning.pytorch as pl

    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **options})


def hf_arguments(out, **overrides):
    """`TrainingArguments` for a short, deterministic CPU run in `out`: batch 2, two micro-batches a step,
    3 steps, a constant learning rate, no reporters and no checkpoints unless `overrides` say so."""
    from transformers import TrainingArguments

    options = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def hf_batch(batch: int = 2, seq: int = 32, vocab: int = 512) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def step(model: torch.nn.Module, batch: dict, seed: int = 2, fn=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward with a fixed RNG seed, through `fn` (a compiled model, say) when
    given; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = (fn if fn is not None else model)(**batch).loss
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
        torch.nn.functional.cosine_similarity(
            grads[n].flatten().double(), reference[n].flatten().double(), dim=0
        ).item()
        for n in reference
    )


# ------------------------------------------------------------------ vision and mixed models
class _Out:
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class ConvBlock(torch.nn.Module):
    """A residual conv stage: conv, batch norm, ReLU, channel dropout, conv, batch norm."""

    def __init__(self, channels: int, dropout: float = 0.1) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Dropout2d(dropout),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SmallCNN(torch.nn.Module):
    """``model(images, labels) -> .loss``: a stem, four residual stages with batch norm, a head."""

    def __init__(self, channels: int = 16, stages: int = 4, classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.stages = nn.Sequential(*[ConvBlock(channels, dropout) for _ in range(stages)])
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> _Out:
        x = self.stages(self.stem(images))
        logits = self.head(x.mean(dim=(2, 3)))
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return _Out(loss, logits)


class MixedBlock(torch.nn.Module):
    """Attention with layer norm, then an MLP whose hidden features pass a BatchNorm1d."""

    def __init__(self, dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        nn = torch.nn
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, dropout=dropout, batch_first=True)
        self.up = nn.Linear(dim, 2 * dim)
        self.bn = nn.BatchNorm1d(2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        u = self.bn(self.up(x).transpose(1, 2)).transpose(1, 2)
        return x + self.drop(self.down(torch.nn.functional.gelu(u)))


class MixedModel(torch.nn.Module):
    """``model(input_ids, labels) -> .loss``: token embeddings, mixed blocks, a head."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(MixedBlock(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> _Out:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _Out(loss, logits)


def cnn(**kwargs) -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN(**kwargs)


class HostRandomCNN(SmallCNN):
    """The small CNN drawing in forward from the host's generators, before its first stage, as
    Wav2Vec2's SpecAugment draws from NumPy's: a NumPy mask over the images' rows, and a scale
    chosen by Python's `random`."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> _Out:
        rows = torch.from_numpy(numpy.random.rand(images.shape[-2]) < 0.8).to(images.dtype)
        scale = 0.5 if random.random() < 0.5 else 1.0
        return super().forward(images * rows[:, None] * scale, labels)


def host_random_cnn(**kwargs) -> HostRandomCNN:
    torch.manual_seed(0)
    return HostRandomCNN(**kwargs)


def image_batch(batch: int = 4, size: int = 16, classes: int = 10, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randn(batch, 3, size, size, generator=gen),
        "labels": torch.randint(0, classes, (batch,), generator=gen),
    }


def mixed(**kwargs) -> MixedModel:
    torch.manual_seed(0)
    return MixedModel(**kwargs)


def mixed_batch(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 1) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Everything a training step leaves behind, by value: parameters, gradients, buffers
    (running statistics and counters), the RNG state and the optimizer's state."""
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "host_rng": (random.getstate(), numpy.random.get_state()),
    }
    if optimizer is not None:
        state["optimizer"] = {
            (i, k): v.detach().clone()
            for i, s in enumerate(optimizer.state.values())
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        }
    return state


def assert_same_state(got: dict, expected: dict) -> None:
    """Two `training_state`s equal bit for bit, part by part."""
    assert got.keys() == expected.keys()
    for part in expected:
        if part == "rng":
            assert torch.equal(got["rng"], expected["rng"]), "RNG state differs"
            continue
        if part == "host_rng":
            (python, numpy_got), (python_expected, numpy_expected) = got[part], expected[part]
            assert python == python_expected, "Python's random state differs"
            assert all(numpy.array_equal(a, b) for a, b in zip(numpy_got, numpy_expected)), "NumPy's state differs"
            continue
        assert got[part].keys() == expected[part].keys(), part
        bad = [k for k in expected[part] if not torch.equal(got[part][k], expected[part][k])]
        assert not bad, f"{part} differ: {bad[:4]}"


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a small trainable low-rank update."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def tiny_lora(**overrides) -> torch.nn.Module:
    """The tiny transformer with every weight frozen (embeddings too) and LoRA adapters
    on the attention and MLP projections of each block: only the adapters train."""
    model = tiny(**overrides)
    model.requires_grad_(False)
    torch.manual_seed(1)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
        block.attn.proj = LoRALinear(block.attn.proj)
        block.mlp[0] = LoRALinear(block.mlp[0])
        block.mlp[2] = LoRALinear(block.mlp[2])
    return model


def budget_between(make, batch: dict, fraction: float) -> tuple[int, int]:
    """(budget, unmanaged peak): a budget `fraction` of the way from the peak with every block
    CHECKPOINT to the unmanaged peak, each measured on a fresh `make()`."""
    low = measure_peak(make(), lambda: batch, mode=Mode.CHECKPOINT)
    high = measure_peak(make(), lambda: batch)
    return int(low + fraction * (high - low)), high


def int8_codes(t: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """COMPRESS's int8 codes as the codec defines them, op by op on the CPU in fp32, over `t`'s
    values in index order: per group, scale = largest magnitude / 127 (at least fp32's tiny),
    code = value / scale rounded half to even, clamped to [-127, 127]."""
    flat = t.detach().cpu().float().reshape(-1)
    groups = torch.nn.functional.pad(flat, (0, (-flat.numel()) % group_size)).view(-1, group_size)
    scales = groups.abs().amax(1, keepdim=True).div(127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (groups / scales).round().clamp(-127, 127).to(torch.int8), scales


class TickingProbe(SimulatedProbe):
    """The stand-in's probe on a clock that moves one tick a reading: the same steps time alike in
    every run, however loaded the machine, so two runs plan alike."""

    def __init__(self, device: SimulatedDevice) -> None:
        super().__init__(device)
        self.ticks = 0.0

    def mark(self) -> float:
        self.ticks += 1e-3
        return self.ticks
