"""`python -m adaptmem.demo modes`: every mode on a small transformer, side by side.

Runs one training step per mode on the embedded `TinyTransformer` (no GPU, no
download) and prints peak device bytes (on a `SimulatedDevice`), host bytes,
step time, and whether the gradients equal those of NONE bit for bit.

Memory and time come from separate runs: the stand-in intercepts every op,
which slows a step, so times are taken without it, every mode alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch
from adaptmem.devices.simulated import SimulatedDevice
from adaptmem.modes import ALLOWED_MODES, Mode


@dataclass
class Row:
    mode: Mode
    peak: int
    host: int
    seconds: float
    exact: bool
    cosine: float


def _step(model: torch.nn.Module, batch: dict, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def measure(mode: Mode, cfg: TinyConfig, batch: dict, repeats: int, reference: dict | None):
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    adaptmem.instrument(model, mode=mode, head=None)  # the table is of the blocks' modes: the head stays whole
    with SimulatedDevice() as dev:
        _step(model, batch, seed=1)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _step(model, batch, seed=1)
        times.append(time.perf_counter() - start)
    exact, cosine = True, 1.0
    if reference is not None:
        exact = all(torch.equal(grads[n], reference[n]) for n in reference)
        cosine = min(
            torch.nn.functional.cosine_similarity(grads[n].flatten(), reference[n].flatten(), dim=0).item()
            for n in reference
        )
    return Row(mode, dev.peak_bytes, dev.host_peak_bytes, statistics.median(times), exact, cosine), grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode (median shown)")
    args = parser.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = TinyConfig(dim=args.dim, n_layers=args.layers, n_heads=max(1, args.dim // 64), max_seq=max(2048, args.seq))
    batch = random_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(0))
    print(
        f"adaptmem demo: TinyTransformer ({args.layers} blocks, dim {args.dim}), batch {args.batch} x "
        f"{args.seq} tokens, one training step per mode on the CPU.\n"
        "Peak device bytes are counted by adaptmem.testing.SimulatedDevice; times are medians of "
        f"{args.repeats} steps taken without it.\n"
    )
    header = (
        f"{'mode':<20} {'peak device':>12} {'vs NONE':>8} {'host':>11} {'step':>9} {'vs NONE':>8}  gradients vs NONE"
    )
    print(header)
    print("-" * len(header))
    reference, base = None, None
    for mode in ALLOWED_MODES:
        row, grads = measure(mode, cfg, batch, args.repeats, reference)
        if reference is None:
            reference, base = grads, row
        verdict = "bit-identical" if row.exact else f"lossy, min cosine {row.cosine:.5f}"
        print(
            f"{mode.label:<20} {format_bytes(row.peak):>12} {row.peak / base.peak:>8.1%} "
            f"{format_bytes(row.host):>11} {row.seconds * 1e3:>7.0f}ms {row.seconds / base.seconds:>8.2f}x  {verdict}",
            flush=True,
        )
    print(
        "\nEach block can switch mode at any forward: handles = adaptmem.instrument(model); "
        "handles[i].mode = Mode.CHECKPOINT"
    )
    return 0
