"""`python -m adaptmem.demo`: a long-sequence fine-tune under memory pressure.

A Llama-architecture model built from a config (random weights, no download)
learns a synthetic task whose sequence length changes from batch to batch over
a wide range (128 to 4096 tokens). On a machine without a GPU it runs on a
`SimulatedDevice` too small for the unmanaged run, which is shown failing
first; with a GPU the same command uses the real device. Under
`adaptmem.manage` each batch gets a plan for the memory actually free; a third
of the way in, "another process" takes a share of the device for a while.

Each step prints one line: tokens, peak / budget, and the plan as one letter per
block. At the end: a summary table, the decision log and its picture.
`--quick` runs the embedded small transformer instead (no `transformers` needed);
`python -m adaptmem.demo modes` prints the per-mode table (`table.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.control.measure import measure_peak
from adaptmem.demo.longest import longest_batch
from adaptmem.demo.tiny import TinyConfig, TinyTransformer
from adaptmem.devices.simulated import SimulatedDevice

LETTER = {
    "NONE": "N",
    "SELECTIVE": "S",
    "CHECKPOINT": "C",
    "OFFLOAD": "O",
    "COMPRESS": "Z",
    "CHECKPOINT+OFFLOAD": "K",
    "COMPRESS+OFFLOAD": "Y",
}
LEGEND = (
    "N none, S selective, C checkpoint, O offload, K checkpoint+offload, Z compress, Y compress+offload;\n"
    "            after |, the loss head: L logits kept, c<n> logits chunked by n tokens"
)


@dataclass
class Job:
    """What the demo trains: the model, its batches, and the device it runs on."""

    name: str
    model: torch.nn.Module
    batches: list[dict]
    longest: dict
    device: Any  # a SimulatedDevice, or None for the real CUDA device
    capacity: int
    worst: int
    vocab: int


def counting_rows(vocab: int, batch: int, seq: int, gen: torch.Generator) -> dict:
    """Rows that count up from a random start (mod the vocabulary): learnable in a few
    dozen steps, so the loss visibly falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    ids = (start + torch.arange(seq)) % vocab
    return {"input_ids": ids, "labels": ids}


