"""How long can each method go? The longest trainable sequence on one fixed stand-in device.

    python -m stress.headroom                       # vocab 32000 and 128256 (long: real steps at long lengths)
    python -m stress.headroom --vocab 32000 --device-mib 600
    python -m stress.headroom --json runs/headroom.json

A Llama from a config (8 layers, hidden 256, intermediate 688, 8 heads, 4 kv heads; random
weights), batch 1, AdamW. For each method, a length trains when a fresh model and optimizer
on a `SimulatedDevice` of the given size run `STEPS` training steps at it (forward, backward,
optimizer step; the second and later with the optimizer's state on the device) with no
out-of-memory error (adaptmem: none that `run_step` could not retry). The longest is found by
doubling from 256 tokens and bisecting back to a multiple of 64, to within 5% (a probe at 16k
tokens is minutes of CPU). Methods:

  unmanaged        every activation and the whole logits kept
  hf_gc            the model's own gradient_checkpointing_enable()
  hf_gc_offload    the same, with every tensor autograd saves (the checkpoints' inputs, the
                   head's) copied to host memory: the offloaded-checkpointing peer
  adaptmem         adaptmem.manage(model) with its default policy and budget

and, at hf_gc's longest length, adaptmem's step time against hf_gc's (median of paired
steps, both on the stand-in).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.demo.longest import hf_checkpointing
from adaptmem.devices.tiers import host_allocations
from adaptmem.testing import SimulatedDevice
from stress.benchkit import log, small_llama

METHODS = ("unmanaged", "hf_gc", "hf_gc_offload", "adaptmem")
STEPS = 3
GRAIN = 64
PRECISION = 1.05  # the bisection stops once the failing length is within 5% of the training one
DEVICE_MIB = {32000: 640, 128256: 1600}  # fixed per vocabulary: room for the weights and AdamW state


def build(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return small_llama(vocab, layers=8, max_positions=1 << 17)


def batch(vocab: int, length: int) -> dict:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def _to_host(t: torch.Tensor):
    with host_allocations():
        return t.detach().clone()


class Run:
    """One method's model, optimizer and stand-in device."""

    def __init__(self, method: str, vocab: int, capacity: int) -> None:
        self.method, self.vocab = method, vocab
        self.model = build(vocab)
        if method.startswith("hf_gc"):
            hf_checkpointing(self.model, True)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.dev = SimulatedDevice(capacity)
        self.dev.track(self.model)
        self.mem = adaptmem.manage(self.model, device=self.dev) if method == "adaptmem" else None

    def step(self, length: int) -> float:
        data = batch(self.vocab, length)
        start = time.perf_counter()
        with self.dev:
            if self.mem is not None:
                self.mem.run_step(lambda: self.model(**data).loss.backward())
            elif self.method == "hf_gc_offload":
                with torch.autograd.graph.saved_tensors_hooks(_to_host, lambda t: t):
                    loss = self.model(**data).loss
                loss.backward()
            else:
                self.model(**data).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.mem is not None:
            self.mem.close()


def trains(method: str, vocab: int, capacity: int, length: int) -> bool:
    run = Run(method, vocab, capacity)
    try:
        for _ in range(STEPS):
            run.step(length)
        return True
    except torch.OutOfMemoryError:  # StepOutOfMemoryError is one too
        return False
    finally:
        run.close()


def longest(method: str, vocab: int, capacity: int, start: int = 256) -> int:
    """The longest multiple of GRAIN that trains, to within PRECISION (0: not even GRAIN)."""
    low, high = 0, max(GRAIN, start)
    while trains(method, vocab, capacity, high):
        log(f"  {method}: {high} trains")
        low, high = high, high * 2
    log(f"  {method}: {high} does not")
    while high - low > GRAIN and high > low * PRECISION:
        mid = (low + high) // 2 // GRAIN * GRAIN
        ok = trains(method, vocab, capacity, mid)
        log(f"  {method}: {mid} {'trains' if ok else 'does not'}")
        low, high = (mid, high) if ok else (low, mid)
    return low


def paired_time(vocab: int, capacity: int, length: int, rounds: int = 3) -> float:
    """adaptmem's step time over hf_gc's at `length`: the median of per-round ratios, after a warm-up."""
    runs = {m: Run(m, vocab, capacity) for m in ("hf_gc", "adaptmem")}
    try:
        for run in runs.values():
            for _ in range(STEPS):
                run.step(length)
        ratios = []
        for _ in range(rounds):
            t = {m: run.step(length) for m, run in runs.items()}
            ratios.append(t["adaptmem"] / t["hf_gc"])
        return statistics.median(ratios)
    finally:
        for run in runs.values():
            run.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=sorted(DEVICE_MIB))
    parser.add_argument("--device-mib", type=int, default=None, help="the stand-in's size (default: per vocab)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for vocab in args.vocab:
        capacity = (args.device_mib or DEVICE_MIB.get(vocab, 1024)) * 2**20
        log(f"[vocab {vocab} on a {format_bytes(capacity)} stand-in]")
        found = {m: longest(m, vocab, capacity) for m in args.methods}
        row = {"vocab": vocab, "device_bytes": capacity, "longest": found}
        if "hf_gc" in found and "adaptmem" in found and found["hf_gc"]:
            row["vs_hf_gc"] = found["adaptmem"] / found["hf_gc"]
            row["time_at_hf_gc_longest"] = paired_time(vocab, capacity, found["hf_gc"])
        results.append(row)
        print(
            f"vocab {vocab}, device {format_bytes(capacity)}: "
            + ", ".join(f"{m} {n:,}" for m, n in found.items())
            + (
                f"; adaptmem {row['vs_hf_gc']:.2f}x hf_gc's length, its step {row['time_at_hf_gc_longest']:.2f}x "
                f"hf_gc's at {found['hf_gc']:,}"
                if "vs_hf_gc" in row
                else ""
            ),
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
