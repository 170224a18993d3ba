"""Where a CUDA step's time goes under a mode: compute, copies out and back, and their overlap.

    python -m stress.profile_offload                          # OFFLOAD, Llama 1b shape, batch 4 x 2048
    python -m stress.profile_offload --mode CHECKPOINT+OFFLOAD --batch 1
    python -m stress.profile_offload --preset small --layers 4 --seq 512 --trace trace.json

Profiles one step (after warm-up) with `torch.profiler` and reads its trace:
the step's wall time, the compute stream's busy time, each copy direction's
bytes, time and bandwidth, and how much of the copies' time had compute
running beside it (on another stream). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import adaptmem
from adaptmem import Mode
from stress.bench_modes import PRESETS, build, link_gbps, one_step


def busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, merged and sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    """How much of `interval` the merged `union` covers."""
    a, b = interval
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


def summarize(events: list[dict]) -> dict:
    """Compute busy time, per-direction copy bytes/time/bandwidth and overlap, from a Chrome trace."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    compute = busy([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    out = {"compute_ms": sum(b - a for a, b in compute) / 1e3, "kernels": len(kernels)}
    beside: dict = {}  # a stream -> the union of kernels on every other stream

    def others(stream: object) -> list[tuple[float, float]]:
        if stream not in beside:
            beside[stream] = busy([(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["args"].get("stream") != stream])
        return beside[stream]

    for key, tag in (("d2h", "DtoH"), ("h2d", "HtoD")):
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and tag in e.get("name", "")]
        secs = sum(c["dur"] for c in copies) / 1e6
        nbytes = sum(c["args"].get("bytes", 0) for c in copies)
        hidden = sum(covered((c["ts"], c["ts"] + c["dur"]), others(c["args"].get("stream"))) for c in copies) / 1e6
        out[key] = {
            "copies": len(copies),
            "bytes": nbytes,
            "ms": secs * 1e3,
            "gbps": nbytes / secs / 1e9 if secs else 0.0,
            "overlapped": hidden / secs if secs else 0.0,
            "pageable": sum("Pageable" in c.get("name", "") for c in copies),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="OFFLOAD")
    p.add_argument("--preset", choices=list(PRESETS), default="1b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trace", type=Path, default=None, help="also keep the Chrome trace here")
    p.add_argument("--top", type=int, default=0, help="also print the N ops taking the most device time")
    p.add_argument(
        "--codec",
        choices=["auto", "off", "on", "triton"],
        default="auto",
        help="COMPRESS's codec (CompressOptions.compile): the default (Triton's kernels where they run, else "
        "eager ops), eager ops, compiled by torch.compile, or Triton's kernels",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("stress.profile_offload needs a CUDA device", file=sys.stderr)
        return 2
    if args.layers:
        PRESETS[args.preset] = dict(PRESETS[args.preset], num_hidden_layers=args.layers)
    model = build(args.preset, args.vocab, "cuda", torch.bfloat16)
    handles = adaptmem.instrument(model, mode=Mode.parse(args.mode))
    for h in handles:
        h.compress_options = replace(h.compress_options, compile=args.codec)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    d2h, h2d = link_gbps()
    for _ in range(args.warmup):
        one_step(model, ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    one_step(model, ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step(model, ids)
        torch.cuda.synchronize()
    trace = args.trace or Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    s = summarize(json.loads(trace.read_text())["traceEvents"])
    s.update(
        mode=args.mode, batch=args.batch, seq=args.seq, blocks=len(handles), step_ms=wall * 1e3, link_gbps=[d2h, h2d]
    )
    print(json.dumps(s, indent=1))
    if args.top:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top))
    label = args.mode + (f" (codec {args.codec})" if args.codec != "auto" else "")
    print(f"{label}: step {wall * 1e3:.1f} ms (unprofiled); compute stream busy {s['compute_ms']:.1f} ms")
    for key in ("d2h", "h2d"):
        c = s[key]
        print(
            f"  {key}: {c['copies']} copies, {c['bytes'] / 2**30:.2f} GiB in {c['ms']:.1f} ms "
            f"({c['gbps']:.1f} GB/s; a lone pinned copy: {s['link_gbps'][key == 'h2d']:.1f}), "
            f"{c['overlapped']:.0%} of it beside compute, {c['pageable']} pageable"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
