from adaptmem import ALLOWED_MODES
from adaptmem.demo.__main__ import main
from adaptmem import read_log


def test_demo_fine_tunes_under_pressure(tmp_path, capsys):
    log = tmp_path / "demo.jsonl"
    assert main(["--steps", "14", "--layers", "4", "--dim", "64", "--max-seq", "384", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert "unmanaged:  out of memory" in out
    assert "another process takes" in out and "gives it back" in out
    assert "14 steps in" in out and "pressure event(s)" in out
    records = read_log(log)
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 14
    assert all(r["observed_peak_bytes"] <= r["budget_bytes"] for r in steps[1:])
    assert any(r["type"] == "pressure" for r in records)
    assert steps[-1]["decision"] in ("hold", "relax", "escalate")


def test_modes_table_prints_every_mode_with_exactness(capsys):
    assert main(["modes", "--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    labels = {m.label for m in ALLOWED_MODES}
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in labels}
    assert set(rows) == labels
    for mode in ALLOWED_MODES:
        verdict = "bit-identical" if mode.lossless else "lossy, min cosine"
        assert verdict in rows[mode.label], rows[mode.label]
    assert "100.0%" in rows["NONE"]
