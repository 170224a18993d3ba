"""The planner is exact: the same objective as brute force; plans never exceed the capacity."""

import itertools
import random

import pytest

from adaptmem.control.planner import Option, plan, predicted_peak, tightest_capacity
from adaptmem.modes import ALLOWED_MODES


def brute_force(options, capacity, final):
    best = None
    for combo in itertools.product(*options):
        if predicted_peak(list(combo), final) <= capacity:
            cost = sum(o.seconds for o in combo)
            best = cost if best is None else min(best, cost)
    return best


def random_instance(rng, n_blocks, n_modes, scale=1):
    options = []
    for _ in range(n_blocks):
        row = []
        for m in range(n_modes):
            saved = rng.randint(0, 40) * scale
            row.append(Option(ALLOWED_MODES[m], saved, saved + rng.randint(0, 60) * scale, rng.randint(0, 30)))
        options.append(row)
    return options


@pytest.mark.parametrize("seed", range(40))
def test_same_objective_as_brute_force(seed):
    rng = random.Random(seed)
    options = random_instance(rng, rng.randint(1, 8), rng.randint(1, 6))
    capacity, final = rng.randint(30, 400), rng.randint(0, 40)
    expected = brute_force(options, capacity, final)
    result = plan(options, capacity, final)
    if expected is None:
        assert not result.feasible and result.shortfall > 0
    else:
        assert result.feasible and result.seconds == expected
        chosen = [next(o for o in row if o.mode is m) for row, m in zip(options, result.modes)]
        assert predicted_peak(chosen, final) <= capacity


@pytest.mark.parametrize("seed", range(10))
def test_large_byte_counts_never_exceed_capacity(seed):
    rng = random.Random(100 + seed)
    options = random_instance(rng, 30, 6, scale=10**7 + 13)
    roomy = 30 * 40 * (10**7) * 0.6
    tight = tightest_capacity(options, 3e7, bins=512) * 1.002  # at the edge, where rounding matters
    for capacity in (roomy, tight):
        result = plan(options, capacity, final=3e7, bins=512)
        assert result.feasible, capacity
        assert result.peak <= capacity


def test_infeasible_gives_the_tightest_plan_and_the_shortfall():
    rng = random.Random(7)
    options = random_instance(rng, 6, 4)
    tight = min(predicted_peak(list(c), 5) for c in itertools.product(*options))
    result = plan(options, capacity=tight * 0.5, final=5)
    assert not result.feasible
    assert result.peak == pytest.approx(tight, rel=0.002)
    assert result.shortfall == pytest.approx(result.peak - tight * 0.5)
    assert tightest_capacity(options, 5) == pytest.approx(tight, rel=0.002)


def test_at_the_tightest_peak_the_plan_that_holds_least_runs():
    """One block's need, which no mode lowers, sets every plan's peak over the capacity: the others
    hold least under it, not the cheapest way (a Zamba2's last block ran in NONE, predicted at
    648 MiB, where every block offloaded was predicted at 270)."""
    from adaptmem import Mode

    cheap, holding = Option(Mode.NONE, 30, 30, 0.0), Option(Mode.CHECKPOINT, 2, 30, 1.0)
    options = [[Option(Mode.NONE, 5, 200, 0.0)], [cheap, holding], [cheap, holding]]
    result = plan(options, capacity=100)
    assert not result.feasible and result.peak == pytest.approx(200, rel=0.01)
    assert result.modes == (Mode.NONE, Mode.CHECKPOINT, Mode.CHECKPOINT)
    # held alike, the cheaper
    result = plan([[Option(Mode.NONE, 5, 200, 0.0)], [cheap, Option(Mode.OFFLOAD, 30, 30, 2.0)]], capacity=100)
    assert result.modes == (Mode.NONE, Mode.NONE)


def test_a_block_restricted_to_one_option_keeps_it():
    options = [[Option(ALLOWED_MODES[0], 10, 20, 0), Option(ALLOWED_MODES[2], 1, 20, 5)] for _ in range(4)]
    options[1] = [options[1][1]]
    result = plan(options, capacity=200)
    assert result.modes[1] is ALLOWED_MODES[2]
    assert result.modes[0] is ALLOWED_MODES[0]


def test_empty_and_bad_input():
    assert plan([], capacity=10).feasible
    with pytest.raises(ValueError, match="at least one option"):
        plan([[]], capacity=10)
