"""adaptmem against its peers and an oracle, side by side in one run, at three link speeds.

    python -m stress.bench                    # tiny + Llama, 2 lengths, 3 link speeds (~30 min on 2 cores)
    python -m stress.bench --quick            # every method at one link speed, one length (< 5 min)
    python -m stress.bench --json results.json
    python -m stress.bench --compare a.json b.json   # two runs' ratios side by side
    python -m stress.bench --device cuda      # on a GPU: a Llama of TinyLlama's shape (8 layers), its real link

Methods, each on its own copy of the model and its own stand-in device:
  unmanaged       every block keeps its activations
  checkpoint_all  the model's own gradient_checkpointing_enable() (Llama), else every block CHECKPOINT
  offload_all     every block OFFLOAD over the same link (as torchtune's OffloadActivations would)
  oracle          the fastest fixed per-block plan that fits the budget: the predicted best and adaptmem's
                  run in rotated rounds; their fastest and adaptmem's again in the timed rounds (`pick_oracle`)
  adaptmem        adaptmem.manage at budgets 30/50/70% of the way from checkpoint_all's peak to unmanaged's

Link speeds are set from the model: `hidden` moves all of offload_all's bytes in 5% of a
reference step (the copies hide behind compute), `one-block` in 35% (about one block's
forward and backward shows), `several` in 120% (several blocks' worth shows). The reference
step is the step's FLOPs (counted) at 50 GFLOP/s, one core of the machine docs/results.md's figures
come from: the same links in every run, whatever the machine's speed that minute. Step time is
CPU time of the training thread plus simulated link waits (`stress.benchkit.VirtualClock`), over 10
rotated rounds in which every method steps once. A ratio is the median over rounds of the two
methods' times in the same round (`paired`): a slow spell of the shared machine lands on both.
Each ratio is shown with its 95% interval over the rounds, and a target on a ratio is met or
missed only where that interval lies on one side of its line, undecided otherwise, with about
how many more rounds would decide it (`stress.verdicts`). adaptmem's ratio to the oracle, where
the timed rounds leave it within two standard errors of the 1.05 target, is measured over more
rounds of the two alone (`stress.benchkit.settle`).
Peaks come from steps of their own, read through a window no manager reads. One torch thread;
freed host memory stays mapped (`stress.benchkit.keep_host_memory`), so page faults stay out of the
times, and large tensors sit on transparent huge pages (THP_MEM_ALLOC_ENABLE=1, set by the script).

With `--device cuda` every method runs on the GPU over its real link, batch 4 x 1024 and
2048 tokens (`--quick`: 2048), in bf16: wall time between synchronizations around 3 steps
back to back (as a loop runs them), peaks of allocated device bytes read by a meter no
manager reads (`stress.benchkit_cuda`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from adaptmem import Mode
from adaptmem.config.units import format_bytes
from stress.bench_controller import controller_fraction
from stress.benchkit import (
    ORACLE_MODES,
    VOCAB,
    ModeFigures,
    batch_for,
    bootstrap_medians,
    build,
    find_oracle,
    keep_host_memory,
    log,
    make_runner,
    paired,
    pick_oracle,
    plan_label,
    rotate,
    rotated_seconds,
    settle,
)
from stress.verdicts import Verdict, at_most, every, interval, plain, within

LINKS = {"hidden": 0.05, "one-block": 0.35, "several": 1.2}  # seconds to move offload_all's bytes / reference step
REFERENCE_FLOPS_PER_S = 50e9  # one core of the machine docs/results.md's figures come from, training these models
FRACTIONS = (0.3, 0.5, 0.7)
VS_ORACLE = 1.05  # the target: adaptmem's step at most this many times the oracle's


def bench_config(
    name: str, seq: int, batch: int, links: list[str], reps: int, steps: int, extra: int, device: str = "cpu"
) -> list[dict]:
    base = build(name, device)
    data = batch_for(batch, seq, VOCAB[name], device)
    blocks = 8
    if device == "cuda":  # one link, the real one
        from stress.benchkit_cuda import link_bytes_per_s

        rate = link_bytes_per_s()
        log(f"[{name} batch {batch} x {seq} on {device}: pinned copies at {format_bytes(int(rate))}/s]")
        return bench_link(name, base, data, seq, blocks, "pcie", None, reps, steps, extra, rate=rate)
    moved, speeds = link_speeds(base, data, links)
    rows = []
    for link, speed in speeds.items():
        log(f"[{name} seq {seq} link {link}: {format_bytes(int(speed))}/s, offload_all moves {format_bytes(moved)}]")
        rows += bench_link(name, base, data, seq, blocks, link, speed, reps, steps, extra)
        plain = _beside(rows, "unmanaged", rows[-1])["step_s"]
        log(f"  offload_all's copies took {moved / speed / plain:.0%} of an unmanaged step on this machine")
    return rows


def link_speeds(base: torch.nn.Module, data: dict, links: list[str]) -> tuple[int, dict[str, float]]:
    """The bytes offload_all moves, and each link's speed in bytes/s: what moves them in its share
    (`LINKS`) of the reference step. Counted, not timed, so that every run (and every machine)
    has the same links: set from a timed step, they moved by 4% from run to run."""
    probe = make_runner("offload_all", base, data, None)
    probe.step()
    probe.measure_peak()
    moved = probe.dev.host_peak_bytes
    reference_s = step_flops(base, data) / REFERENCE_FLOPS_PER_S
    return moved, {link: moved / (LINKS[link] * reference_s) for link in links}


def step_flops(model: torch.nn.Module, data: dict) -> int:
    """The FLOPs of one training step of `model` (torch's FlopCounterMode), its gradients cleared after."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(**data).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def bench_link(name, base, data, seq, blocks, link, speed, reps, steps, extra, rate=None) -> list[dict]:
    t0 = time.perf_counter()
    fixed = {m: make_runner(m, base, data, speed) for m in ("unmanaged", "checkpoint_all", "offload_all")}
    for r in fixed.values():
        r.step()
        r.measure_peak()
    un, ck = fixed["unmanaged"].peaks[-1], fixed["checkpoint_all"].peaks[-1]
    alone = []  # every block in one mode: the oracle's per-block figures
    for mode in ORACLE_MODES:
        alone.append(make_runner("plan", base, data, speed, plan=(mode,) * blocks))
        alone[-1].step()
        alone[-1].measure_peak()
    figures = {
        m: ModeFigures(r.peaks[-1], s) for m, r, s in zip(ORACLE_MODES, alone, rotated_seconds(alone, steps + 2))
    }
    runners, finals = list(fixed.values()), {}
    for frac in FRACTIONS:
        budget = int(ck + frac * (un - ck))
        managed = make_runner("adaptmem", base, data, speed, budget=(frac, budget), capacity=2 * un)
        for _ in range(6):  # calibration and settling
            managed.step()
        managed.measure_peak(3)
        mine = tuple(map(Mode.parse, managed.manager.last_step["plan"]))
        finals[frac], tried = find_oracle(
            figures,
            blocks,
            budget,
            lambda plan: make_runner("plan", base, data, speed, plan=plan, budget=(frac, budget)),
            steps,
            also=(mine,),
        )
        log(
            f"  oracle at {frac:.0%}: tried "
            + ", ".join(
                f"{p} {q / budget:.2f}x budget " + (f"{s * 1e3:.0f} ms" if s is not None else "(over)")
                for p, q, s in tried
            )
        )
        runners += [*finals[frac], managed]
    for r, times in zip(runners, rotate(runners, reps)):  # each method takes every position in turn
        r.times += times
    log(f"  {len(runners)} methods x {reps} repetitions in {time.perf_counter() - t0:.0f} s")
    oracles = {}
    for frac, plans in finals.items():  # the finalist fastest over the timed rounds is the oracle
        oracles[frac] = pick_oracle(plans, fixed["unmanaged"].times)
        log(
            f"  oracle at {frac:.0%}: "
            + ", ".join(f"{plan_label(r.plan)} {paired(r.times, fixed['unmanaged'].times)[0]:.3f}x" for r in plans)
            + f" over the timed rounds: {plan_label(oracles[frac].plan)}"
        )
    against = {}
    for r in runners:
        if r.manager is not None:
            against[r.budget_frac] = mine, theirs = settle(r, oracles[r.budget_frac], VS_ORACLE, extra)
            if len(mine) > len(r.times):
                log(
                    f"  adaptmem at {r.budget_frac:.0%}: {paired(mine, theirs)[0]:.3f}x the oracle over "
                    f"{len(mine)} rounds ({paired(r.times, oracles[r.budget_frac].times)[0]:.3f}x over the timed ones)"
                )
            r.measure_peak(2)  # the peaks of the timed steps count too
        r.close()
    gc.collect()
    runners = [r for r in runners if r.method != "plan"]  # the finalists not picked
    base_times = fixed["unmanaged"].times
    rows = []
    for r in runners:
        ratio, spread = paired(r.times, base_times)
        rows.append(
            {
                "model": name,
                "seq": seq,
                "method": r.method,
                "budget_frac": r.budget_frac,
                "link": link,
                "link_bytes_per_s": int(rate or speed),
                "peak_bytes": max(r.peaks),
                "budget_bytes": r.budget_bytes,
                "step_s": statistics.median(r.times),
                "ratio": ratio,
                "spread": spread,
                "times": [round(t, 5) for t in r.times],
                "plan": plan_label(r.plan) if r.plan else None,
            }
        )
    for row, r in zip(rows, runners):
        if r.method == "adaptmem":
            mine, theirs = against[r.budget_frac]
            row["vs_oracle"], row["vs_oracle_spread"] = paired(mine, theirs)
            row["vs_oracle"], row["vs_oracle_rounds"] = round(row["vs_oracle"], 4), len(mine)
            row["vs_oracle_ratios"] = [round(a / b, 5) for a, b in zip(mine, theirs)]
            row["plan"] = plan_label(tuple(map(Mode.parse, r.manager.last_step["plan"])))
            head = r.manager.last_step.get("head")
            if head and head != "KEPT":  # the other methods keep the head whole
                row["plan"] += f" head {head}"
    return rows


def ratio_error(rows: list[dict], draws: int = 400) -> float:
    """The median, over the rows, of a step ratio's relative standard error: the spread of the
    paired median over the row's rounds drawn again with replacement (a bootstrap, seeded)."""
    rng = random.Random(0)
    errors = []
    for r in rows:
        if r["method"] == "unmanaged" or len(r.get("times") or ()) < 3:
            continue
        ratios = [t / b for t, b in zip(r["times"], _beside(rows, "unmanaged", r)["times"])]
        again = bootstrap_medians(ratios, rng, draws)
        errors.append(statistics.pstdev(again) / statistics.mean(again))
    return statistics.median(errors) if errors else 0.0


def compare(a: dict, b: dict, within: float = 0.03) -> str:
    """Two runs' ratios side by side (against unmanaged, and adaptmem's against the oracle), the
    difference of each, and how many agree `within`; beside it, the difference two runs show as
    a rule from the rounds' noise alone (each run's `ratio_error`, combined)."""

    def key(r):
        return r["model"], r["seq"], r["link"], r["method"], r["budget_frac"]

    theirs = {key(r): r for r in b["rows"]}
    lines, agree, total = (
        [
            "| model | seq | link | method | budget | ratio | A | B | difference |",
            "|---|---|---|---|---|---|---|---|---|",
        ],
        0,
        0,
    )
    for r in a["rows"]:
        o = theirs.get(key(r))
        for field in ("ratio", "vs_oracle"):
            if o is None or field not in r or field not in o or (field == "ratio" and r["method"] == "unmanaged"):
                continue
            diff = o[field] / r[field] - 1
            total += 1
            agree += abs(diff) <= within
            budget = f"{r['budget_frac']:.0%}" if r["budget_frac"] is not None else ""
            lines.append(
                f"| {r['model']} | {r['seq']} | {r['link']} | {r['method']} | {budget} | {field} | "
                f"{r[field]:.3f} | {o[field]:.3f} | {diff:+.1%} |"
            )
    noise = (ratio_error(a["rows"]) ** 2 + ratio_error(b["rows"]) ** 2) ** 0.5
    lines += [
        "",
        f"{agree} of {total} ratios agree within {within:.0%}. From the rounds' noise alone, two runs "
        f"differ by {noise:.1%} on a ratio as a rule (one standard deviation).",
    ]
    return "\n".join(lines)


def planner_ms() -> float:
    """The planner on 100 transformer-like blocks x 6 modes with a binding budget (`stress.bench_planner`)."""
    from stress.bench_planner import instance, timed

    options, capacity = instance(random.Random(0), 100, 6)
    return timed(options, capacity, 11)[0] * 1e3


def table(rows: list[dict]) -> str:
    """The rows; a ratio with its 95% interval over the rounds where they were kept, else with half
    the range of its rounds (the runs of earlier versions)."""
    out = [
        "| model | seq | link | method | budget | peak | peak/budget | step vs unmanaged | vs oracle | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['budget_frac']:.0%}" if r["budget_frac"] is not None else ""
        within = f"{r['peak_bytes'] / r['budget_bytes']:.3f}" if r["budget_bytes"] else ""
        step = _shown(r["ratio"], _unmanaged_ratios(rows, r), r.get("spread", 0.0))
        vs = (
            _shown(r["vs_oracle"], r.get("vs_oracle_ratios"), r.get("vs_oracle_spread", 0.0))
            if "vs_oracle" in r
            else ""
        )
        out.append(
            f"| {r['model']} | {r['seq']} | {r['link']} | {r['method']} | {budget} | "
            f"{format_bytes(r['peak_bytes'])} | {within} | {step} | {vs} | {r['plan'] or ''} |"
        )
    return "\n".join(out)


def _shown(value: float, ratios: list[float] | None, spread: float) -> str:
    if ratios and len(ratios) >= 2:
        low, high = interval(ratios)
        return f"{value:.3f} [{low:.3f}, {high:.3f}]"
    return f"{value:.3f} ± {spread:.3f}"


def _unmanaged_ratios(rows: list[dict], row: dict) -> list[float] | None:
    """`row`'s per-round ratios to unmanaged in the same rounds (None where the rounds were not kept)."""
    if row["method"] == "unmanaged" or not row.get("times"):
        return None
    base = _beside(rows, "unmanaged", row).get("times")
    return [t / b for t, b in zip(row["times"], base)] if base else None


def render(result: dict) -> str:
    """The table, the controller's and planner's figures, the targets, the machine and the command."""
    lines = [
        table(result["rows"]),
        "",
        f"controller_fraction {result['controller_fraction']:.2%} of a steady-state step in the controller's "
        f"code (host probe; {result.get('controller_background_fraction', 0):.2%} more on another core in its "
        f"background thread; side by side {result.get('controller_ab_fraction', 0):+.2%}); "
        f"planner {result['planner_ms_100x6']:.2f} ms for 100 blocks x 6 modes; a step ratio's standard "
        f"error over its rounds {ratio_error(result['rows']):.1%} (median; `--compare` sets two runs side by side)",
        "",
    ]
    checks = targets(result["rows"], result["controller_fraction"], result["planner_ms_100x6"])
    lines += [v.line() for v in checks]
    lines += ["", f"Machine: {result['machine']}. Command: `{result['command']}` ({result['seconds']} s)."]
    return "\n".join(lines)


def targets(rows: list[dict], fraction: float, planner: float) -> list[Verdict]:
    """Each target's verdict (`stress.verdicts`): a ratio's is met or missed only where its 95%
    interval over the rounds lies on one side of the line, and undecided otherwise."""
    over = [
        r
        for r in rows
        if r["budget_bytes"] and r["method"] in ("adaptmem", "oracle") and r["peak_bytes"] > r["budget_bytes"]
    ]
    mine = [r for r in rows if r["method"] == "adaptmem"]
    checks = [
        plain("peak <= budget everywhere", not over),
        every(
            f"adaptmem <= {VS_ORACLE}x the oracle everywhere",
            [_against_oracle(r) for r in mine],
        ),
    ]
    for r in (r for r in mine if r["budget_frac"] == 0.7):
        ck = _beside(rows, "checkpoint_all", r)
        # per round: adaptmem's ratio less half of checkpoint_all's overhead, against 1
        mine_r, ck_r = _unmanaged_ratios(rows, r), _unmanaged_ratios(rows, ck)
        if mine_r and ck_r:
            rounds = [a - (c - 1) / 2 for a, c in zip(mine_r, ck_r)]
        else:
            rounds = [r["ratio"] - (ck["ratio"] - 1) / 2]
        checks.append(at_most(f"{_where(r)}: overhead <= half of checkpoint_all's", rounds, 1.0))
    checks.append(
        plain(
            "peak >= 93% of the budget wherever a plan that fills more (the oracle's) is faster beyond the spread",
            not [r for r in mine if _fuller_and_faster(r, rows)],
        )
    )
    checks += [
        plain("controller <= 1% of a step", fraction <= 0.01),
        plain("planner <= 5 ms for 100 x 6", planner <= 5.0),
    ]
    return checks


def _where(row: dict) -> str:
    return f"{row['model']} {row['seq']} {row['link']} {row['budget_frac']:.0%}"


def _against_oracle(row: dict) -> Verdict:
    """adaptmem's ratio to the oracle against the target, over its rounds (runs that kept none:
    over the ratio plus or minus half its rounds' range)."""
    ratios = row.get("vs_oracle_ratios")
    if ratios and len(ratios) >= 2:
        return at_most(_where(row), ratios, VS_ORACLE)
    spread = row.get("vs_oracle_spread", 0.0)
    return within(_where(row), row["vs_oracle"] - spread, row["vs_oracle"] + spread, VS_ORACLE)


def _beside(rows: list[dict], method: str, row: dict, *keys: str) -> dict:
    """The row of `method` measured beside `row`: the same model, length and link (and `keys`)."""
    return next(
        o for o in rows if o["method"] == method and all(o[k] == row[k] for k in ("model", "seq", "link", *keys))
    )


def _fuller_and_faster(row: dict, rows: list[dict]) -> bool:
    """adaptmem's `row` left more than 7% of its budget unused, and the oracle's plan for the same
    budget filled more of it and ran faster beyond the noise: the 95% interval of adaptmem's ratio
    to it over 1 (runs of earlier versions: the ratio less half its rounds' range over 1)."""
    if row["peak_bytes"] >= 0.93 * row["budget_bytes"]:
        return False
    oracle = _beside(rows, "oracle", row, "budget_frac")
    ratios = row.get("vs_oracle_ratios")
    slower = (
        interval(ratios)[0] > 1.0 if ratios and len(ratios) >= 2 else row["vs_oracle"] - row["vs_oracle_spread"] > 1.0
    )
    return oracle["peak_bytes"] > row["peak_bytes"] and slower


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one length, one link speed: every method, < 5 min")
    p.add_argument("--json", type=Path, default=None, help="write the rows and figures here")
    p.add_argument("--reps", type=int, default=None, help="rotated repetitions per method (default 10)")
    p.add_argument("--models", default=None, help="default tiny,llama; on cuda llama-1b")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: stand-in devices at three link speeds; cuda: the GPU and its real link",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="print the Markdown of a --json file (docs/results.md) and exit",
    )
    p.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        default=None,
        metavar=("A", "B"),
        help="set the ratios of two --json files side by side, with their differences, and exit",
    )
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    if args.compare:
        print(compare(*(json.loads(f.read_text()) for f in args.compare)))
        return 0
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if not gpu:
        torch.set_num_threads(1)
    keep_host_memory()
    reps = args.reps or 10
    if gpu:
        models, batch, seqs = args.models or "llama-1b", 4, [2048] if args.quick else [1024, 2048]
    else:
        models, batch, seqs = args.models or "tiny,llama", 2, [256] if args.quick else [256, 512]
    links = ["one-block"] if args.quick else list(LINKS)
    started = time.perf_counter()
    rows = []
    for name in models.split(","):
        for seq in seqs:
            rows += bench_config(
                name, seq, batch, links, reps, steps=4, extra=8 if args.quick else 30, device=args.device
            )
    torch.set_num_threads(1)  # the controller's figures are the stand-in's, on one thread, as on a CPU run
    controller = controller_fraction(10 if args.quick else 30)
    fraction = controller["direct"]
    planner = planner_ms()
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {torch.get_num_threads()} torch thread, torch {torch.__version__}"
    if gpu:
        from stress.benchkit_cuda import machine as gpu_machine

        machine = gpu_machine()
    command = "python -m stress.bench" + (" --device cuda" if gpu else "") + (" --quick" if args.quick else "")
    checks = targets(rows, fraction, planner)
    result = {
        "rows": rows,
        "controller_fraction": fraction,
        "planner_ms_100x6": planner,
        "machine": machine,
        "controller_background_fraction": controller["background"],
        "controller_ab_fraction": controller["ab"],
        "command": command,
        "seconds": round(time.perf_counter() - started),
        "targets": {v.what: v.state for v in checks},
    }
    print(render(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if not checks[0].ok else 0  # a budget exceeded is a failure; the other targets are reported


if __name__ == "__main__":
    if os.environ.get("THP_MEM_ALLOC_ENABLE") is None and not {"--render", "--compare"} & set(sys.argv):
        # torch reads it once, at its first allocation: large tensors on transparent huge pages
        # made step times 3% faster and their spread between identical copies of a model tighter
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "stress.bench", *sys.argv[1:]])
    sys.exit(main())
