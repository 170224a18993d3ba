from adaptmem import ALLOWED_MODES
from adaptmem.demo import main


def test_demo_prints_every_mode_with_exactness(capsys):
    assert main(["--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in {m.label for m in ALLOWED_MODES}}
    assert set(rows) == {m.label for m in ALLOWED_MODES}
    for mode in ALLOWED_MODES:
        verdict = "bit-identical" if mode.lossless else "lossy, min cosine"
        assert verdict in rows[mode.label], rows[mode.label]
    assert "100.0%" in rows["NONE"]
