import re

import pytest

from adaptmem import ALLOWED_MODES, read_log
from adaptmem.demo.__main__ import main


def test_the_quick_demo_fine_tunes_under_pressure(tmp_path, capsys):
    log = tmp_path / "demo.jsonl"
    assert main(["--quick", "--log", str(log), "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "unmanaged:  out of memory" in out
    assert "another process takes" in out and "gives it back" in out
    assert "14 in" in out and "pressure events" in out and "OOMs recovered" in out
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    lines = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(lines) == 14 and all(len(line.split()[6:]) == 4 for line in lines)  # a letter per block
    records = read_log(log)
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 14
    assert all(r["observed_peak_bytes"] <= r["budget_bytes"] for r in steps[1:])
    assert any(r["type"] == "pressure" for r in records)
    assert steps[-1]["decision"] in ("hold", "relax", "escalate")


def test_modes_table_prints_every_mode_with_exactness(capsys, caplog):
    with caplog.at_level("WARNING", logger="adaptmem"):
        assert main(["modes", "--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--repeats", "1"]) == 0
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the demo's own model draws no advice
    out = capsys.readouterr().out
    labels = {m.label for m in ALLOWED_MODES}
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in labels}
    assert set(rows) == labels
    for mode in ALLOWED_MODES:
        verdict = "bit-identical" if mode.lossless else "lossy, min cosine"
        assert verdict in rows[mode.label], rows[mode.label]
    assert "100.0%" in rows["NONE"]


@pytest.mark.slow
def test_the_main_job_is_a_long_sequence_llama_fine_tune(tmp_path, capsys):
    log = tmp_path / "demo.jsonl"
    # 14 steps (the --quick run): with 8, few lengths are measured block by block (the others are
    # predicted) and the longest predicted falls short of HF's, leaving the last act nothing to show
    assert main(["--steps", "14", "--log", str(log), "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "fine-tuning a Llama" in out and "unmanaged:  out of memory" in out
    steps = [r for r in read_log(log) if r["type"] == "step"]
    assert max(s["seq"] for s in steps) == 4096 and min(s["seq"] for s in steps) >= 128
    assert all(r["observed_peak_bytes"] <= r["budget_bytes"] for r in steps[1:])
    lines = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    heads = [line.split("|")[1].strip() for line in lines]  # the loss head after the block letters
    assert len(heads) == 14 and all(h == "L" or (h[0] == "c" and h[1:].isdigit()) for h in heads), heads
    assert heads == ["L" if r["head"] == "KEPT" else "c" + r["head"].split(":")[1] for r in steps]
    # the last act: a batch past HF gradient checkpointing's longest, which runs out of memory on it
    hf = int(re.search(r"HF gradient checkpointing +longest about ([\d,]+) tokens", out).group(1).replace(",", ""))
    length = int(re.search(r"a batch of 2 x ([\d,]+) tokens", out).group(1).replace(",", ""))
    assert length > hf and "HF gradient checkpointing: out of memory" in out and "adaptmem: trained it" in out
