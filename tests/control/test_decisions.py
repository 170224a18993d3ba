"""Watermarks and hysteresis: exact decision sequences, and no flip-flopping."""

import pytest

from adaptmem.config.policy import Policy
from adaptmem.control.decisions import ESCALATE, HOLD, RECOVER, RELAX, Decider

POLICY = Policy(
    calm_steps=3,
    headroom=0.9,
    max_headroom=0.97,
    min_headroom=0.5,
    high_watermark=0.98,
    low_watermark=0.8,
    escalate_factor=0.9,
    relax_factor=1.03,
)


def run(decider, ratios, budget=1000.0):
    return [decider.update(r * budget, budget) for r in ratios]


def test_in_band_holds_forever():
    d = Decider(POLICY)
    assert run(d, [0.85, 0.9, 0.95, 0.97] * 5) == [HOLD] * 20
    assert d.headroom == 0.9


def test_escalates_at_once_above_the_high_watermark():
    d = Decider(POLICY)
    assert run(d, [0.9, 0.99, 0.9]) == [HOLD, ESCALATE, HOLD]
    assert d.headroom == pytest.approx(0.9 * 0.9)
    d2 = Decider(POLICY)
    run(d2, [1.5])  # a large overshoot shrinks more than the factor
    assert d2.headroom == pytest.approx(0.9 * 0.98 / 1.5)


def test_relaxes_only_after_calm_steps_and_not_above_max():
    d = Decider(POLICY)
    # 0.9 -> 0.927 -> 0.955 -> 0.97 (0.983 capped at max_headroom), then nothing left to relax
    assert run(d, [0.5] * 12) == [HOLD, HOLD, RELAX] * 3 + [HOLD] * 3
    assert d.headroom == pytest.approx(0.97)


def test_a_step_in_band_resets_the_calm_count():
    d = Decider(POLICY)
    assert run(d, [0.5, 0.5, 0.85, 0.5, 0.5, 0.5]) == [HOLD, HOLD, HOLD, HOLD, HOLD, RELAX]


def test_no_flip_flop_when_a_relaxation_goes_too_far():
    """The load goes over the high watermark whenever headroom passes 0.92: after one
    relax-escalate cycle the controller settles below it and holds."""
    d = Decider(POLICY)
    decisions, headrooms = [], []
    for _ in range(60):
        ratio = 0.99 if d.headroom > 0.92 else 0.7
        decisions.append(d.update(ratio * 1000, 1000))
        headrooms.append(d.headroom)
    assert decisions[:4] == [HOLD, HOLD, RELAX, ESCALATE]
    assert decisions.count(ESCALATE) == 1
    assert d.ceiling == pytest.approx(0.9) and d.calm_needed == 6
    assert all(h <= 0.92 for h in headrooms[4:])
    assert decisions[-20:] == [HOLD] * 20


def test_after_oom_backs_off_and_respects_the_floor():
    d = Decider(POLICY)
    for _ in range(10):
        d.after_oom()
    assert d.headroom == POLICY.min_headroom


def load(ratio_at):
    """The load of the no-flip-flop test: over the high watermark whenever headroom passes 0.92."""
    return lambda d: 0.99 if d.headroom > 0.92 else ratio_at


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_resumed_decider_decides_as_an_uninterrupted_one(cut):
    """Saved at any step (also just after a relaxation, when the next escalation must cap
    the ceiling and double the calm steps), a resumed decider decides exactly as one that
    never stopped."""
    load_of = load(0.7)
    straight = Decider(POLICY)
    expected = [straight.update(load_of(straight) * 1000, 1000) for _ in range(30)]
    first = Decider(POLICY)
    got = [first.update(load_of(first) * 1000, 1000) for _ in range(cut)]
    resumed = Decider(POLICY)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.update(load_of(resumed) * 1000, 1000) for _ in range(30 - cut)]
    assert got == expected
    assert resumed.state_dict() == straight.state_dict()
    assert expected.count(RELAX) >= 1 and expected.count(ESCALATE) == 1  # the scenario has both


