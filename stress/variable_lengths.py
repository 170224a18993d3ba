"""Variable lengths, the case adaptivity exists for: a long-tailed stream of batches on one fixed stand-in.

    python -m stress.variable_lengths                  # 24 batches of 128..3072 tokens, two passes each
    python -m stress.variable_lengths --batches 12 --passes 1 --json runs/lengths.json

A Mistral from a config (4 layers, hidden 256, intermediate 688, vocab 32000; random weights),
batch 1, AdamW, on a `SimulatedDevice` sized so that HF gradient checkpointing's longest is
`HF_LONGEST` tokens (its peak there, optimizer state resident, plus 2%). The lengths are
long-tailed: most batches short, a few up to `--top`, in one fixed order. Methods:

  hf_gc      the model's own gradient checkpointing; a batch that runs out of memory is
             skipped (what its user must truncate or drop)
  adaptmem   adaptmem.manage(model) with its default policy; a batch it cannot fit counts as failed

Each method runs the stream `--passes` times, alternating (hf_gc, adaptmem, hf_gc, ...), each
pass on a fresh model. Reported: batches trained and failed per method, and adaptmem's tokens
per second over HF's on the batches both trained (total tokens over total step seconds).
Targets: adaptmem trains every batch, at >= 1.15x HF's tokens per second.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.demo.longest import hf_checkpointing
from adaptmem.testing import SimulatedDevice

VOCAB = 32000
HF_LONGEST = 768
TARGET = 1.15


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 15,
                        sliding_window=None, use_cache=False)
    return MistralForCausalLM(cfg)


def batch(length: int, seed: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def stream(count: int, top: int, seed: int = 0) -> list[int]:
    """`count` lengths from 128 to `top` (multiples of 64), most short: 128 x (top/128)^(u^3) for
    uniform u, with the longest among them once."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [max(128, int(128 * (top / 128) ** (torch.rand((), generator=gen).item() ** 3)) // 64 * 64)
               for _ in range(count)]
    lengths[count // 2] = top
    return lengths


class Method:
    """One pass of one method: a fresh model, optimizer and stand-in of `capacity` bytes."""

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name = name
        self.model = build()
        self.model.train()
        if name == "hf_gc":
            hf_checkpointing(self.model, True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.dev = SimulatedDevice(capacity)
        self.dev.track(self.model)
        self.mem = adaptmem.manage(self.model, device=self.dev) if name == "adaptmem" else None

    def step(self, data: dict) -> float | None:
        """Seconds of one training step, or None when it ran out of memory."""
        start = time.perf_counter()
        try:
            with self.dev:
                if self.mem is not None:
                    self.mem.run_step(lambda: self.model(**data).loss.backward())
                else:
                    self.model(**data).loss.backward()
                self.opt.step()
        except torch.OutOfMemoryError:  # StepOutOfMemoryError is one
            return None
        finally:
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.mem is not None:
            self.mem.close()


def device_for_hf(length: int) -> int:
    """A stand-in size where HF gradient checkpointing's longest is `length`: its peak there, plus 2%."""
    run = Method("hf_gc", None)
    for _ in range(2):  # the second with the optimizer's state resident
        run.step(batch(length, 0))
    return int(run.dev.peak_bytes * 1.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--top", type=int, default=3072, help="the longest batch (tokens)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("adaptmem").setLevel(logging.ERROR)  # the skipped batches run out of memory on purpose
    capacity = device_for_hf(HF_LONGEST)
    lengths = stream(args.batches, args.top)
    log(f"stand-in of {format_bytes(capacity)}; lengths {lengths}")
    seconds: dict[str, list[list[float | None]]] = {"hf_gc": [], "adaptmem": []}
    for p in range(args.passes):
        for name in ("hf_gc", "adaptmem"):
            run = Method(name, capacity)
            began = time.perf_counter()
            seconds[name].append([run.step(batch(n, i)) for i, n in enumerate(lengths)])
            run.close()
            log(f"  pass {p + 1} {name}: {time.perf_counter() - began:.0f} s")
    both = [i for i in range(len(lengths)) if all(s[i] is not None for runs in seconds.values() for s in runs)]
    tokens = sum(lengths[i] for i in both)
    rate = {name: tokens * len(runs) / sum(s[i] for s in runs for i in both) for name, runs in seconds.items()}
    failed = {name: sum(s[i] is None for s in runs for i in range(len(lengths))) // len(runs)
              for name, runs in seconds.items()}
    ratio = rate["adaptmem"] / rate["hf_gc"]
    met = failed["adaptmem"] == 0 and ratio >= TARGET
    print(f"{len(lengths)} batches of {min(lengths)}..{max(lengths)} tokens on a {format_bytes(capacity)} stand-in "
          f"(HF gradient checkpointing's longest: {HF_LONGEST}):")
    for name in seconds:
        print(f"  {name:<9} trained {len(lengths) - failed[name]:>2} of {len(lengths)}, "
              f"{rate[name]:,.0f} tokens/s on the {len(both)} batches both trained")
    print(f"  adaptmem / hf_gc tokens per second: {ratio:.2f}x  {'ok' if met else 'MISSED'} "
          f"(target: every batch, >= {TARGET}x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device_bytes": capacity, "lengths": lengths, "failed": failed,
                                         "tokens_per_s": rate, "ratio": ratio, "met": met}, indent=2))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
