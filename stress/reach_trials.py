"""The demo's "How long can I go?" with and without trials, where no plan's guess picks OFFLOAD.

    python -m stress.reach_trials        # two runs of the demo's job, a minute or so each

In most `make demo` runs the planner picks OFFLOAD on its guessed time at some step, so OFFLOAD is
measured and the longest length counts on its measured bytes. In one run of seven none did
(SELECTIVE and a chunked head won the long batches on time), and the answer rested on OFFLOAD's
guessed bytes, which assume the worst. Here OFFLOAD's guessed time is raised by `SLOWER_S` a block,
so that no plan picks it on the guess, and the demo's job runs in a fresh process twice: with the
policy's trials (`try_modes`, the default) and without (`try_modes = false`). Both answers are
printed side by side, with the plans that tried a mode.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import adaptmem

#: Seconds added to OFFLOAD's guessed time on every block: more than any plan saves by it.
SLOWER_S = 1.0


def _side(policy: str, log: str) -> int:
    """One run of the demo's job with OFFLOAD's guessed time raised (in this process)."""
    from adaptmem.control import priors
    from adaptmem.demo.finetune import main
    from adaptmem.modes import Mode

    guessed = priors.DERIVATIONS[Mode.OFFLOAD]

    def slower(lat, a):
        figures = guessed(lat, a)
        return dataclasses.replace(figures, seconds=figures.seconds + SLOWER_S)

    priors.DERIVATIONS[Mode.OFFLOAD] = slower
    return main(["--cpu", "--policy", policy, "--log", log])


def _run(policy: str, log: str) -> tuple[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "stress.reach_trials", "--side", policy, log],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the demo's run with policy {policy} failed:\n{done.stdout}\n{done.stderr}")
    longest = re.search(r"adaptmem\s+longest .*", done.stdout)
    plans = [r for r in adaptmem.read_log(log) if r["type"] == "plan"]
    trials = [f"step {p['step']}: {p['reason']}" for p in plans if "trial" in p["reason"]]
    return (longest.group(0) if longest else "(no answer printed)"), trials


def main() -> int:
    if sys.argv[1:2] == ["--side"]:
        return _side(*sys.argv[2:4])
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        off = Path(tmp) / "no-trials.toml"
        off.write_text((root / "policies" / "balanced.toml").read_text() + "\ntry_modes = false\n")
        for name, policy in (("trials", "balanced"), ("no trials", str(off))):
            print(f"{name} ({policy if policy == 'balanced' else 'balanced, try_modes = false'}) ...", flush=True)
            answer, trials = _run(policy, str(Path(tmp) / f"{name.replace(' ', '-')}.jsonl"))
            print(f"  {answer}")
            print(f"  plans that tried a mode: {', '.join(trials) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