def test_headroom_lost_to_an_episode_recovers_half_per_calm_step():
    """From min_headroom (after OOMs), each calm step recovers half of what is missing, the last
    0.005 at once: back where it started within 7 calm steps, then the slow relax."""
    d = Decider(POLICY)
    for _ in range(10):
        d.after_oom()
    assert d.headroom == POLICY.min_headroom
    decisions, headrooms = [], []
    for _ in range(9):
        decisions.append(d.update(0.4 * 1000, 1000))
        headrooms.append(d.headroom)
    assert decisions[:7] == [RECOVER] * 7 and decisions[7:] == [HOLD] * 2
    assert headrooms[:6] == pytest.approx([0.7, 0.8, 0.85, 0.875, 0.8875, 0.89375]) and headrooms[6] == POLICY.headroom
    assert all(a < b for a, b in zip(headrooms, headrooms[1:7]))


def test_a_recovery_that_goes_too_far_is_capped_below_it():
    """The load goes over the high watermark whenever headroom passes 0.8: the recovery stops
    under it for good (no flip-flop), one escalation in all."""
    d = Decider(POLICY)
    d.after_oom()
    d.after_oom()  # 0.9 * 0.8 * 0.8 = 0.576
    decisions = [d.update((0.99 if d.headroom > 0.8 else 0.5) * 1000, 1000) for _ in range(40)]
    assert decisions.count(ESCALATE) == 1
    assert d.headroom <= 0.8 and d.ceiling <= 0.8
    assert decisions[-20:] == [HOLD] * 20


def test_predictions_that_land_where_aimed_earn_plans_up_to_99_percent_of_the_budget():
    """Misses of 0.1% of the budget: a margin of 0.44% (three spreads, never under the latest misses);
    plans fill up to 99% (the cap; not the policy's 97%), escalate only over 99.44%, and a peak landing
    within its margin of the headroom is calm, so the headroom relaxes towards the fill."""
    d = Decider(POLICY)
    assert d.fill == 0.97 and d.lines() == (0.8, 0.98)  # the policy's, before any miss
    budget = 1000.0
    for i in range(5):
        assert not d.note_miss(500.0, 500.0 + (1.0 if i % 2 else -1.0), budget) or i == 4
    assert d.margin == pytest.approx(3 * 1.4826 * 0.001)
    assert d.fill == 0.99
    calm, high = d.lines()
    assert high == pytest.approx(0.99 + d.margin) and calm == pytest.approx(0.9 + d.margin)
    assert run(d, [0.9, 0.9, 0.9]) == [HOLD, HOLD, RELAX]  # at its aim: calm
    assert run(d, [0.99]) == [HOLD]  # over the policy's high watermark, within the margin
    d = Decider(POLICY)
    for _ in range(20):
        d.note_miss(500.0, 500.0, budget)
    assert d.fill == 0.99 and d.lines()[1] == 0.99  # FILL_CAP: the allocator rounds blocks up


def test_scattered_predictions_keep_the_policys_fill_and_watermarks():
    d = Decider(POLICY)
    for miss in [0.02, -0.03, 0.01, 0.02, -0.02, 0.0, 0.0]:
        d.note_miss(500.0, 500.0 + miss * 1000.0, 1000.0)
    assert d.fill == 0.97 and d.lines() == (0.8, 0.98)
    assert run(d, [0.99]) == [ESCALATE]


def test_the_margin_follows_the_latest_misses_and_survives_a_resume():
    d = Decider(POLICY)
    for _ in range(10):
        d.note_miss(500.0, 500.0, 1000.0)
    assert d.fill == 0.99
    assert d.note_miss(500.0, 540.0, 1000.0)  # one miss of 4%: the fill moved, plans are made again
    assert d.fill == 0.97 and d.margin == pytest.approx(0.04)
    again = Decider(POLICY)
    again.load_state_dict(d.state_dict())
    assert list(again.misses) == list(d.misses) and again.fill == d.fill
