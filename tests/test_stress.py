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
