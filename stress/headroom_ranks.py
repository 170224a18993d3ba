"""How long can each method go on two ranks under FSDP2? The longest sequence per rank, each rank
on a stand-in device of the same fixed size.

    python -m stress.headroom_ranks                          # vocab 32000, 480 MiB per rank
    python -m stress.headroom_ranks --device-mib 640 --json runs/headroom_ranks.json

The model of `stress.headroom` (a Llama from a config: 8 layers, hidden 256; random weights),
`fully_shard` on each decoder layer and then on the model, on two gloo processes on the CPU;
each rank trains its own batch of one sequence, AdamW. A length trains when a fresh model and
optimizer run `headroom.STEPS` training steps at it on both ranks. For FSDP2 + HF gradient
checkpointing (`hf_gc`, the peer) each rank counts its bytes on an unlimited stand-in and the
length trains when no rank's peak passed the device's size: an out-of-memory error on one rank
would leave the other inside a collective, and on the stand-in a run past its size fails at the
same allocation. FSDP2 + adaptmem (`adaptmem`: `adaptmem.manage(model)` after `fully_shard`, the
default policy and budget, the loss head managed) runs on a stand-in of the size itself, where
an out-of-memory error is real and retried by both ranks. The search (doubling from 256 tokens,
bisecting back to within 5%) is `headroom.search`, run alike on both ranks. Then, at hf_gc's
longest, adaptmem's step time over hf_gc's (the median of paired rounds, both on the stand-in).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import adaptmem
from adaptmem.config.units import format_bytes
from adaptmem.demo.longest import hf_checkpointing
from adaptmem.testing import SimulatedDevice
from stress.benchkit import log
from stress.headroom import STEPS, Run, build, interleaved, search, summary

METHODS = ("hf_gc", "adaptmem")
DEVICE_MIB = 480  # per rank, for vocab 32000: a rank's half of the weights and AdamW state, the gathered root, and room


class ShardedRun(Run):
    """One method's sharded model, optimizer and stand-in on this rank: of `capacity` bytes for
    adaptmem, unlimited (counting only) for the peer. Its steps are `Run.step`'s, on tokens of
    this rank's own."""

    def __init__(self, method: str, vocab: int, capacity: int) -> None:
        from torch.distributed.fsdp import fully_shard

        self.method, self.vocab, self.device, self.capacity = method, vocab, "cpu", capacity
        self.seed = dist.get_rank()
        model = build(vocab)
        if method == "hf_gc":
            hf_checkpointing(model, True)
        model.train()
        self.dev = SimulatedDevice(capacity if method == "adaptmem" else None, name=f"rank{self.seed}")
        with self.dev:  # the shards are made on the device: the weights and gradients counted are a rank's
            for layer in model.model.layers:
                fully_shard(layer)
            self.model = fully_shard(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.mem = adaptmem.manage(self.model, device=self.dev) if method == "adaptmem" else None

    def fits(self) -> bool:
        return self.mem is not None or self.dev.peak_bytes <= self.capacity


def trains(method: str, vocab: int, capacity: int, length: int) -> bool:
    """STEPS steps at `length` on both ranks; true on every rank when none failed."""
    run = ShardedRun(method, vocab, capacity)
    ok = True
    try:
        for _ in range(STEPS):
            run.step(length)
        ok = run.fits()
    except torch.OutOfMemoryError:  # adaptmem's: the ranks gave the step up together
        ok = False
    finally:
        run.close()
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


def paired_time(vocab: int, capacity: int, length: int, rounds: int = 3) -> float:
    """adaptmem's step over hf_gc's at `length` (rank 0's, the median of per-round ratios)."""
    return interleaved({m: ShardedRun(m, vocab, capacity) for m in METHODS}, length, rounds)


def rank_main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    torch.set_num_threads(1)
    say = log if args.rank == 0 else (lambda message: None)
    capacity = args.device_mib * 2**20
    say(f"[vocab {args.vocab}, 2 ranks under FSDP2, a stand-in of {format_bytes(capacity)} each]")
    found = {
        m: search(lambda n, m=m: trains(m, args.vocab, capacity, n), m, limit=args.limit, say=say) for m in args.methods
    }
    row = {"vocab": args.vocab, "ranks": 2, "device_bytes": capacity, "longest": found}
    if args.limit:
        row["limit"] = args.limit
    if set(METHODS) <= found.keys() and found["hf_gc"]:
        row["vs_hf_gc"] = found["adaptmem"] / found["hf_gc"]
        row["time_at_hf_gc_longest"] = paired_time(args.vocab, capacity, found["hf_gc"])
    if args.rank == 0:
        print(summary(f"vocab {args.vocab}, 2 ranks, {format_bytes(capacity)} each", row, args.limit), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([row], indent=2))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device-mib", type=int, default=DEVICE_MIB, help="each rank's stand-in")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--limit", type=int, default=0, help="the longest length tried (default: none)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    with socket.socket() as s:  # a free port for the two ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "stress.headroom_ranks", *forwarded, "--rank", str(r), "--port", str(port)], env=env
        )
        for r in range(2)
    ]
    codes = [p.wait() for p in ranks]
    return max(codes)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
