"""How long can each method go? The longest trainable sequence on one fixed stand-in device.

    python -m stress.headroom                       # vocab 32000 and 128256 (long: real steps at long lengths)
    python -m stress.headroom --vocab 32000 --device-mib 600
    python -m stress.headroom --json runs/headroom.json
    python -m stress.headroom --device cuda         # the same devices' sizes, on a GPU's allocator

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

With `--device cuda` the device is a real GPU cut to the same size by
`torch.cuda.set_per_process_memory_fraction`: PyTorch's caching allocator raises out-of-memory
past it (its reserved bytes, so fragmentation counts), adaptmem reads the cut as the device's
capacity, and the CUDA context lies outside it. Each run starts from an emptied cache. The
offloading peer copies what autograd saves to pageable host memory and back.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
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


def build(vocab: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return small_llama(vocab, layers=8, max_positions=1 << 17).to(dtype)


def batch(vocab: int, length: int, device: str = "cpu", seed: int = 0) -> dict:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length + seed)).to(device)
    return {"input_ids": ids, "labels": ids}


def _to_host(t: torch.Tensor):
    with host_allocations():
        return t.detach().clone()


def _cuda_to_host(t: torch.Tensor):
    return t.device, t.detach().to("cpu")


def _cuda_back(packed) -> torch.Tensor:
    device, t = packed
    return t.to(device)


def cap_cuda(capacity: int) -> None:
    """The GPU cut to `capacity` bytes for this process (each `Run` empties the cache first)."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if capacity > total:
        raise SystemExit(f"--device-mib: {format_bytes(capacity)} is more than the GPU's {format_bytes(total)}")
    torch.cuda.set_per_process_memory_fraction(capacity / total)


class Run:
    """One method's model, optimizer and device: a stand-in of `capacity` bytes, or the GPU
    (already cut to it by `cap_cuda`)."""

    def __init__(self, method: str, vocab: int, capacity: int, device: str = "cpu", dtype=torch.float32) -> None:
        self.method, self.vocab, self.device = method, vocab, device
        self.seed = 0  # of the tokens, with the length
        self.model = build(vocab, dtype)
        if method.startswith("hf_gc"):
            hf_checkpointing(self.model, True)
        self.model.train()
        if device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            self.dev = contextlib.nullcontext()
            self.model.to(device)
            self.hooks = (_cuda_to_host, _cuda_back)
        else:
            self.dev = SimulatedDevice(capacity)
            self.dev.track(self.model)
            self.hooks = (_to_host, lambda t: t)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.mem = None
        if method == "adaptmem":
            self.mem = adaptmem.manage(self.model, device=None if device == "cuda" else self.dev)

    def step(self, length: int) -> float:
        data = batch(self.vocab, length, self.device, self.seed)
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with self.dev:
            if self.mem is not None:
                self.mem.run_step(lambda: self.model(**data).loss.backward())
            elif self.method == "hf_gc_offload":
                with torch.autograd.graph.saved_tensors_hooks(*self.hooks):
                    loss = self.model(**data).loss
                loss.backward()
            else:
                self.model(**data).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        if self.mem is not None:
            self.mem.close()


def trains(method: str, vocab: int, capacity: int, length: int, device: str = "cpu", dtype=torch.float32) -> bool:
    run = Run(method, vocab, capacity, device, dtype)
    try:
        for _ in range(STEPS):
            run.step(length)
        return True
    except torch.OutOfMemoryError:  # StepOutOfMemoryError is one too
        return False
    finally:
        run.close()


def longest(
    method: str, vocab: int, capacity: int, start: int = 256, device: str = "cpu", limit: int = 0, dtype=torch.float32
) -> int:
    """The longest multiple of GRAIN that trains, to within PRECISION (0: not even GRAIN).
    With a `limit`, no length past it is tried: a method that trains it reads as `limit`."""
    return search(lambda length: trains(method, vocab, capacity, length, device, dtype), method, start, limit)


