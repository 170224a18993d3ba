"""The FSDP2 examples in docs/examples run as users run them, on two gloo processes on the CPU:
the torchrun script under `torch.distributed.run`, and the Lightning one under
`ModelParallelStrategy`, which starts its second rank itself. Both ranks run the same plan at
every step and keep their budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"


def run(command: list[str], out: Path) -> list[dict]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(out.with_name(f"{out.stem}.rank{r}{out.suffix}").read_text()) for r in range(2)]
    records = [r["records"] for r in ranks]
    assert len(records[0]) == len(records[1]) == 6
    assert [r["plan"] for r in records[0]] == [r["plan"] for r in records[1]]  # one plan per step
    assert [r["head"] for r in records[0]] == [r["head"] for r in records[1]]  # the loss head's part of it too
    assert all(r["head"] is not None for r in records[0])  # a Hugging Face model's head is managed
    for rank in records:
        assert all(r["observed_peak_bytes"] <= r["budget_bytes"] and r["attempt"] == 0 for r in rank), rank
    return ranks


@pytest.mark.slow
def test_the_torchrun_example_trains_on_two_ranks(tmp_path):
    out = tmp_path / "torchrun.json"
    script = str(EXAMPLES / "fsdp2_torchrun.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ranks = run([*launch, script, "--cpu", "--steps", "6", "--json", str(out)], out)
    assert all(r["summary"]["steps"] == 6 and r["summary"]["ooms"] == 0 for r in ranks)


@pytest.mark.slow
def test_the_lightning_example_trains_on_two_ranks(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "lightning.json"
    run([sys.executable, str(EXAMPLES / "fsdp2_lightning.py"), "--cpu", "--steps", "6", "--json", str(out)], out)
