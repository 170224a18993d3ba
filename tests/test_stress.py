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
