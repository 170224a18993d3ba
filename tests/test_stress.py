"""The short version of every stress scenario (`make stress` runs the long ones): each returns
the promises it saw broken, so an empty list is the pass."""

import importlib

import pytest

SCENARIOS = ["lengths", "pressure", "ooms", "soak", "probe", "drift"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_short_version_breaks_no_promise(name, capsys):
    scenario = importlib.import_module(f"stress.scenario_{name}")
    violations = scenario.run(short=True)
    assert violations == [], "\n".join(violations)
    assert capsys.readouterr().out.strip()  # it said what it measured


def test_reach_accuracy_calibrates_on_fixed_or_varying_lengths():
    """`--varying N` asks after N lengths drawn from 50 to 600 tokens, the same draws in every run
    (each bisection run trains them again before its two steps at the length tried)."""
    from stress.reach_accuracy import CALIBRATION, calibration, main

    assert calibration() == list(CALIBRATION) * 2
    drawn = calibration(11)
    assert len(drawn) == 11 and all(50 <= n <= 600 for n in drawn) and len(set(drawn)) > 5
    assert calibration(11) == drawn
    with pytest.raises(SystemExit):
        main(["--varying", "-1"])
    with pytest.raises(SystemExit):
        main(["--rounds", "-1"])


def test_reach_accuracy_asks_again_after_two_steps_at_each_answer(monkeypatch):
    """`--rounds N`: after the first answer, two steps at it, then the question again, N times; a
    round whose steps run out of memory ends the rounds. On the Llama of the tests, 128 tokens."""
    from helpers import llama

    import stress.reach_accuracy as ra

    monkeypatch.setattr(ra, "build", lambda arch: llama(layers=2, hidden=64, vocab=ra.VOCAB))
    monkeypatch.setattr(ra, "DEVICE_MIB", 48)
    first, later = ra.run("qwen3", [64, 128, 64, 128], ask=True, rounds=2)
    assert len(later) == 2 and all(a.length > 0 for a in later)
    assert later[0].measured_length >= first.length  # the steps ran at the first answer, measured
