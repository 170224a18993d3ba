import pytest

from adaptmem.config.budget import resolve_budget
from adaptmem.config.policy import Policy
from adaptmem.testing import SimulatedDevice, SimulatedProbe

GiB = 2**30


def probe(capacity=8 * GiB, external=0):
    dev = SimulatedDevice(capacity_bytes=capacity)
    dev.occupy(external)
    return SimulatedProbe(dev)


@pytest.mark.parametrize(
    "budget,expected",
    [
        (3 * GiB, 3 * GiB),
        ("2GiB", 2 * GiB),
        ("50%", 4 * GiB),
        ("100%", 8 * GiB),
        (" 25 % ", 2 * GiB),
    ],
)
def test_forms(budget, expected):
    assert resolve_budget(budget, Policy(), probe()) == expected


def test_none_is_the_policys_share_of_what_others_leave():
    assert resolve_budget(None, Policy(budget_fraction=0.5), probe(external=2 * GiB)) == 3 * GiB


def test_larger_than_the_device_is_refused():
    with pytest.raises(ValueError, match=r"budget 9.00 GiB is larger than the device \(8.00 GiB on simulated:sim\)"):
        resolve_budget("9GiB", Policy(), probe())


@pytest.mark.parametrize(
    "bad,message",
    [
        ("150%", r"must be a percentage in \(0%, 100%\]"),
        ("half%", "is not a percentage"),
        ("lots", "is not a size"),
        (0, "must be positive"),
    ],
)
def test_bad_budgets(bad, message):
    with pytest.raises(ValueError, match=message):
        resolve_budget(bad, Policy(), probe())


def test_environment_overrides_and_is_named_in_errors(monkeypatch):
    monkeypatch.setenv("ADAPTMEM_BUDGET", "1GiB")
    assert resolve_budget("4GiB", Policy(), probe()) == GiB
    monkeypatch.setenv("ADAPTMEM_BUDGET", "99GiB")
    with pytest.raises(ValueError, match="ADAPTMEM_BUDGET='99GiB' 99.00 GiB is larger than the device"):
        resolve_budget(None, Policy(), probe())


def test_a_device_without_capacity_needs_bytes():
    unlimited = SimulatedProbe(SimulatedDevice())
    assert resolve_budget("1GiB", Policy(), unlimited) == GiB
    with pytest.raises(ValueError, match="has no capacity"):
        resolve_budget("50%", Policy(), unlimited)
