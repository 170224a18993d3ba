"""A ConvNeXt at growing image sizes on a device of a share of its unmanaged peak, through
`run_step` or `with mem.step():`, one line a step.

    python -m stress.convnext_growing                     # run_step, a device at 40% of the peak at 224 px
    python -m stress.convnext_growing --form step --share 0.5

At 40% the first 224 px batch is a size not measured: no plan is predicted to fit, the tightest
by prediction runs, and where the extrapolated figures rank CHECKPOINT under OFFLOAD (they do in
most runs; plans weigh measured times) it runs out of memory, and the retry, with no plan predicted
lower, runs one tighter in every block: every block in OFFLOAD, which fits. Exit status 1 when a
batch was refused or failed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import adaptmem
from adaptmem.testing import SimulatedDevice

SIZES = (64, 96, 128, 160, 192, 224, 224)
MiB = 2**20


def build():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = ConvNextConfig(hidden_sizes=[24, 48, 96, 192], depths=[2, 2, 4, 2], num_labels=10)
    model = ConvNextForImageClassification(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def images(px: int, seed: int, batch: int = 8) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(batch, 3, px, px, generator=gen),
        "labels": torch.randint(0, 10, (batch,), generator=gen),
    }


def unmanaged_peak(px: int) -> int:
    model, opt = build()
    with SimulatedDevice() as meter:
        meter.track(model, opt)
        for seed in range(2):  # the second with the optimizer's state
            meter.reset_peak()
            model(**images(px, seed)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return meter.peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=("run_step", "step"), default="run_step")
    parser.add_argument("--share", type=float, default=0.40, help="the device, as a share of the peak at 224 px")
    args = parser.parse_args(argv)
    capacity = int(args.share * unmanaged_peak(max(SIZES)))
    model, opt = build()
    dev = SimulatedDevice(capacity)
    dev.track(model, opt)
    failed = 0
    print(f"device {capacity / MiB:.2f} MiB ({args.share:.0%} of the unmanaged peak at {max(SIZES)} px), {args.form}")
    with dev, adaptmem.manage(model, device=dev, budget="90%") as mem:
        for seed, px in enumerate(SIZES):
            try:
                if args.form == "run_step":
                    mem.run_step(lambda b=images(px, seed): model(**b).loss.backward())
                else:
                    with mem.step():
                        model(**images(px, seed)).loss.backward()
                opt.step()
                record = mem.last_step
                print(f"{px:4d} px  peak {record['observed_peak_bytes'] / MiB:7.2f} MiB  {record['plan_counts']}")
            except torch.OutOfMemoryError as err:
                failed += 1
                print(f"{px:4d} px  {type(err).__name__}: {str(err).splitlines()[0]}")
            opt.zero_grad(set_to_none=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
