"""A model that keeps a state on its layers: what each step starts from, its prediction, and "how long".

    python -m stress.recurrent_state              # a RecurrentGemma, 12 batches of 2 x 64..768 tokens
    python -m stress.recurrent_state --steps 20

A `RecurrentGemmaForCausalLM` from a config (6 layers: recurrent, recurrent, attention, twice;
hidden 128, vocab 2048, random weights), trained with AdamW on a 120 MiB `SimulatedDevice` at a
budget of 90%. Its recurrent layers keep their last state on the module for the next call, a tensor
of the step's graph. One line a step: the tokens, what the step started from (the weights and
AdamW's state are 11.75 MiB), its peak and prediction, and the longest sequence then answered at
batch 2. Then the mean and largest prediction error.
"""

from __future__ import annotations

import argparse
import logging

import torch

import adaptmem
from adaptmem.testing import SimulatedDevice

LENGTHS = (64, 128, 256, 384, 512, 640, 768)


def build():
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    config = RecurrentGemmaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=128,
        attention_window_size=64,
        block_types=["recurrent", "recurrent", "attention"],
        conv1d_width=4,
        use_cache=False,
    )
    return RecurrentGemmaForCausalLM(config).train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234)
    dev = SimulatedDevice(capacity_bytes=120 * 2**20)
    dev.track(model)

    def step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    print("step tokens    start     peak  predicted  longest at batch 2")
    with adaptmem.manage(model, budget="90%", device=dev) as mem:
        for i in range(args.steps):
            length = LENGTHS[int(torch.randint(0, len(LENGTHS), (1,), generator=gen))]
            ids = torch.randint(0, 2048, (2, length), generator=gen)
            with dev:
                mem.run_step(step, ids)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            r = mem.last_step
            predicted = r["predicted_peak_bytes"]
            answer = mem.longest_sequence(batch=2).length if i else 0
            print(
                f"{i + 1:4d} {2 * length:6d} {mem._controller.lengths.start / 2**20:8.2f} "
                f"{r['observed_peak_bytes'] / 2**20:8.2f} "
                + (f"{predicted / 2**20:10.2f}" if predicted else f"{'-':>10}")
                + f"  {answer:,}"
            )
        summary = mem.summary()
    print(
        f"\nmean prediction error {summary['prediction_error_mean']:.1%}, "
        f"largest {summary['prediction_error_max']:.1%}; peak {summary['peak_bytes'] / 2**20:.2f} MiB "
        f"against a budget of {summary['budget_bytes'] / 2**20:.2f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
