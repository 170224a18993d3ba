"""The loss head's two chunked variants, and the kept head, side by side in one run.

    python -m stress.head_variants                      # tokens 4096, hidden 512, vocab 32000
    python -m stress.head_variants --tokens 2048 --vocab 128256 --chunk 512

Each variant computes ``cross_entropy(linear(hidden, weight), labels)`` and its
gradients: `kept` makes the whole logits (the model's own code); `grads in forward`
takes each chunk's gradients while its logits exist (three matmuls per chunk);
`recomputed` makes each chunk again in backward (four). Peaks come from a
`SimulatedDevice` in a separate pass (bytes above the inputs, weights and their
gradients, the inputs' gradients included); times are medians of alternating rounds, one torch thread, taken without
it. The chunked head uses `grads in forward` for sums and means because of what this
prints: the same peak, about a quarter less time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from adaptmem.config.units import format_bytes
from adaptmem.strategies.head import LossSpec, chunked_cross_entropy
from adaptmem.testing import SimulatedDevice


def variants(chunk: int) -> dict:
    spec = LossSpec((), chunk=chunk)
    return {
        "kept": lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
        "grads in forward": lambda h, w, t: chunked_cross_entropy(h, w, None, t, spec, recompute=False),
        "recomputed": lambda h, w, t: chunked_cross_entropy(h, w, None, t, spec, recompute=True),
    }


def run(fn, h, w, t) -> None:
    h.grad = w.grad = None
    fn(h, w, t).backward()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,))
    table = variants(args.chunk)
    peaks = {}
    for name, fn in table.items():
        run(fn, h, w, t)  # gradients allocated, as in a step after the first
        with SimulatedDevice() as dev:
            base = dev.allocated_bytes
            dev.reset_peak()
            run(fn, h, w, t)
            peaks[name] = dev.peak_bytes - base
    times: dict[str, list[float]] = {name: [] for name in table}
    for r in range(args.rounds):
        for name in list(table)[r % len(table) :] + list(table)[: r % len(table)]:
            start = time.process_time()
            run(table[name], h, w, t)
            times[name].append(time.process_time() - start)
    kept = statistics.median(times["kept"])
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, chunk {args.chunk}")
    print(f"{'variant':<18} {'peak above inputs':>18} {'time':>9} {'vs kept':>8}")
    out = {}
    for name in table:
        median = statistics.median(times[name])
        out[name] = {"peak_bytes": peaks[name], "seconds": median}
        print(f"{name:<18} {format_bytes(peaks[name]):>18} {median:8.3f}s {median / kept:7.2f}x")
    return out


if __name__ == "__main__":
    main()
