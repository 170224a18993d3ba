"""Peak memory and step time per mode on a Hugging Face Llama, side by side in one run.

    python stress/bench_modes.py                       # CUDA if present, else CPU
    python stress/bench_modes.py --device cuda --seq 2048 --preset 1b
    python stress/bench_modes.py --device cpu --seq 512 --json out.json

On CUDA, peak is `torch.cuda.max_memory_allocated` above what the model and
optimizer-free state hold before the step; times are CUDA-synchronized medians.
On the CPU, peak comes from `adaptmem.testing.SimulatedDevice` in a separate
run, and times are taken without it (the stand-in slows every op).
Ratios compare modes measured in this same process, one after another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

import adaptmem
from adaptmem import ALLOWED_MODES, Mode
from adaptmem.config.units import format_bytes
from adaptmem.testing import SimulatedDevice

try:
    from stress.verdicts import at_most, interval, plain
except ImportError:  # run as a script: stress/ is on the path, not its parent
    from verdicts import at_most, interval, plain

PRESETS = {
    # TinyLlama-1.1B's shape
    "1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    ),
    # small tensors, so the host launching ops bounds the step, as on a GPU at batch 1 (16 tokens,
    # batch 1, vocab 256 by default); weight layers of 256 inputs, the least SELECTIVE holds
    "launch": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2
    ),
}


def build(preset: str, vocab: int, device: str, dtype: torch.dtype, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=8192,
        use_cache=False,
        attention_dropout=0.0,
        **{**PRESETS[preset], **overrides},
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def one_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


HF_CHECKPOINTING = "HF checkpointing"  # the model's own checkpointing: the peer users pick today


class OnTorchCheckpoint:
    """A recomputing mode with its block checkpoint run by `torch.utils.checkpoint` instead of
    adaptmem's own (`adaptmem.strategies.rerun`): what the latter saves in host work."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.label = f"{mode.label} on torch"

    @contextmanager
    def installed(self):
        from torch.utils.checkpoint import checkpoint

        from adaptmem.strategies import rerun

        def on_torch(fn, *args):
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)

        own, rerun.checkpoint = rerun.checkpoint, on_torch
        try:
            yield
        finally:
            rerun.checkpoint = own


class FusedCodec:
    """COMPRESS with its codec other than the default ("auto": Triton's kernels on CUDA where they
    run, else eager ops): compiled by `torch.compile` (`CompressOptions.compile` "on"), Triton's
    kernels ("triton"), or eager ops ("off")."""

    mode = Mode.COMPRESS
    LABELS = {"on": "COMPRESS fused codec", "triton": "COMPRESS triton codec", "off": "COMPRESS eager codec"}

    def __init__(self, handles, how: str = "on") -> None:
        self.handles, self.how = handles, how
        self.label = self.LABELS[how]

    @contextmanager
    def installed(self):
        from dataclasses import replace

        own = [h.compress_options for h in self.handles]
        for h in self.handles:
            h.compress_options = replace(h.compress_options, compile=self.how)
        try:
            yield
        finally:
            for h, options in zip(self.handles, own):
                h.compress_options = options


class SelectiveShare:
    """SELECTIVE with another share of its held outputs' FLOPs left to the recompute
    (`selective.RECOMPUTE_SHARE`): each block chooses at its first forward under the row, and
    keeps that choice for the row's later rounds, as the default row keeps its own."""

    mode = Mode.SELECTIVE

    def __init__(self, share: float) -> None:
        self.share = share
        self.label = f"SELECTIVE share {share:g}"
        self.known: dict = {}  # block -> what it learned under this row

    @contextmanager
    def installed(self):
        from adaptmem.strategies import selective

        own, known = selective.RECOMPUTE_SHARE, dict(selective._BLOCKS)
        selective.RECOMPUTE_SHARE = self.share
        selective._BLOCKS.clear()
        selective._BLOCKS.update(self.known)
        try:
            yield
        finally:
            self.known = dict(selective._BLOCKS)
            selective.RECOMPUTE_SHARE = own
            selective._BLOCKS.clear()
            selective._BLOCKS.update(known)


