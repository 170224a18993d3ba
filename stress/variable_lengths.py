"""Variable lengths, the case adaptivity exists for: a long-tailed stream of batches on one fixed stand-in.

    python -m stress.variable_lengths                  # both models, 24 batches of 128..3072 tokens, two passes
    python -m stress.variable_lengths --arch mistral --batches 12 --passes 1 --json runs/lengths.json

Two models from configs (random weights), batch 1, AdamW:

  mistral     4 layers, hidden 256, vocab 32000: the head and the optimizer weigh as much as
              the layers, so skipping recompute gains little
  llama-deep  8 layers, hidden 384, vocab 4096: the layers carry the step (layer-heavy)

each on a `SimulatedDevice` sized so that HF gradient checkpointing's longest is `HF_LONGEST`
tokens (its peak there, optimizer state resident, plus 2%). The lengths are long-tailed: most
batches short, a few up to `--top`, in one fixed order. Methods, side by side in one run:

  hf_gc      the model's own gradient checkpointing; a batch that runs out of memory is
             skipped (what its user must truncate or drop)
  adaptmem   adaptmem.manage(model) with its default policy; a batch it cannot fit counts as failed
  unmanaged  no checkpointing, on a stand-in with no limit: the speed that skipping all recompute gives

Each method runs the stream `--passes` times, alternating, each pass on a fresh model.
Reported per model: batches trained; tokens per second on the batches hf_gc and adaptmem both
trained (total tokens over total step seconds); the gain skipping recompute gives (unmanaged /
hf_gc) and the share of it adaptmem takes ((adaptmem/hf_gc - 1) / (unmanaged/hf_gc - 1)); after the
first 5 steps, the share of adaptmem's steps measured block by block and its median prediction
error; its steps at all-NONE on a length seen for the first time against unmanaged's at the same
batches; adaptmem's predicted longest length at the end of each pass (a batch past it is
refused at once, by design); and the plan per batch. Targets: adaptmem trains every batch up
to its longest; takes >= 60% of the gain;
>= 1.15x hf_gc where the gain is >= 1.25x; <= 10% of steps measured after the first 5; median
prediction error <= 5%; first-seen all-NONE steps <= 1.03x unmanaged's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.demo.longest import hf_checkpointing
from adaptmem.testing import SimulatedDevice
from stress.benchkit import log

HF_LONGEST = 768
METHODS = ("hf_gc", "adaptmem", "unmanaged")
ARCHS = {
    "mistral": dict(kind="mistral", vocab=32000, hidden=256, intermediate=688, layers=4, heads=8, kv=4),
    "llama-deep": dict(kind="llama", vocab=4096, hidden=384, intermediate=1024, layers=8, heads=6, kv=2),
}
TARGETS = {"share": 0.6, "vs_hf": 1.15, "gain_for_vs_hf": 1.25, "measured": 0.10, "error": 0.05, "first_seen": 1.03}


def build(arch: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    a = ARCHS[arch]
    torch.manual_seed(0)
    common = dict(
        vocab_size=a["vocab"],
        hidden_size=a["hidden"],
        intermediate_size=a["intermediate"],
        num_hidden_layers=a["layers"],
        num_attention_heads=a["heads"],
        num_key_value_heads=a["kv"],
        max_position_embeddings=1 << 15,
        use_cache=False,
    )
    if a["kind"] == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    return LlamaForCausalLM(LlamaConfig(**common))


def batch(vocab: int, length: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def stream(count: int, top: int, seed: int = 0) -> list[int]:
    """`count` lengths from 128 to `top` (multiples of 64), most short: 128 x (top/128)^(u^3) for
    uniform u, with the longest among them once."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [
        max(128, int(128 * (top / 128) ** (torch.rand((), generator=gen).item() ** 3)) // 64 * 64) for _ in range(count)
    ]
    lengths[count // 2] = top
    return lengths


class Method:
    """One pass of one method: a fresh model, optimizer and stand-in of `capacity` bytes (None: no limit)."""

    def __init__(self, name: str, arch: str, capacity: int | None) -> None:
        self.name, self.vocab = name, ARCHS[arch]["vocab"]
        self.model = build(arch)
        self.model.train()
        if name == "hf_gc":
            hf_checkpointing(self.model, True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.dev = SimulatedDevice(capacity if name != "unmanaged" else None)
        self.dev.track(self.model)
        self.mem = adaptmem.manage(self.model, device=self.dev) if name == "adaptmem" else None
        self.records: list[dict | None] = []
        self.longest: int | None = None  # adaptmem's predicted longest length, at the end of the pass

    def step(self, data: dict) -> float | None:
        """Seconds of one training step, or None when it ran out of memory."""
        start = time.perf_counter()
        try:
            with self.dev:
                if self.mem is not None:
                    self.mem.run_step(lambda: self.model(**data).loss.backward())
                else:
                    self.model(**data).loss.backward()
                self.opt.step()
        except torch.OutOfMemoryError:  # StepOutOfMemoryError is one
            self.records.append(None)
            return None
        finally:
            self.opt.zero_grad(set_to_none=True)
        self.records.append(self.mem.last_step if self.mem is not None else None)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.mem is not None:
            self.longest = self.mem.longest_sequence(batch=1).length
            self.mem.close()


def device_for_hf(arch: str, length: int) -> int:
    """A stand-in size where HF gradient checkpointing's longest is `length`: its peak there, plus 2%."""
    run = Method("hf_gc", arch, None)
    for _ in range(2):  # the second with the optimizer's state resident
        run.step(batch(run.vocab, length, 0))
    return int(run.dev.peak_bytes * 1.02)


def plan_letters(record: dict | None) -> str:
    if record is None:
        return "failed"
    head = record.get("head") or ""
    return "".join(m.replace("CHECKPOINT+OFFLOAD", "R")[0] for m in record["plan"]) + (" " + head if head else "")


def measure(arch: str, lengths: list[int], passes: int) -> dict:
    capacity = device_for_hf(arch, HF_LONGEST)
    vocab = ARCHS[arch]["vocab"]
    log(f"[{arch}] stand-in of {format_bytes(capacity)}; lengths {lengths}")
    seconds: dict[str, list[list[float | None]]] = {m: [] for m in METHODS}
    records: list[list[dict | None]] = []
    longest: list[int] = []
    for p in range(passes):
        for name in METHODS:
            run = Method(name, arch, capacity)
            began = time.perf_counter()
            seconds[name].append([run.step(batch(vocab, n, i)) for i, n in enumerate(lengths)])
            run.close()
            if name == "adaptmem":
                records.append(run.records)
                longest.append(run.longest)
            log(f"  pass {p + 1} {name}: {time.perf_counter() - began:.0f} s")
    both = [i for i in range(len(lengths)) if all(s[i] is not None for m in ("hf_gc", "adaptmem") for s in seconds[m])]
    tokens = sum(lengths[i] for i in both)
    rate = {m: tokens * len(runs) / sum(s[i] for s in runs for i in both) for m, runs in seconds.items()}
    failed = {
        m: sum(s[i] is None for s in runs for i in range(len(lengths))) // len(runs) for m, runs in seconds.items()
    }
    # adaptmem's failures within the longest length it predicts (those past it are refused at once, as promised)
    within = sum(
        s[i] is None and lengths[i] <= top for s, top in zip(seconds["adaptmem"], longest) for i in range(len(lengths))
    ) // len(longest)
    gain, vs_hf = rate["unmanaged"] / rate["hf_gc"], rate["adaptmem"] / rate["hf_gc"]
    share = (vs_hf - 1) / (gain - 1) if gain > 1 else float("nan")
    later = [r for recs in records for r in recs[5:] if r is not None]
    measured = sum(r["measured"] == "blocks" for r in later) / max(1, len(later))
    errors = [
        abs(r["prediction_error"])
        for recs in records
        for r in recs[5:]
        if r is not None and r["prediction_error"] is not None
    ]
    # adaptmem's all-NONE steps on a length it had not seen before, against unmanaged's same steps
    first, seen = [], set()
    for i, n in enumerate(lengths):
        if n not in seen and i >= 5 and all(r[i] is not None and set(r[i]["plan"]) == {"NONE"} for r in records):
            first.append(i)
        seen.add(n)
    first_seen = (
        (sum(s[i] for s in seconds["adaptmem"] for i in first) / sum(s[i] for s in seconds["unmanaged"] for i in first))
        if first
        else float("nan")
    )
    row = {
        "arch": arch,
        "device_bytes": capacity,
        "lengths": lengths,
        "both": len(both),
        "failed": failed,
        "adaptmem_longest": min(longest),
        "adaptmem_failed_within_longest": within,
        "tokens_per_s": rate,
        "gain": gain,
        "vs_hf_gc": vs_hf,
        "share": share,
        "measured_after_5": measured,
        "median_error": statistics.median(errors) if errors else None,
        "first_seen_none_vs_unmanaged": first_seen,
        "first_seen_steps": len(first),
        "plans": [plan_letters(r) for r in records[-1]],
    }
    row["met"] = bool(
        within == 0
        and share >= TARGETS["share"]
        and (gain < TARGETS["gain_for_vs_hf"] or vs_hf >= TARGETS["vs_hf"])
        and measured <= TARGETS["measured"]
        and (row["median_error"] or 0) <= TARGETS["error"]
        and not first_seen > TARGETS["first_seen"]
    )
    return row


def show(row: dict) -> None:
    n = len(row["lengths"])
    print(
        f"{row['arch']}: {n} batches of {min(row['lengths'])}..{max(row['lengths'])} tokens on a "
        f"{format_bytes(row['device_bytes'])} stand-in (HF gradient checkpointing's longest: {HF_LONGEST})"
    )
    for m in METHODS:
        print(
            f"  {m:<9} trained {n - row['failed'][m]:>2} of {n}, {row['tokens_per_s'][m]:,.0f} tokens/s "
            f"on the {row['both']} batches hf_gc and adaptmem both trained"
        )
    past = row["failed"]["adaptmem"] - row["adaptmem_failed_within_longest"]
    print(
        f"  adaptmem's predicted longest: {row['adaptmem_longest']:,} tokens; it failed "
        f"{row['adaptmem_failed_within_longest']} batch(es) within it" + (f", refused {past} past it" if past else "")
    )
    err = row["median_error"]
    print(
        f"  skipping recompute gains {row['gain']:.2f}x over hf_gc; adaptmem {row['vs_hf_gc']:.2f}x hf_gc, "
        f"{row['share']:.0%} of that gain"
    )
    print(
        f"  after the first 5 steps: {row['measured_after_5']:.0%} measured block by block, median prediction "
        f"error {err:.1%}"
        if err is not None
        else "  no predictions after the first 5 steps"
    )
    print(
        f"  first-seen lengths at all-NONE ({row['first_seen_steps']} steps): "
        f"{row['first_seen_none_vs_unmanaged']:.2f}x unmanaged's time"
    )
    print("  plan per batch (blocks N/S/C/O/R=CHECKPOINT+OFFLOAD, then the head):")
    width = max(row["lengths"])
    for n, plan in zip(row["lengths"], row["plans"]):
        print(f"    {n:>5} {'#' * max(1, round(24 * n / width)):<24} {plan}")
    print(
        f"  {'ok' if row['met'] else 'MISSED'} (targets: every batch up to its longest; "
        f">= {TARGETS['share']:.0%} of the gain; "
        f">= {TARGETS['vs_hf']}x hf_gc where the gain is >= {TARGETS['gain_for_vs_hf']}x; <= "
        f"{TARGETS['measured']:.0%} measured; error <= {TARGETS['error']:.0%}; first-seen <= {TARGETS['first_seen']}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--top", type=int, default=3072, help="the longest batch (tokens)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("adaptmem").setLevel(logging.ERROR)  # the skipped batches run out of memory on purpose
    lengths = stream(args.batches, args.top)
    rows = []
    for arch in args.arch:
        rows.append(measure(arch, lengths, args.passes))
        show(rows[-1])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
