"""COMPRESS's Triton codec on a GPU: the host's time per tensor each way, launched directly
against through Triton's ``kernel[grid](...)``, and the device's time, side by side.

    python -m stress.bench_codec                   # bf16, 1 MiB and 32 MiB tensors, 200 calls, 7 rounds
    python -m stress.bench_codec --sizes 0.25,4 --dtype float32

Host time is what a call takes to return (the kernels queue behind it; the step's own
work does not wait on them), per encode and per decode, the median over rounds with
the interval over them; rounds alternate the two launches. Device time is from CUDA
events around each batch of calls. Needs a CUDA device and Triton.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from adaptmem.strategies import codec_triton

try:
    from stress.verdicts import interval
except ImportError:  # run as a script
    from verdicts import interval


def one_round(tensors: list[torch.Tensor], direct: bool) -> tuple[float, float, float]:
    """Host seconds per encode and per decode, and device seconds per round trip."""
    codec_triton._Launch.direct = direct
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    encoded = [codec_triton.encode(t, 64) for t in tensors]
    t1 = time.perf_counter()
    for t, (codes, scales) in zip(tensors, encoded):
        codec_triton.decode(codes, scales, t.dtype, t.numel())
    t2 = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    n = len(tensors)
    return (t1 - t0) / n, (t2 - t1) / n, start.elapsed_time(end) / 1e3 / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,32", help="tensor sizes in MiB, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--calls", type=int, default=200, help="tensors per round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not codec_triton.AVAILABLE:
        print("stress.bench_codec needs a CUDA device and Triton", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    for mib in (float(s) for s in args.sizes.split(",")):
        n = int(mib * 2**20) // dtype.itemsize
        count = max(4, min(args.calls, int(2**30 // max(n * dtype.itemsize, 1))))  # at most 1 GiB each round
        tensors = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(count)]
        one_round(tensors[:2], True)  # compiles, and leaves a launcher to call directly
        rows: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for r in range(args.rounds):
            for direct in (True, False) if r % 2 == 0 else (False, True):
                rows[direct].append(one_round(tensors, direct))
        codec_triton._Launch.direct = True
        print(f"{mib:g} MiB of {args.dtype} ({count} tensors a round, {args.rounds} rounds):")
        for direct, label in ((True, "direct launch"), (False, "Triton's launch")):
            enc, dec, dev = (statistics.median(c) * 1e6 for c in zip(*rows[direct]))
            print(f"  {label:16s} host encode {enc:6.1f} us, decode {dec:6.1f} us; device round trip {dev:7.1f} us")
        ratio = [(a[0] + a[1]) / (b[0] + b[1]) for a, b in zip(rows[True], rows[False])]
        low, high = interval(ratio)
        print(f"  host time, direct / Triton's: {statistics.median(ratio):.2f} [{low:.2f}, {high:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
