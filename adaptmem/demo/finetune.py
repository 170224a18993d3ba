"""`python -m adaptmem.demo`: a fine-tune under memory pressure, on the CPU.

The embedded `TinyTransformer` learns a synthetic task whose sequence lengths
change from batch to batch, on a `SimulatedDevice` too small for it: unmanaged,
the first long batch runs out of memory. Under `adaptmem.manage` each batch
gets a plan for the memory actually free; halfway through, "another process"
takes a share of the device for a while, and the budget follows. Every step
prints its plan and peak; the decision log is written as JSONL.

`python -m adaptmem.demo modes` prints the per-mode table instead (`table.py`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.control.measure import measure_peak
from adaptmem.demo.tiny import TinyConfig, TinyTransformer
from adaptmem.devices.simulated import SimulatedDevice

SHORT = {"NONE": "none", "SELECTIVE": "sel", "CHECKPOINT": "ckpt", "OFFLOAD": "off",
         "COMPRESS": "cmp", "CHECKPOINT+OFFLOAD": "ckpt+off", "COMPRESS+OFFLOAD": "cmp+off"}


def make_batch(cfg: TinyConfig, batch: int, seq: int, gen: torch.Generator) -> dict:
    """Rows that count up from a random start (mod the vocabulary): learnable in a few
    dozen steps, so the loss visibly falls."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    ids = (start + torch.arange(seq)) % cfg.vocab_size
    return {"input_ids": ids, "labels": ids}


def lengths(steps: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    """Mostly short batches with long ones mixed in, as in long-context fine-tuning."""
    out = []
    for i in range(steps):
        long = torch.rand((), generator=gen).item() < 0.35 or i in (1, 2)
        top = high if long else max(low, high // 3)
        out.append(int(torch.randint(low // 64, top // 64 + 1, (), generator=gen)) * 64)
    return out


def plan_text(counts: dict) -> str:
    return " ".join(f"{SHORT.get(m, m)}x{n}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-seq", type=int, default=768)
    parser.add_argument("--device-share", type=float, default=0.5,
                        help="simulated device size, as a share of the unmanaged peak at the longest batch")
    parser.add_argument("--policy", default="balanced")
    parser.add_argument("--log", default="runs/demo.jsonl")
    opts = parser.parse_args(args)

    torch.manual_seed(0)
    cfg = TinyConfig(dim=opts.dim, n_layers=opts.layers, n_heads=max(1, opts.dim // 64), vocab_size=256,
                     max_seq=max(2048, opts.max_seq), attention="eager")
    model = TinyTransformer(cfg)
    gen = torch.Generator().manual_seed(1)
    seqs = lengths(opts.steps, 64, opts.max_seq, gen)
    batches = [make_batch(cfg, opts.batch, s, gen) for s in seqs]
    longest = make_batch(cfg, opts.batch, opts.max_seq, gen)
    worst = measure_peak(model, lambda: longest)
    capacity = int(worst * opts.device_share)
    print(f"adaptmem demo: fine-tuning a {opts.layers}-block transformer (dim {opts.dim}) on batches of "
          f"{opts.batch} x 64..{opts.max_seq} tokens,\non a simulated device of {format_bytes(capacity)} "
          f"(unmanaged, the longest batch needs {format_bytes(worst)}).\n")

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    dev = SimulatedDevice(capacity_bytes=capacity, name="demo-gpu")
    dev.track(model)
    with dev:
        try:
            for seq, batch in zip(seqs, batches):
                model(**batch).loss.backward()
                opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as err:
            first = ". ".join(str(err).split(". ")[:2])
            print(f"unmanaged:  out of memory at a batch of {opts.batch} x {seq} tokens:\n  {first}.\n")
        model.zero_grad(set_to_none=True)

    Path(opts.log).parent.mkdir(parents=True, exist_ok=True)
    pressure_at, release_at = opts.steps // 3, opts.steps // 3 + 4
    taken = int(capacity * 0.3)
    print(f"managed:    adaptmem.manage(model, policy={opts.policy!r}, budget='90%', device=dev, log={opts.log!r})")
    print(f"{'step':>4} {'tokens':>7} {'loss':>7} {'peak':>11} {'budget':>11} {'pred err':>8}  plan")
    start = time.perf_counter()
    losses = []
    with dev, adaptmem.manage(model, policy=opts.policy, budget="90%", device=dev, log=opts.log) as mem:
        for i, batch in enumerate(batches):
            if i == pressure_at:
                dev.occupy(taken)
                print(f"     -- another process takes {format_bytes(taken)} of the device --")
                mem.sampler.wait_ticks(1)  # the background thread notices
            if i == release_at:
                dev.occupy(-taken)
                print("     -- ...and gives it back --")
            loss = mem.run_step(lambda b=batch: _train(model, b))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
            rec = mem.last_step
            err = "" if rec["prediction_error"] is None else f"{rec['prediction_error']:+.1%}"
            retried = f"  (recovered from {rec['attempt']} OOM)" if rec["attempt"] else ""
            print(f"{i + 1:>4} {rec['tokens']:>7} {loss:>7.3f} {format_bytes(rec['observed_peak_bytes']):>11} "
                  f"{format_bytes(rec['budget_bytes']):>11} {err:>8}  {plan_text(rec['plan_counts'])}{retried}",
                  flush=True)
        summary = mem.summary()
    took = time.perf_counter() - start
    print(
        f"\n{summary['steps']} steps in {took:.0f}s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; peak "
        f"{format_bytes(summary['peak_bytes'])} on a {format_bytes(capacity)} device; "
        f"{summary['ooms_recovered']} OOM(s) recovered, {summary['plan_changes']} plan changes, "
        f"{summary['pressure_events']} pressure event(s); mean prediction error "
        f"{summary['prediction_error_mean']:.1%}.\nDecision log: {opts.log}"
    )
    return 0


def _train(model: torch.nn.Module, batch: dict) -> float:
    out = model(**batch)
    out.loss.backward()
    return out.loss.item()
