"""A small GPT-style language model, embedded so the demo and tests need no download.

Pre-norm blocks with a fused QKV projection (so saved tensors include strided
views), dropout in attention and MLP, and either PyTorch's SDPA or an explicit
softmax attention that materializes the score matrix (quadratic in sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 6
    n_heads: int = 4
    mlp_ratio: int = 4
    max_seq: int = 2048
    dropout: float = 0.1
    attention: str = "sdpa"  # "sdpa" or "eager"

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"TinyConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"TinyConfig.attention must be 'sdpa' or 'eager', got {self.attention!r}")


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.cfg.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in (q, k, v))
        if self.cfg.attention == "sdpa":
            p = self.cfg.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            y = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1)) @ v
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """``model(input_ids, labels=None) -> LMOutput(loss, logits)``."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        s = input_ids.shape[1]
        if s > self.cfg.max_seq:
            raise ValueError(f"sequence of {s} tokens exceeds TinyConfig.max_seq={self.cfg.max_seq}")
        pos = torch.arange(s, device=input_ids.device)
        x = self.drop(self.embed(input_ids) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return LMOutput(loss, logits)


def random_batch(cfg: TinyConfig, batch: int, seq: int, *, generator: torch.Generator | None = None) -> dict:
    """Token ids to train on: ``{"input_ids": ..., "labels": ...}``."""
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}
