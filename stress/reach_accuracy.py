"""How far to trust "how long can I go?": `longest_sequence` against the longest length found by training.

    python -m stress.reach_accuracy                     # Qwen3 and Starcoder2 from configs (a few minutes each)
    python -m stress.reach_accuracy --arch qwen3 --json runs/reach.json
    python -m stress.reach_accuracy --arch qwen3 --batch 2 --accumulate 2   # two micro-batches a step
    python -m stress.reach_accuracy --arch qwen3 --varying 11   # asked after 11 steps of 50 to 600 tokens
    python -m stress.reach_accuracy --arch starcoder2 --rounds 3   # and again after two steps at each answer

For each architecture (4 layers, hidden 256, vocab 8000, random weights, AdamW, batch 1) on a
`SimulatedDevice` of `DEVICE_MIB`: a run calibrates on `CALIBRATION` lengths (twice each), then
asks `MemoryManager.longest_sequence(batch)`. Empirically, a length L trains when a fresh run with
the same calibration goes on with two steps at L and no `StepOutOfMemoryError`; the longest such L
is bisected to within 1% (the search starts from the prediction, so it costs a few runs). With
`--accumulate N` every optimizer step is N micro-batches, each a managed step: the first allocates
the weights' gradients, the others start with them. With `--varying N` the run calibrates on N
lengths drawn from 50 to 600 tokens, as a fine-tune on varying lengths asks after N steps. With
`--rounds N` the run goes on as a user asking "how long?" would: two steps at the answer (while they
train), then the question again, N times; each round's answer is printed beside the first (the
empirical longest is for the first run's calibration alone). `--arch nemotron` is offered too.

Target: the prediction within 5% of the empirical longest, and never above it by more than that.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

import adaptmem
from adaptmem.testing import SimulatedDevice
from stress.benchkit import log

ARCHS = ("qwen3", "starcoder2")
OTHER_ARCHS = ("nemotron",)  # offered, not run by default
DEVICE_MIB = 200
CALIBRATION = (128, 256, 512)
VOCAB = 8000
TOLERANCE = 0.05


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1 << 15,
        use_cache=False,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def batch(length: int, size: int = 1) -> dict:
    ids = torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def run(arch: str, lengths: list[int], *, ask: bool = False, size: int = 1, micro: int = 1, rounds: int = 0):
    """Train one optimizer step of `micro` micro-batches of `size` at each length under adaptmem's
    default policy; when `ask`, the prediction and the answers of each of `rounds` rounds after it
    (see the module's docstring)."""
    model = build(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    device = SimulatedDevice(DEVICE_MIB << 20)
    device.track(model)

    def train(length: int) -> None:
        for _ in range(micro):
            mem.run_step(lambda: model(**batch(length, size)).loss.backward())
        opt.step()
        opt.zero_grad(set_to_none=True)

    with device, adaptmem.manage(model, device=device) as mem:
        for length in lengths:
            train(length)
        if not ask:
            return None
        first = mem.longest_sequence(size)
        answers = [first]
        for _ in range(rounds):
            try:
                train(answers[-1].length)
                train(answers[-1].length)
            except torch.OutOfMemoryError:  # StepOutOfMemoryError is one: the round ends the rounds
                opt.zero_grad(set_to_none=True)
                log(f"{arch}: {answers[-1].length:,} tokens ran out of memory")
                break
            answers.append(mem.longest_sequence(size))
        return first, answers[1:]


def calibration(varying: int = 0) -> list[int]:
    """The lengths a run trains before it is asked: `CALIBRATION` twice, or `varying` lengths drawn
    from 50 to 600 tokens (the same draws in every run)."""
    if not varying:
        return list(CALIBRATION) * 2
    draw = random.Random(1)
    return [draw.randint(50, 600) for _ in range(varying)]


def trains(arch: str, length: int, calibrated: list[int], **shape) -> bool:
    try:
        run(arch, calibrated + [length, length], **shape)
        return True
    except torch.OutOfMemoryError:  # StepOutOfMemoryError is one
        return False


def empirical(arch: str, guess: int, calibrated: list[int], **shape) -> tuple[int, int]:
    """(longest that trained, shortest that did not), bisected to within 1%."""
    low, high = guess, guess
    while not trains(arch, low, calibrated, **shape):
        high, low = low, low * 3 // 4
    if high == low:
        high = low * 5 // 4
        while trains(arch, high, calibrated, **shape):
            low, high = high, high * 5 // 4
    while high - low > max(8, low // 100):
        mid = (low + high) // 2
        began = time.perf_counter()
        good = trains(arch, mid, calibrated, **shape)
        log(
            f"  {arch}: {mid:,} tokens {'trains' if good else 'runs out of memory'} "
            f"({time.perf_counter() - began:.0f} s)"
        )
        low, high = (mid, high) if good else (low, mid)
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", action="append", choices=ARCHS + OTHER_ARCHS, help=f"architectures (default: {', '.join(ARCHS)})"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--batch", type=int, default=1, help="samples a micro-batch (default 1)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches an optimizer step (default 1)")
    parser.add_argument(
        "--varying", type=int, default=0, help="calibrate on this many lengths drawn from 50 to 600 (default: fixed)"
    )
    parser.add_argument("--rounds", type=int, default=0, help="ask again after two steps at each answer, N times")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.accumulate < 1 or args.varying < 0 or args.rounds < 0:
        parser.error("--batch and --accumulate must be at least 1, --varying and --rounds at least 0")
    calibrated = calibration(args.varying)
    shape = {"size": args.batch, "micro": args.accumulate}
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    import logging

    logging.getLogger("adaptmem").setLevel(logging.ERROR)  # the bisection runs out of memory on purpose
    rows, ok = [], True
    for arch in args.arch or ARCHS:
        reach, later = run(arch, calibrated, ask=True, rounds=args.rounds, **shape)
        log(f"{arch}: predicted {reach}")
        for i, again in enumerate(later, 1):
            log(f"{arch}: round {i}, after two steps at the answer before: {again}")
        low, high = empirical(arch, reach.length, calibrated, **shape)
        ratio = reach.length / low
        met = 1 - TOLERANCE <= ratio <= 1 + TOLERANCE
        ok &= met
        rows.append(
            {
                "arch": arch,
                "predicted": reach.length,
                "empirical_low": low,
                "empirical_high": high,
                "ratio": round(ratio, 4),
                "met": met,
                "plan": str(reach),
                "rounds": [again.length for again in later],
            }
        )
        print(
            f"{arch:<11} predicted {reach.length:>6,}  trains up to {low:>6,} (not {high:,})  "
            f"predicted / empirical {ratio:.3f}  {'ok' if met else 'MISSED'} (within {TOLERANCE:.0%})"
            + (f"; asked again: {' -> '.join(f'{a.length:,}' for a in later)}" if later else ""),
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        figures = {"device_mib": DEVICE_MIB, "calibration": calibrated, **shape, "rows": rows}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
