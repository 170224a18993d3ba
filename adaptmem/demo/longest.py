"""The demo's last act: one batch longer than HF gradient checkpointing can train on the same device.

After the fine-tune, adaptmem predicts its longest sequence at the demo's batch
(`MemoryManager.longest_sequence`). HF gradient checkpointing's longest is found
by measuring its peak at two lengths on the same device with no limit (its peak
is linear in the tokens: every layer's input kept, one layer recomputed, the
logits) and solving for the device's size. Then, on the device as it is, HF
gradient checkpointing runs a batch past that and runs out of memory, and
adaptmem trains the same batch.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

import adaptmem
from adaptmem.config.units import format_bytes

#: Lengths HF gradient checkpointing's peak is measured at (tokens per sample).
PROBE_LENGTHS = (512, 1024)
#: Of adaptmem's predicted longest, the share the demo trains: the prediction is within a few
#: percent (`stress/reach_accuracy.py`), and a demo should not stand on its edge.
SHARE = 0.9
GRAIN = 64


def hf_checkpointing_longest(model: torch.nn.Module, dev: Any, rows, batch: int) -> int:
    """HF gradient checkpointing's longest sequence at `batch` on `dev` (weights, gradients and
    the optimizer's state resident as they are), from its peak at `PROBE_LENGTHS`."""
    capacity, peaks = dev.capacity_bytes, []
    hf_checkpointing(model, True)
    try:
        dev.set_capacity(None)
        with dev:
            for length in PROBE_LENGTHS:
                dev.reset_peak()
                model(**rows(batch, length)).loss.backward()
                model.zero_grad(set_to_none=True)
                peaks.append(dev.peak_bytes)
    finally:
        dev.set_capacity(capacity)
        hf_checkpointing(model, False)
    slope = (peaks[1] - peaks[0]) / (PROBE_LENGTHS[1] - PROBE_LENGTHS[0])
    return max(0, int(PROBE_LENGTHS[1] + (capacity - dev.external_bytes - peaks[1]) / max(slope, 1e-9)))


def hf_checkpointing_fails(model: torch.nn.Module, dev: Any, batch: dict) -> str | None:
    """HF gradient checkpointing's step on `batch`: the out-of-memory message, or None if it fitted."""
    hf_checkpointing(model, True)
    try:
        with dev:
            model(**batch).loss.backward()
        return None
    except torch.OutOfMemoryError as err:
        return ". ".join(str(err).split(". ")[:2])
    finally:
        model.zero_grad(set_to_none=True)
        hf_checkpointing(model, False)


def hf_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """HF's one line, under its current name (`activation_checkpointing_*` since transformers 5.x)."""
    verb = "enable" if on else "disable"
    call = getattr(model, f"activation_checkpointing_{verb}", None) or getattr(model, f"gradient_checkpointing_{verb}")
    call()


def longest_batch(
    model: torch.nn.Module,
    dev: Any,
    opt: torch.optim.Optimizer,
    state: dict,
    reach: Any,
    rows,
    opts: argparse.Namespace,
    train,
) -> None:
    """Print both lengths, show HF gradient checkpointing running out of memory past its own, and
    train that batch under adaptmem (resumed from the fine-tune's `state`)."""
    batch = opts.batch
    hf = hf_checkpointing_longest(model, dev, rows, batch)
    length = max(GRAIN, int(reach.length * SHARE) // GRAIN * GRAIN)
    print(f"\nHow long can I go? On this device, at batch {batch}:")
    print(
        f"  HF gradient checkpointing   longest about {hf:,} tokens (its peak measured at "
        f"{' and '.join(map(str, PROBE_LENGTHS))}, solved for the device)"
    )
    print(f"  adaptmem                    longest {reach.length:,} tokens predicted: {reach}")
    if length <= hf:
        print(f"  adaptmem reaches no further than HF here ({length:,} tokens): nothing longer to show.")
        return
    long = rows(batch, length)
    failed = hf_checkpointing_fails(model, dev, long)
    print(
        f"  a batch of {batch} x {length:,} tokens ({length / max(hf, 1):.2f}x HF's longest), "
        f"{SHARE:.0%} of adaptmem's predicted longest:"
    )
    print(f"    HF gradient checkpointing: {'out of memory: ' + failed if failed else 'fitted after all'}")
    quiet = logging.getLogger("adaptmem")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a length never run warns that it is extrapolated: the lines below say it
    try:
        with dev, adaptmem.manage(model, policy=opts.policy, budget="90%", device=dev) as mem:
            mem.load_state_dict(state)
            loss = mem.run_step(train, model, long)
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = mem.last_step
    finally:
        quiet.setLevel(level)
    plan = ", ".join(f"{m} x{record['plan'].count(m)}" for m in dict.fromkeys(record["plan"]))
    retried = f", after {record['attempt']} out-of-memory retries" if record["attempt"] else ""
    print(
        f"    adaptmem: trained it (loss {loss:.3f}), peak {format_bytes(record['observed_peak_bytes'])} of "
        f"{format_bytes(dev.capacity_bytes)}, under {plan}; head {record.get('head')}{retried}"
    )