def search(trial: Callable[[int], bool], label: str, start: int = 256, limit: int = 0, say=log) -> int:
    """The longest multiple of GRAIN at which `trial(length)` is true, doubling from `start` and
    bisecting back to within PRECISION; `limit` caps the lengths tried."""
    low, high = 0, max(GRAIN, start)
    while trial(high):
        say(f"  {label}: {high} trains")
        if limit and high >= limit:
            return high
        low, high = high, min(high * 2, limit) if limit else high * 2
    say(f"  {label}: {high} does not")
    while high - low > GRAIN and high > low * PRECISION:
        mid = (low + high) // 2 // GRAIN * GRAIN
        ok = trial(mid)
        say(f"  {label}: {mid} {'trains' if ok else 'does not'}")
        low, high = (mid, high) if ok else (low, mid)
    return low


def paired_time(
    vocab: int, capacity: int, length: int, rounds: int = 3, device: str = "cpu", dtype=torch.float32
) -> float:
    """adaptmem's step time over hf_gc's at `length`: the median of per-round ratios, after a warm-up.

    On the stand-in both runs live at once, each on its own device, and the rounds interleave.
    A GPU has room for one: each method's steps run in turn, the first run freed before the next."""
    methods = ("hf_gc", "adaptmem")
    if device == "cuda":
        times = {}
        for m in methods:
            run = Run(m, vocab, capacity, device, dtype)
            try:
                for _ in range(STEPS):
                    run.step(length)
                times[m] = [run.step(length) for _ in range(rounds)]
            finally:
                run.close()
                del run
        return statistics.median(a / h for a, h in zip(times["adaptmem"], times["hf_gc"]))
    return interleaved({m: Run(m, vocab, capacity, device, dtype) for m in methods}, length, rounds)


def interleaved(runs: dict, length: int, rounds: int) -> float:
    """The median over `rounds` of adaptmem's step time over hf_gc's at `length`, the two runs'
    steps interleaved after `STEPS` warm-up steps each; the runs are closed after."""
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


def summary(where: str, row: dict, limit: int = 0) -> str:
    """A result row as one line: each method's longest length, and adaptmem against hf_gc's."""
    found = row["longest"]
    line = f"{where}: " + ", ".join(f"{m} {'at least ' if limit and n >= limit else ''}{n:,}" for m, n in found.items())
    if "vs_hf_gc" in row:
        line += (
            f"; adaptmem {row['vs_hf_gc']:.2f}x hf_gc's length, its step {row['time_at_hf_gc_longest']:.2f}x "
            f"hf_gc's at {found['hf_gc']:,}"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=sorted(DEVICE_MIB))
    parser.add_argument("--device-mib", type=int, default=None, help="the stand-in's size (default: per vocab)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: the stand-in; cuda: a GPU cut to size"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's weights")
    parser.add_argument("--limit", type=int, default=0, help="the longest length tried (default: none)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype = getattr(torch, args.dtype)
    results = []
    for vocab in args.vocab:
        capacity = (args.device_mib or DEVICE_MIB.get(vocab, 1024)) * 2**20
        where = "a GPU cut to" if args.device == "cuda" else "a stand-in of"
        log(f"[vocab {vocab}, {args.dtype}, on {where} {format_bytes(capacity)}]")
        if args.device == "cuda":
            cap_cuda(capacity)
        found = {
            m: longest(m, vocab, capacity, device=args.device, limit=args.limit, dtype=dtype) for m in args.methods
        }
        row = {"vocab": vocab, "device": args.device, "dtype": args.dtype, "device_bytes": capacity, "longest": found}
        if args.limit:
            row["limit"] = args.limit
        if "hf_gc" in found and "adaptmem" in found and found["hf_gc"]:
            row["vs_hf_gc"] = found["adaptmem"] / found["hf_gc"]
            row["time_at_hf_gc_longest"] = paired_time(vocab, capacity, found["hf_gc"], device=args.device, dtype=dtype)
        results.append(row)
        print(summary(f"vocab {vocab}, device {format_bytes(capacity)}", row, args.limit), flush=True)
        if args.json:  # after each vocabulary: a long run cut short keeps what it found
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
