"""`adaptmem report`: the table's figures agree with the log, and the picture is written."""

import subprocess
import sys
import types

import pytest
import torch
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import read_log
from adaptmem.report import figures, main, rows
from adaptmem.testing import SimulatedDevice

pytest.importorskip("rich")
pytest.importorskip("matplotlib")
MiB = 2**20


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """A run with an out-of-memory error recovered and a pressure event."""
    path = tmp_path_factory.mktemp("report") / "run.jsonl"
    model = tiny()
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    fired = []

    def squeeze_once(module, args):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected")

    with dev, adaptmem.manage(model, budget="1GiB", device=dev, log=str(path)) as mem:
        for i in range(6):
            hook = model.blocks[1].register_forward_pre_hook(squeeze_once) if i == 3 else None
            mem.run_step(lambda: model(**tiny_batch(model)).loss.backward(), label={"i": i})
            if hook is not None:
                hook.remove()
            if i == 4:
                dev.occupy(int(2**31 * 0.7))
                mem.sampler.wait_ticks(1)
    return path


def test_the_table_agrees_with_the_log(log):
    records = read_log(log)
    (run,) = figures(records)
    steps = [r for r in records if r["type"] == "step"]
    got = rows(run)
    assert got["steps"] == str(len(steps)) == "6"
    assert got["OOMs recovered"] == "1" and got["OOMs"] == "1"
    assert got["pressure events"] == str(sum(r["type"] == "pressure" for r in records)) == "1"
    assert got["plan changes"] == str(sum(r["type"] == "plan" for r in records))
    worst = max(s["observed_peak_bytes"] / s["budget_bytes"] for s in steps)
    assert got["worst peak / budget"] == f"{worst:.1%}"
    assert all(len(s["plan"]) == 4 and s["rank"] == 0 and s["capacity_bytes"] == 2**31 for s in steps)


def test_steps_over_a_budget_others_held_lower_are_told_from_steps_over_yours(log):
    """A run whose budget others held lower counted "steps over budget: 10 (worst 156.9%)" where
    no step went over the budget asked for. Step records carry the user's budget, and the row
    tells the two apart where they differ."""
    records = read_log(log)
    steps = [r for r in records if r["type"] == "step"]
    assert all(s["user_budget_bytes"] == 2**30 for s in steps)
    (run,) = figures(records)
    assert rows(run)["steps over budget"] == "0"
    held = dict(steps[-1], budget_bytes=steps[-1]["observed_peak_bytes"] - 1)  # over the budget in force only
    over = dict(steps[-1], budget_bytes=1, user_budget_bytes=1)  # over both
    (run,) = figures([*records, held, held, over])
    assert rows(run)["steps over budget"] == (
        "3 (of the budget in force, held lower while others took memory); 1 over yours"
    )


def test_a_file_that_is_not_a_log_is_named_and_a_last_line_cut_short_is_left_out(log, tmp_path, capsys, caplog):
    bad = tmp_path / "notes.txt"
    bad.write_text("step 1 went well\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        main([str(bad)])
    assert "notes.txt, line 1: not an adaptmem log record" in capsys.readouterr().err
    cut = tmp_path / "cut.jsonl"
    text = log.read_text(encoding="utf-8")
    cut.write_text(text + text.splitlines()[-1][:40], encoding="utf-8")
    with caplog.at_level("WARNING", logger="adaptmem"):
        assert read_log(cut) == read_log(log)
    assert any("left out its last line, cut short" in r.getMessage() for r in caplog.records)


def test_the_command_prints_the_table_and_writes_the_picture(log, tmp_path, capsys):
    out = tmp_path / "run.png"
    assert main([str(log), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OOMs recovered" in text and "pressure events" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_python_dash_m_adaptmem_report(log, tmp_path):
    out = tmp_path / "cli.png"
    done = subprocess.run(
        [sys.executable, "-m", "adaptmem", "report", str(log), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.exists() and "steps" in done.stdout


def test_a_missing_log_is_explained(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope.jsonl")])
    assert "pass the path given as log=" in capsys.readouterr().err


def test_a_pressure_record_names_the_other_processes_from_nvml(monkeypatch):
    """NVML cannot run here: a stand-in pynvml answers as the real one does."""
    from adaptmem.devices.cuda import CudaProbe

    proc = lambda pid, used: types.SimpleNamespace(pid=pid, usedGpuMemory=used)
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [
            proc(1, 2 * MiB),
            proc(2, 9 * MiB),
            proc(__import__("os").getpid(), 5 * MiB),
        ],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    probe = CudaProbe.__new__(CudaProbe)
    probe._nvml = "handle"
    found = probe.processes()
    assert [(p["pid"], p["bytes"]) for p in found] == [(2, 9 * MiB), (1, 2 * MiB)]  # not us, largest first
    assert all(isinstance(p["name"], str) for p in found)
    probe._nvml = None
    assert probe.processes() is None


def test_a_run_whose_blocks_became_one_per_call_is_drawn_with_them(tmp_path):
    """A log whose `blocks` record names each call of a block the model calls more than once:
    the report's rows are those blocks, and the picture draws every one."""
    from control.test_repeated_calls import CALLS, RecurrentDepth, blocks_of, ids, loss_of

    path = tmp_path / "loop.jsonl"
    net = RecurrentDepth()
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), device=dev, log=str(path)) as mem:
            for i in range(3):
                mem.run_step(lambda: loss_of(net, ids(2, 16, i)).backward())
    (run,) = figures(read_log(path))
    assert run.blocks == CALLS and len(run.steps[-1]["plan"]) == len(CALLS)
    assert main([str(path), "--out", str(tmp_path / "loop.png")]) == 0 and (tmp_path / "loop.png").stat().st_size > 0
