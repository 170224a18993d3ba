"""Run a worker script as two gloo ranks in processes of their own, and read what each wrote."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Path, tmp_path: Path, job: str, timeout: float = 240) -> list:
    """`python WORKER RANK 2 PORT OUT JOB` for ranks 0 and 1; what each saved to OUT. A rank
    left waiting (a deadlock) fails the test after `timeout` seconds instead of hanging the suite."""
    port, outs = free_port(), [tmp_path / f"{job}{r}.pt" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), "2", str(port), str(outs[r]), job],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank deadlocked ({job})")
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(out, weights_only=False) for out in outs]