def set_mode(model, handles, mode) -> None:
    """Every block in `mode`, or (the peer's row) every block plain under the model's own checkpointing."""
    from adaptmem.integrations.transformers import switch_own_checkpointing

    peer = mode == HF_CHECKPOINTING
    switch_own_checkpointing(model, peer)
    for h in handles:
        h.mode = Mode.NONE if peer else getattr(mode, "mode", mode)


def run_as(mode):
    """The context a row's mode runs in: PyTorch's checkpoint installed for `OnTorchCheckpoint`, its
    codec for `FusedCodec`, its recompute share for `SelectiveShare`."""
    return mode.installed() if isinstance(mode, (OnTorchCheckpoint, FusedCodec, SelectiveShare)) else nullcontext()


def peak_of(model, ids, device) -> int:
    """The step's peak above what is allocated before it (after a warm-up step that fills the pinned pool)."""
    one_step(model, ids)
    if device == "cuda":
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        one_step(model, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    with SimulatedDevice() as dev:
        one_step(model, ids)
    return dev.peak_bytes


def times_of(model, ids, steps, device) -> list[float]:
    one_step(model, ids)  # warm-up after a mode switch
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        one_step(model, ids)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def round_ratios(a: list[float], b: list[float]) -> list[float]:
    """Round by round, `a`'s time over `b`'s: the rounds time every mode, so drift hits both alike."""
    return [x / y for x, y in zip(a, b)]


def selective_verdicts(rows: list[dict], batch: int) -> list:
    """SELECTIVE against its targets, where NONE and CHECKPOINT ran beside it: a step never slower
    than CHECKPOINT's; with a batch of several sequences, a peak at most 60% of NONE's and a
    recompute overhead at most a third of CHECKPOINT's (round by round, (S - N) / (C - N)). At
    batch 1 the step's peak is the loss head's, alike in both."""
    by = {r["mode"]: r for r in rows}
    if not {"NONE", "SELECTIVE", "CHECKPOINT"} <= by.keys():
        return []
    none, sel, chk = (by[m]["round_s"] for m in ("NONE", "SELECTIVE", "CHECKPOINT"))
    verdicts = [at_most("step / CHECKPOINT's step <= 1.00", round_ratios(sel, chk), 1.0)]
    if batch > 1:
        peak = by["SELECTIVE"]["peak_bytes"] / by["NONE"]["peak_bytes"]
        shares = [(s - n) / (c - n) if c > n else float("inf") for n, s, c in zip(none, sel, chk)]
        verdicts += [
            plain(f"peak {peak:.1%} of NONE's <= 60%", peak <= 0.6),
            at_most("overhead / CHECKPOINT's overhead <= 0.33", shares, 1 / 3),
        ]
    return verdicts


def checkpoint_verdicts(rows: list[dict]) -> list:
    """Each recomputing mode on adaptmem's checkpoint against the same mode on PyTorch's (rows of
    `--torch-checkpoint`), round by round: never slower."""
    by = {r["mode"]: r for r in rows}
    return [
        at_most(f"{mode}: step / the same on torch.utils.checkpoint <= 1.00", round_ratios(own, theirs), 1.0)
        for mode, own, theirs in (
            (m, by[m]["round_s"], by[f"{m} on torch"]["round_s"]) for m in by if f"{m} on torch" in by
        )
    ]


def link_gbps(nbytes: int = 1 << 30) -> tuple[float, float]:
    """Device-to-host and host-to-device GB/s of one pinned copy of `nbytes`: the floor of offload's time."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates[0], rates[1]


def _range(run: dict, i: int) -> str:
    """` [low, high]`: the 95% interval of row `i`'s step ratio to NONE, where the run kept its rounds."""
    rounds, base = run["rows"][i].get("round_s"), run["rows"][0].get("round_s")
    if not rounds or not base or i == 0:
        return ""
    low, high = interval(round_ratios(rounds, base))
    return f" [{low:.2f}, {high:.2f}]"


def _cell(run: dict, i: int | None) -> str:
    """Row `i` of a run as a table cell: peak and step against NONE ("-" where the run has no such row)."""
    if i is None:
        return "-"
    row = run["rows"][i]
    return f"{row['peak_ratio']:.1%}, {row['time_ratio']:.2f}x{_range(run, i)}"


def render(paths: list[Path]) -> str:
    """A Markdown table of runs saved with --json, side by side: peak and step time against NONE.
    Rows are matched by mode, in the order the modes first appear; a run that did not time a mode
    shows a dash there."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    head = "| mode | " + " | ".join(f"peak / NONE, step / NONE (batch {r['batch']} x {r['seq']})" for r in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    where_in = [{row["mode"]: i for i, row in enumerate(r["rows"])} for r in runs]
    for mode in dict.fromkeys(row["mode"] for r in runs for row in r["rows"]):
        cells = [_cell(run, index.get(mode)) for run, index in zip(runs, where_in)]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    first = runs[0]
    where = f"{first['device']}, Llama preset {first['preset']!r}, vocab {first['vocab']}"
    if first.get("compiled_blocks"):
        where += ", blocks compiled"
    if first.get("link_gbps"):
        where += f"; pinned copies {first['link_gbps'][0]:.0f} GB/s each way"
    nones = ", ".join(
        f"{format_bytes(r['rows'][0]['peak_bytes'])} in {r['rows'][0]['step_s'] * 1e3:.0f} ms" for r in runs
    )
    return "\n".join(lines) + f"\n\n{where}; NONE: {nones}."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="model shape (default: 1b on CUDA, small on CPU; launch: small tensors, host-bound)",
    )
    p.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (default 2048 on CUDA, 512 on CPU, 16 for launch)"
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="vocabulary (default 32000 on CUDA; 4096 on CPU, where a large vocabulary's "
        "gradients and logits would hide the activations; 256 for launch)",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default 1 on CUDA and for launch, 4 on CPU)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    p.add_argument("--repeat", type=int, default=3, help="rounds over every mode (rotated repetitions)")
    p.add_argument(
        "--modes",
        default=",".join(m.label for m in ALLOWED_MODES),
        help="comma-separated modes to time, each block in that mode",
    )
    p.add_argument(
        "--no-peer",
        action="store_true",
        help=f"leave out the {HF_CHECKPOINTING!r} row (the model's own gradient_checkpointing_enable())",
    )
    p.add_argument(
        "--torch-checkpoint",
        action="store_true",
        help="add rows of the recomputing modes run on torch.utils.checkpoint instead of adaptmem's own",
    )
    p.add_argument(
        "--fused-codec",
        action="store_true",
        help="add a row of COMPRESS with its codec compiled (CompressOptions(compile='on'))",
    )
    p.add_argument(
        "--triton-codec",
        action="store_true",
        help="add a row of COMPRESS with its codec in Triton's kernels (CompressOptions(compile='triton'))",
    )
    p.add_argument(
        "--eager-codec",
        action="store_true",
        help="add a row of COMPRESS with its codec as eager ops (CompressOptions(compile='off'))",
    )
    p.add_argument(
        "--selective-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="add a row of SELECTIVE leaving SHARE of its held outputs' FLOPs to the recompute "
        "(adaptmem.strategies.selective.RECOMPUTE_SHARE; the default row leaves none)",
    )
    p.add_argument(
        "--compile-blocks",
        action="store_true",
        help="compile each block for every row (adaptmem.compile_blocks): the recomputing modes then run "
        "PyTorch's checkpoint, SELECTIVE its selective checkpointing, under the compiler",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the Markdown table of runs saved with --json, and exit",
    )
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0

    cuda = args.device == "cuda"
    preset = args.preset or ("1b" if cuda else "small")
    launch = preset == "launch"
    seq = args.seq or (16 if launch else 2048 if cuda else 512)
    vocab = args.vocab or (256 if launch else 32000 if cuda else 4096)
    args.batch = args.batch or (1 if cuda or launch else 4)
    dtype = torch.bfloat16 if cuda else torch.float32
    if launch and not cuda:  # one thread issuing small ops, as a GPU's host does
        torch.set_num_threads(1)
    modes = [Mode.parse(m) for m in args.modes.split(",")]
    if args.torch_checkpoint:
        modes += [OnTorchCheckpoint(m) for m in modes if m.recomputes and not m & Mode.OFFLOAD]
    modes += [] if args.no_peer else [HF_CHECKPOINTING]
    model = build(preset, vocab, args.device, dtype)
    handles = adaptmem.instrument(model)
    modes += [FusedCodec(handles)] if args.fused_codec else []
    modes += [FusedCodec(handles, "triton")] if args.triton_codec else []
    modes += [FusedCodec(handles, "off")] if args.eager_codec else []
    modes += [SelectiveShare(args.selective_share)] if args.selective_share is not None else []
    if args.compile_blocks:
        adaptmem.compile_blocks(model)
    ids = torch.randint(0, vocab, (args.batch, seq), device=args.device)
    where = torch.cuda.get_device_name() if cuda else "CPU (peak from SimulatedDevice, time measured without it)"
    print(
        f"Llama preset {preset!r} (vocab {vocab}), {len(handles)} blocks"
        f"{' compiled' if args.compile_blocks else ''}, batch {args.batch} x {seq}, {dtype}, on {where}",
        flush=True,
    )
    link = link_gbps() if cuda else None
    if link:
        print(f"pinned copies: device to host {link[0]:.1f} GB/s, host to device {link[1]:.1f} GB/s", flush=True)
    peaks, times, rounds = {}, {m: [] for m in modes}, {m: [] for m in modes}

    def take_peaks():
        for i, mode in enumerate(modes, 1):
            set_mode(model, handles, mode)
            with run_as(mode):
                peaks[mode] = peak_of(model, ids, args.device)
            label = getattr(mode, "label", mode)
            print(f"  [{i}/{len(modes)}] {label:<20} peak {format_bytes(peaks[mode]):>12}", flush=True)

    # the stand-in reads the CPU through a dispatch mode, and compiled code run under one is not run
    # compiled again (the steps after ran at eager speed): compiled on the CPU, peaks come last
    peaks_last = args.compile_blocks and not cuda
    if not peaks_last:
        take_peaks()
    for r in range(args.repeat):  # rotated: each round times every mode once, so drift hits all alike
        for mode in modes:
            set_mode(model, handles, mode)
            with run_as(mode):
                took = times_of(model, ids, args.steps, args.device)
            times[mode] += took
            rounds[mode].append(statistics.median(took))
        print(f"  round {r + 1}/{args.repeat} timed", flush=True)
    if peaks_last:
        take_peaks()
    rows = [
        {
            "mode": getattr(m, "label", m),
            "peak_bytes": peaks[m],
            "step_s": statistics.median(times[m]),
            "spread": (max(times[m]) - min(times[m])) / statistics.median(times[m]),
            "round_s": rounds[m],
        }
        for m in modes
    ]
    base = next((r for r in rows if r["mode"] == "NONE"), rows[0])
    print(f"\n{'mode':<20} {'peak':>12} {'peak/NONE':>10} {'step':>10} {'step/NONE [95% interval]':>26}")
    for r in rows:
        r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        paired = round_ratios(r["round_s"], base["round_s"])  # each round's ratio, as its interval reads
        r["time_ratio"] = statistics.median(paired) if paired else r["step_s"] / base["step_s"]
        low, high = interval(paired)
        print(
            f"{r['mode']:<20} {format_bytes(r['peak_bytes']):>12} {r['peak_ratio']:>10.1%} "
            f"{r['step_s'] * 1e3:>8.1f}ms {r['time_ratio']:>9.2f}x [{low:.2f}, {high:.2f}]"
        )
    for title, verdicts in (
        ("SELECTIVE's targets", selective_verdicts(rows, args.batch)),
        ("adaptmem's checkpoint against PyTorch's", checkpoint_verdicts(rows)),
    ):
        if verdicts:
            print(f"\n{title}:")
            for v in verdicts:
                print(f"  {v.state:<9} {v.what}" + (f" [{v.low:.2f}, {v.high:.2f}]" if v.low is not None else ""))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "preset": preset,
                    "vocab": vocab,
                    "seq": seq,
                    "batch": args.batch,
                    "compiled_blocks": args.compile_blocks,
                    "device": where,
                    "link_gbps": link,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
