"""Does the manager keep the budget? Budgets between every-block-CHECKPOINT and unmanaged.

    python stress/scenario_budgets.py                 # tiny model and HF Llama, 30/50/70%
    python stress/scenario_budgets.py --steps 40 --fractions 0.2,0.5,0.8

For each model, the peaks of every block CHECKPOINT and every block NONE are
measured first; then, for each fraction f, a run under
budget = ckpt + f x (none - ckpt). The step peak is measured by a second
SimulatedDevice the manager does not read. Printed: the worst peak/budget over
the steps after the first, the steady use (the median peak/budget over the last
third of the steps: how much of the budget the settled plans fill), the mean
and last prediction error, plan changes, decisions and OOMs. All on the CPU;
times are not the point here.
"""

from __future__ import annotations

import argparse
import sys

import torch

import adaptmem
from adaptmem import Mode
from adaptmem.demo.tiny import TinyConfig, TinyTransformer, random_batch
from adaptmem.testing import SimulatedDevice, measure_peak
from stress.benchkit import small_llama


def tiny_model():
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(dim=128, n_layers=6, vocab_size=512))
    return model, lambda: random_batch(model.cfg, 4, 256, generator=torch.Generator().manual_seed(1))


def llama_model():
    torch.manual_seed(0)
    model = small_llama(512, layers=6, dropout=0.1)

    def batch():
        ids = torch.randint(0, 512, (2, 512), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids}

    return model, batch


def uniform_peak(make, mode):
    model, batch = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_peak(model, batch, mode=mode, optimizer=opt, steps=2)


def run(make, budget, steps):
    model, batch = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth, dev = SimulatedDevice(), SimulatedDevice(capacity_bytes=4 * budget)
    truth.track(model)
    dev.track(model)
    peaks = []
    with truth, dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for _ in range(steps):
            truth.reset_peak()
            with mem.step():
                model(**batch()).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            peaks.append(truth.peak_bytes)
        return peaks, mem.summary()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--fractions", default="0.3,0.5,0.7")
    p.add_argument("--models", default="tiny,llama")
    args = p.parse_args(argv)
    makers = {"tiny": tiny_model, "llama": llama_model}
    worst_all, uses = 0.0, []
    for name in args.models.split(","):
        make = makers[name]
        low, high = uniform_peak(make, Mode.CHECKPOINT), uniform_peak(make, Mode.NONE)
        print(f"{name}: every block CHECKPOINT peaks at {low / 2**20:.1f} MiB, NONE at {high / 2**20:.1f} MiB")
        for fraction in (float(f) for f in args.fractions.split(",")):
            budget = int(low + fraction * (high - low))
            peaks, s = run(make, budget, args.steps)
            worst = max(peaks[1:]) / budget
            settled = sorted(peaks[-max(1, len(peaks) // 3) :])
            use = settled[len(settled) // 2] / budget
            worst_all = max(worst_all, worst)
            uses.append(use)
            print(
                f"  budget {fraction:.0%} of the way ({budget / 2**20:7.1f} MiB): worst peak/budget after "
                f"step 1 {worst:6.1%}; steady use {use:6.1%}; "
                f"prediction error mean {s['prediction_error_mean']:.1%}, last "
                f"{s['prediction_error_last']:+.1%}; {s['plan_changes']} plan changes; decisions "
                f"{s['decisions']}; OOMs {s['ooms']}; final plan {s['plan_counts']}"
            )
    print(
        f"worst peak/budget over every run after step 1: {worst_all:.1%}; steady use {min(uses):.1%} to {max(uses):.1%}"
    )
    return 0 if worst_all <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
