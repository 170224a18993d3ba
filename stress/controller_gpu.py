"""What the controller adds to a step on a GPU: a managed step against the same plan, fixed.

    python -m stress.controller_gpu              # a Llama of TinyLlama's shape (8 layers), batch 4 x 2048, bf16
    python -m stress.controller_gpu --seq 1024
    python -m stress.controller_gpu --trace runs/traces   # also profile a light and a measured managed step

The fixed runner checkpoints the first 6 of 8 blocks. The managed one gets a budget 5%
above that plan's peak, may choose only NONE or CHECKPOINT and keeps the loss head whole
(as the fixed one does: chunked, it had room for fewer checkpoints, a plan of its own), so
that it settles on the same plan (the script says so if it does not). Both share one copy of the weights.
Two figures:

  synchronized  each step timed alone, between two `torch.cuda.synchronize()`, the two
                runners alternating; the median of the paired ratios, and apart from it
                what a step measured block by block (one in `measure_every`) adds
  back to back  20 steps in a row with no synchronization between them, as a training
                loop runs; the fastest of 3 such stretches each

In the synchronized figure the manager's work between steps (the retry guard, planning,
learning) runs while the device has nothing queued, so it adds to the step in full; back
to back it can overlap the device's work on the step before, as the manager does not
wait for the device at a light step. Its work at block boundaries mostly overlaps kernels
already queued.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from adaptmem import Mode
from adaptmem.config.policy import Policy
from stress.benchkit import VOCAB, batch_for, build, make_runner, plan_label


def back_to_back(runner, steps: int = 20) -> float:
    """Seconds per step over `steps` steps run as a training loop runs them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        runner.train_step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def trace_steps(runner, out: Path, row_limit: int = 20) -> dict[str, str]:
    """Profile managed steps until one light step and one measured block by block have run:
    a Chrome trace of each in `out` (light.json, blocks.json) and their costliest ops by
    self CPU time, as text. On a CPU only the CPU is profiled."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out.mkdir(parents=True, exist_ok=True)
    tables: dict[str, str] = {}
    for _ in range(4 * runner.manager.policy.measure_every):
        with profile(activities=activities) as prof:
            runner.train_step()
        kind = "blocks" if runner.manager.last_step["measured"] == "blocks" else "light"
        if kind not in tables:
            prof.export_chrome_trace(str(out / f"{kind}.json"))
            tables[kind] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
        if len(tables) == 2:
            break
    return tables


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="synchronized steps per runner")
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write Chrome traces of a light and a measured managed step here",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (torch.cuda.is_available() is False)")
    base = build("llama-1b", "cuda")
    data = batch_for(args.batch, args.seq, VOCAB["llama-1b"], "cuda")
    plan = (Mode.CHECKPOINT,) * 6 + (Mode.NONE,) * 2
    fixed = make_runner("plan", base, data, None, plan=plan)
    fixed.run = 1  # one step a reading: the back-to-back figure below is the loop's
    for _ in range(3):
        fixed.step()
    peak = fixed.measure_peak()
    managed = make_runner(
        "adaptmem",
        base,
        data,
        None,
        budget=(None, int(peak / 0.95)),
        policy=Policy(modes=("NONE", "CHECKPOINT"), head="kept"),
    )
    managed.run = 1
    for _ in range(12):  # calibration and settling
        managed.step()
    chosen = tuple(Mode.parse(m) for m in managed.manager.last_step["plan"])
    same = chosen == plan
    mine, theirs, measured = [], [], []
    for _ in range(args.steps):
        theirs.append(fixed.step())
        mine.append(managed.step())
        measured.append(managed.manager.last_step["measured"] == "blocks")
    ratio = statistics.median(m / f for m, f in zip(mine, theirs))
    extra = [m - f for m, f, detailed in zip(mine, theirs, measured) if detailed]
    loops = [(back_to_back(fixed), back_to_back(managed)) for _ in range(3)]
    f_loop, m_loop = min(f for f, _ in loops), min(m for _, m in loops)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: Llama 1b shape, 8 layers, batch {args.batch} x {args.seq}, bf16")
    print(
        f"plan {plan_label(plan)} fixed, managed chose {plan_label(chosen)}"
        + ("" if same else "  (not the same plan: the figures below compare different plans)")
    )
    print(
        f"synchronized: fixed {statistics.median(theirs) * 1e3:.1f} ms, managed {statistics.median(mine) * 1e3:.1f} ms,"
        f" paired median ratio {ratio:.3f}"
    )
    if extra:
        print(
            f"a step measured block by block ({len(extra)} of {len(mine)}): {statistics.mean(extra) * 1e3:.1f} ms"
            " longer than the fixed plan's, on average"
        )
    print(f"back to back: fixed {f_loop * 1e3:.1f} ms, managed {m_loop * 1e3:.1f} ms, ratio {m_loop / f_loop:.3f}")
    if args.trace is not None:
        for kind, text in trace_steps(managed, args.trace).items():
            print(f"\n{kind} step ({args.trace / (kind + '.json')}), costliest by self CPU time:\n{text}")
    managed.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
