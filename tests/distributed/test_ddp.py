"""Two real processes on gloo under DistributedDataParallel: the ranks run the same plan at
every step although their devices differ and only one sees outside pressure; an OOM in
backward on one rank makes both retry, with no deadlock and parameters equal to plain DDP."""

from pathlib import Path

import pytest
import torch
from ranks import run_ranks

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_ranks_agree_and_retry_together(tmp_path):
    plain = run_ranks(WORKER, tmp_path, "plain")
    managed = run_ranks(WORKER, tmp_path, "managed")
    steps = [[r for r in m["records"] if "plan" in r] for m in managed]
    summaries = [m["records"][-1]["summary"] for m in managed]
    assert [s["plan"] for s in steps[0]] == [s["plan"] for s in steps[1]]  # one plan per step on both ranks
    assert len(steps[0]) == len(steps[1]) == 6
    assert summaries[0]["ooms_recovered"] == summaries[1]["ooms_recovered"] == 1  # both retried
    assert steps[0][2]["attempt"] == steps[1][2]["attempt"] == 1
    assert summaries[1]["pressure_events"] >= 1 and summaries[0]["pressure_events"] == 0
    for rank in range(2):
        expected = plain[rank]["params"]
        assert all(torch.equal(p, expected[n]) for n, p in managed[rank]["params"].items())
    for rank in range(2):
        assert all(s["observed_peak_bytes"] <= s["budget_bytes"] for s in steps[rank][1:]), steps[rank]


@pytest.mark.slow
def test_ranks_run_the_same_plan_in_each_forward_of_a_contrastive_step(tmp_path):
    """Two forwards before one backward on each rank, their devices different and one pressed:
    the second forward runs one plan on both ranks, as the first does."""
    managed = run_ranks(WORKER, tmp_path, "contrastive")
    steps = [[r for r in m["records"] if "plan" in r] for m in managed]
    assert len(steps[0]) == len(steps[1]) == 6
    assert all(s["forward_plans"] is not None and len(s["forward_plans"]) == 2 for s in steps[0] + steps[1])
    assert [s["forward_plans"] for s in steps[0]] == [s["forward_plans"] for s in steps[1]]
    for rank in range(2):  # from the second step, the first forward leaves room for the second
        assert all(s["observed_peak_bytes"] <= s["budget_bytes"] for s in steps[rank][1:]), steps[rank]


@pytest.mark.slow  # 9 s: FSDP2's loop test covers two ranks in `make test`
def test_ranks_make_each_call_of_a_looped_block_a_block_at_the_same_step(tmp_path):
    """A model that runs two blocks three times a forward, under DDP on two ranks whose devices
    differ: both find the loop at the first step and run one plan of nine blocks at every step
    after it, exactly as plain DDP."""
    plain = run_ranks(WORKER, tmp_path, "loop-plain")
    managed = run_ranks(WORKER, tmp_path, "loop")
    steps = [[r for r in m["records"] if "plan" in r] for m in managed]
    assert [s["plan"] for s in steps[0]] == [s["plan"] for s in steps[1]]
    assert [len(s["plan"]) for s in steps[0]] == [5] + [9] * 5
    for rank in range(2):
        expected = plain[rank]["params"]
        assert all(torch.equal(p, expected[n]) for n, p in managed[rank]["params"].items())
