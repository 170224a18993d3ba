"""`adaptmem report run.jsonl [--out run.png]`: what a run did, as a table and a picture.

The table (rich) gives steps, peak against budget, plan changes, OOMs recovered,
prediction error, pressure events and the longest sequence the manager predicted
at its last batch (`MemoryManager.longest_sequence`), per run id in the log. The picture
(matplotlib) shows each step's peak against the budget, with markers where a
step ran out of memory, where a step was a retry, and where others took
memory, and under it a heat map of each block's mode per step.

Needs the `report` extra: ``pip install "adaptmem[report]"``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from adaptmem.config.units import format_bytes
from adaptmem.control.events import read_log
from adaptmem.modes import LADDER

MODE_ORDER = [m.label for m in LADDER]


@dataclass
class RunFigures:
    """The figures of one run, from its log records."""

    run: str
    steps: list[dict] = field(default_factory=list)
    ooms: list[dict] = field(default_factory=list)
    pressure: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    reach: dict | None = None  # the end record's prediction of the longest sequence

    @property
    def peak(self) -> int:
        return max((s["observed_peak_bytes"] for s in self.steps), default=0)

    @property
    def worst_ratio(self) -> float | None:
        ratios = [s["observed_peak_bytes"] / s["budget_bytes"] for s in self.steps if s.get("budget_bytes")]
        return max(ratios) if ratios else None

    @property
    def over_budget(self) -> int:
        """Steps over the budget in force (held under the user's while others took memory)."""
        return sum(1 for s in self.steps if s["observed_peak_bytes"] > s["budget_bytes"])

    @property
    def over_user_budget(self) -> int:
        """Steps over the budget the user asked for (the budget in force where a log lacks it)."""
        return sum(1 for s in self.steps if s["observed_peak_bytes"] > s.get("user_budget_bytes", s["budget_bytes"]))

    @property
    def ooms_recovered(self) -> int:
        return sum(s.get("attempt", 0) for s in self.steps)

    @property
    def errors(self) -> list[float]:
        return [abs(s["prediction_error"]) for s in self.steps if s.get("prediction_error") is not None]


def figures(records: list[dict]) -> list[RunFigures]:
    """The records of a log, grouped by run id in order of first appearance."""
    runs: dict[str, RunFigures] = {}
    for record in records:
        run = runs.setdefault(record.get("run", "?"), RunFigures(record.get("run", "?")))
        kind = record["type"]
        if kind == "step":
            run.steps.append(record)
        elif kind == "oom":
            run.ooms.append(record)
        elif kind == "pressure":
            run.pressure.append(record)
        elif kind == "plan":
            run.plans.append(record)
        elif kind == "blocks" or (kind == "start" and not run.blocks):  # `blocks`: one per call, from then
            run.blocks = list(record.get("blocks", []))
        elif kind == "end" and record.get("reach"):
            run.reach = record["reach"]
    return list(runs.values())


def rows(run: RunFigures) -> dict[str, str]:
    """The table's figures for one run, by row name."""
    errors = run.errors
    return {
        "steps": str(len(run.steps)),
        "peak": format_bytes(run.peak),
        "worst peak / budget": f"{run.worst_ratio:.1%}" if run.worst_ratio is not None else "-",
        "steps over budget": _over_row(run),
        "plan changes": str(len(run.plans)),
        "OOMs recovered": str(run.ooms_recovered),
        "OOMs": str(len(run.ooms)),
        "mean |prediction error|": f"{sum(errors) / len(errors):.1%}" if errors else "-",
        "max |prediction error|": f"{max(errors):.1%}" if errors else "-",
        "pressure events": str(len(run.pressure)),
        "longest sequence (predicted)": _reach_row(run.reach),
    }


def _over_row(run: RunFigures) -> str:
    """Steps over the budget in force, and over the user's where others held it lower."""
    held, yours = run.over_budget, run.over_user_budget
    if held == yours:
        return str(held)
    return f"{held} (of the budget in force, held lower while others took memory); {yours} over yours"


def _reach_row(reach: dict | None) -> str:
    """The longest sequence a run's manager predicted at its last batch, on its device."""
    if not reach:
        return "-"
    note = ", extrapolated" if reach.get("extrapolated") else ""
    return f"{reach['length']:,} tokens x batch {reach['batch']} in {format_bytes(reach['limit_bytes'])}{note}"


def table(runs: list[RunFigures]):
    from rich.table import Table

    out = Table(title="adaptmem run" + ("s" if len(runs) > 1 else ""))
    out.add_column("")
    for run in runs:
        out.add_column(f"run {run.run}", justify="right")
    figures_by_run = [rows(run) for run in runs]
    for name in figures_by_run[0]:
        out.add_row(name, *(f[name] for f in figures_by_run))
    return out


def picture(run: RunFigures, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    steps = [s["step"] for s in run.steps]
    mib = 2**20
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=[3, 2])
    top.plot(steps, [s["observed_peak_bytes"] / mib for s in run.steps], marker="o", ms=3, label="peak")
    top.step(steps, [s["budget_bytes"] / mib for s in run.steps], where="mid", color="tab:red", label="budget")
    predicted = [(s["step"], s["predicted_peak_bytes"] / mib) for s in run.steps if s.get("predicted_peak_bytes")]
    if predicted:
        top.plot(*zip(*predicted), ls=":", color="tab:gray", label="predicted")
    retried = [(s["step"], s["observed_peak_bytes"] / mib) for s in run.steps if s.get("attempt")]
    if retried:
        top.scatter(*zip(*retried), marker="s", color="tab:orange", zorder=3, label="retried step")
    for i, oom in enumerate(run.ooms):
        top.axvline(oom["step"], color="tab:red", ls="--", lw=0.8, label="out of memory" if i == 0 else None)
    for i, p in enumerate(run.pressure):
        top.axvline(p["step"], color="tab:purple", ls="-.", lw=0.8, label="others took memory" if i == 0 else None)
    top.set_ylabel("MiB")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"adaptmem run {run.run}: peak per step against the budget")
    labels = [m for m in MODE_ORDER]
    grid = [
        [labels.index(s["plan"][b]) if "plan" in s and b < len(s["plan"]) else 0 for s in run.steps]
        for b in range(len(run.blocks) or max((len(s.get("plan", [])) for s in run.steps), default=0))
    ]
    colors = ["#e8e8e8", "#9ecae1", "#fdd49e", "#3182bd", "#31a354", "#a1d99b", "#e6550d"][: len(labels)]
    if grid:
        bottom.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=ListedColormap(colors),
            vmin=-0.5,
            vmax=len(labels) - 0.5,
            extent=(steps[0] - 0.5, steps[-1] + 0.5, len(grid) - 0.5, -0.5),
        )
        bottom.set_yticks(range(len(grid)), run.blocks or [str(i) for i in range(len(grid))], fontsize=6)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
        bottom.legend(handles, labels, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    bottom.set_xlabel("step")
    for axis in (top, bottom):  # steps are whole
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_title("mode of each block per step", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaptmem report", description="Summarize an adaptmem decision log.")
    parser.add_argument("log", type=Path, help="the JSONL log a manager wrote (log=...)")
    parser.add_argument("--out", type=Path, default=None, help="write the picture here (PNG); default: LOG.png")
    parser.add_argument("--run", default=None, help="only this run id (default: every run in the log)")
    args = parser.parse_args(argv)
    if not args.log.exists():
        parser.error(f"no log at {args.log}: pass the path given as log= to adaptmem.manage")
    try:
        from rich.console import Console
    except ImportError:
        parser.error('the report needs rich and matplotlib: pip install "adaptmem[report]"')
    try:
        runs = [r for r in figures(read_log(args.log, run=args.run)) if r.steps]
    except ValueError as err:
        parser.error(str(err))
    if not runs:
        parser.error(f"{args.log} has no step records" + (f" for run {args.run}" if args.run else ""))
    Console().print(table(runs))
    out = args.out or args.log.with_suffix(".png")
    picture(runs[-1], out)
    print(f"picture of run {runs[-1].run}: {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