def lengths(steps: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    """Log-uniform lengths from `low` to `high` (multiples of 64); the longest comes early."""
    out = []
    for i in range(steps):
        u = torch.rand((), generator=gen).item()
        if i in (1, 2):
            u = max(u, 0.85) if i == 1 else 1.0
        out.append(max(low, int(low * (high / low) ** u) // 64 * 64))
    return out


def llama_job(opts: argparse.Namespace, gen: torch.Generator, cuda: bool) -> Job:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=opts.dim,
        intermediate_size=int(opts.dim * 2.6875),
        num_hidden_layers=opts.layers,
        num_attention_heads=max(2, opts.dim // 64),
        num_key_value_heads=max(1, opts.dim // 128),
        max_position_embeddings=opts.max_seq,
        attention_dropout=0.0,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    seqs = lengths(opts.steps, opts.min_seq, opts.max_seq, gen)
    batches = [counting_rows(cfg.vocab_size, opts.batch, s, gen) for s in seqs]
    longest = counting_rows(cfg.vocab_size, opts.batch, opts.max_seq, gen)
    return _job(f"Llama ({opts.layers} layers, hidden {opts.dim})", model, batches, longest, opts, cuda, cfg.vocab_size)


def tiny_job(opts: argparse.Namespace, gen: torch.Generator, cuda: bool) -> Job:
    cfg = TinyConfig(
        dim=opts.dim,
        n_layers=opts.layers,
        n_heads=max(1, opts.dim // 64),
        vocab_size=256,
        max_seq=max(2048, opts.max_seq),
        attention="eager",
    )
    model = TinyTransformer(cfg)
    seqs = lengths(opts.steps, opts.min_seq, opts.max_seq, gen)
    batches = [counting_rows(cfg.vocab_size, opts.batch, s, gen) for s in seqs]
    longest = counting_rows(cfg.vocab_size, opts.batch, opts.max_seq, gen)
    name = f"small transformer ({opts.layers} blocks, dim {opts.dim})"
    return _job(name, model, batches, longest, opts, cuda, cfg.vocab_size)


def _job(
    name: str,
    model: torch.nn.Module,
    batches: list[dict],
    longest: dict,
    opts: argparse.Namespace,
    cuda: bool,
    vocab: int,
) -> Job:
    if cuda:  # the real device; the budget is the same share of the unmanaged peak as the stand-in's size
        model.cuda()
        longest = _to(longest, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(**longest).loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        worst = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()  # what the unmanaged step reserved is not the managed run's to keep
        return Job(
            name, model, [_to(b, "cuda") for b in batches], longest, None, int(worst * opts.device_share), worst, vocab
        )
    worst = measure_peak(model, lambda: longest)
    return Job(
        name,
        model,
        batches,
        longest,
        SimulatedDevice(int(worst * opts.device_share), name="demo-gpu"),
        int(worst * opts.device_share),
        worst,
        vocab,
    )


def _to(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m adaptmem.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the embedded small transformer, shorter sequences")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 30; 14 with --quick)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--min-seq", type=int, default=None)
    parser.add_argument("--max-seq", type=int, default=None)
    parser.add_argument(
        "--device-share",
        type=float,
        default=0.5,
        help="the device's size as a share of the unmanaged peak at the longest batch "
        "(on a GPU: the share of it the run may use)",
    )
    parser.add_argument("--policy", default="balanced")
    parser.add_argument("--log", default="runs/demo.jsonl")
    parser.add_argument("--cpu", action="store_true", help="use the simulated device even when a GPU is present")
    opts = parser.parse_args(argv)
    defaults = (
        dict(steps=14, layers=4, dim=64, batch=4, min_seq=64, max_seq=512)
        if opts.quick
        else dict(steps=30, layers=8, dim=192, batch=2, min_seq=128, max_seq=4096)
    )
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else list(argv))
    cuda = torch.cuda.is_available() and not opts.cpu
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    job = (tiny_job if opts.quick else llama_job)(opts, gen, cuda)
    where = (
        f"{torch.cuda.get_device_name()}, {format_bytes(job.capacity)} of it"
        if cuda
        else f"a simulated device of {format_bytes(job.capacity)}"
    )
    print(
        f"adaptmem demo: fine-tuning a {job.name} on {opts.batch} x {opts.min_seq}..{opts.max_seq} tokens "
        f"per batch,\non {where} (unmanaged, the longest batch needs {format_bytes(job.worst)}).\n"
    )
    if job.device is not None:
        show_unmanaged_failure(job)
    return train_managed(job, opts)


def show_unmanaged_failure(job: Job) -> None:
    dev = job.device
    dev.track(job.model)
    with dev:
        try:
            for batch in job.batches:
                job.model(**batch).loss.backward()
                job.model.zero_grad(set_to_none=True)
            print("unmanaged:  every batch fitted (raise the lengths or lower --device-share to see it fail)\n")
        except torch.OutOfMemoryError as err:
            first = ". ".join(str(err).split(". ")[:2])
            print(f"unmanaged:  out of memory at a batch of {tuple(batch['input_ids'].shape)} tokens:\n  {first}.\n")
    job.model.zero_grad(set_to_none=True)


def train_managed(job: Job, opts: argparse.Namespace) -> int:
    Path(opts.log).parent.mkdir(parents=True, exist_ok=True)
    model, dev = job.model, job.device
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    pressure_at, release_at = opts.steps // 3, opts.steps // 3 + 4
    taken = int(job.capacity * 0.3)
    budget = "90%" if dev is not None else int(0.9 * job.capacity)  # on a GPU: 90% of the share it may use
    shown = repr(budget) if dev is not None else f"{budget}  # {format_bytes(budget)}"
    print(f"managed:    adaptmem.manage(model, policy={opts.policy!r}, log={opts.log!r}, budget={shown})")
    print(f"            plan letters, one per block: {LEGEND}")
    print(f"{'step':>4} {'tokens':>6} {'loss':>6} {'peak':>10} {'/ budget':>8}  plan")
    start, losses = time.perf_counter(), []
    with (
        dev if dev is not None else contextlib.nullcontext(),
        adaptmem.manage(model, policy=opts.policy, budget=budget, device=dev, log=opts.log) as mem,
    ):
        for i, batch in enumerate(job.batches):
            if dev is not None and i == pressure_at:
                dev.occupy(taken)
                print(f"     -- another process takes {format_bytes(taken)} of the device --")
                mem.sampler.wait_ticks(1)  # the background thread notices
            if dev is not None and i == release_at:
                dev.occupy(-taken)
                print("     -- ...and gives it back --")
            loss = mem.run_step(_train, model, batch, label={"step": i})
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
            print(step_line(i + 1, loss, mem.last_step), flush=True)
        summary = mem.summary()
        records = mem.events.records
        # the last act, on the stand-in: a batch longer than HF gradient checkpointing can train
        finale = dev is not None and hasattr(model, "gradient_checkpointing_enable")
        state, reach = (mem.state_dict(), mem.longest_sequence(opts.batch)) if finale else (None, None)
    took = time.perf_counter() - start
    print(summary_table(summary, records, losses, took))
    print(f"Decision log: {opts.log}")
    picture(opts.log)
    if finale:
        gen = torch.Generator().manual_seed(2)
        longest_batch(model, dev, opt, state, reach, lambda b, n: counting_rows(job.vocab, b, n, gen), opts, _train)
    return 0


def step_line(step: int, loss: float, record: dict) -> str:
    plan = " ".join(LETTER.get(m, "?") for m in record["plan"])
    head = record.get("head")
    if head is not None:
        plan += " | " + ("L" if head == "KEPT" else "c" + head.partition(":")[2])
    retried = f"  (recovered from {record['attempt']} OOM)" if record["attempt"] else ""
    return (
        f"{step:>4} {record['tokens']:>6} {loss:>6.3f} {format_bytes(record['observed_peak_bytes']):>10} "
        f"{record['observed_peak_bytes'] / record['budget_bytes']:>8.0%}  {plan}{retried}"
    )


def summary_table(summary: dict, records: list[dict], losses: list[float], took: float) -> str:
    steps = [r for r in records if r["type"] == "step"]
    worst = max(s["observed_peak_bytes"] / s["budget_bytes"] for s in steps[1:]) if len(steps) > 1 else 0.0
    rows = [
        ("steps", f"{summary['steps']} in {took:.0f}s"),
        ("tokens per batch", f"{min(s['tokens'] for s in steps)}..{max(s['tokens'] for s in steps)}"),
        ("loss", f"{losses[0]:.3f} -> {losses[-1]:.3f}"),
        ("peak", f"{format_bytes(summary['peak_bytes'])}; worst step after the first at {worst:.0%} of its budget"),
        ("OOMs recovered", str(summary["ooms_recovered"])),
        ("plan changes", str(summary["plan_changes"])),
        ("pressure events", str(summary["pressure_events"])),
        (
            "mean prediction error",
            f"{summary['prediction_error_mean']:.1%}" if summary["prediction_error_mean"] is not None else "-",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def picture(log: str) -> None:
    try:
        from adaptmem.control.events import read_log
        from adaptmem.report import figures
        from adaptmem.report import picture as draw

        run = [r for r in figures(read_log(log)) if r.steps][-1]
        out = draw(run, Path(log).with_suffix(".png"))
        print(f"Picture: {out}  (adaptmem report {log} prints the table again)")
    except ImportError:
        print('Picture: skipped (pip install "adaptmem[report]" for matplotlib)')


def _train(model: torch.nn.Module, batch: dict) -> float:
    out = model(**batch)
    out.loss.backward()
    return out.loss.item()
