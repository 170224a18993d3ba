"""Verdicts a noisy machine can back: a ratio's confidence interval, and met, missed or undecided.

A ratio is the median over rounds of two methods' times in the same round
(`stress.benchkit.paired`). Its 95% interval is a percentile bootstrap of that
median over the rounds (seeded, so a run renders the same twice). A target
"ratio <= line" is

  met        when the whole interval is at or under the line,
  missed     when the whole interval is over it,
  undecided  otherwise: the rounds cannot tell, and `more_rounds` says about how
             many more would (the interval narrows as one over the square root of
             the rounds, until its half-width is the distance to the line).

Targets that are no ratio of noisy times (a peak against its budget, a count) are
met or missed as they stand.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

LEVEL = 0.95
DRAWS = 2000

MET, MISSED, UNDECIDED = "met", "missed", "undecided"


def interval(ratios: list[float], level: float = LEVEL, draws: int = DRAWS) -> tuple[float, float]:
    """The `level` percentile-bootstrap interval of the median of `ratios` (one per round)."""
    if len(ratios) < 2:
        value = ratios[0] if ratios else float("nan")
        return value, value
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    tail = (1 - level) / 2
    return medians[int(tail * (draws - 1))], medians[int(math.ceil((1 - tail) * (draws - 1)))]


def more_rounds(ratios: list[float], line: float) -> int | None:
    """About how many more rounds would put the interval on one side of `line`; None when the
    median sits on the line (no number of rounds would)."""
    low, high = interval(ratios)
    distance = abs(statistics.median(ratios) - line)
    if distance == 0 or high == low:
        return None
    needed = math.ceil(len(ratios) * ((high - low) / 2 / distance) ** 2)
    return max(1, needed - len(ratios))


@dataclass(frozen=True)
class Verdict:
    what: str
    state: str  # MET, MISSED or UNDECIDED
    low: float | None = None  # the interval, for a ratio
    high: float | None = None
    more: int | None = None  # rounds that would decide an undecided one
    kept_rounds: bool = True  # False: a range from a run that kept no per-round figures

    @property
    def ok(self) -> bool:
        return self.state == MET

    def line(self) -> str:
        """The verdict as a line of the rendered report."""
        state = {MET: "met", MISSED: "**missed**", UNDECIDED: "undecided"}[self.state]
        detail = []
        if self.low is not None:
            detail.append(f"{LEVEL:.0%} interval {self.low:.3f}..{self.high:.3f}")
        if self.state == UNDECIDED and not self.kept_rounds:
            detail.append("the run kept no per-round figures to count more rounds from")
        elif self.state == UNDECIDED:
            detail.append(
                f"about {self.more} more rounds would decide it" if self.more else "no number of rounds would decide it"
            )
        return f"- {state}: {self.what}" + (f" ({'; '.join(detail)})" if detail else "")


def at_most(what: str, ratios: list[float], line: float) -> Verdict:
    """The target "the median of `ratios` <= `line`", decided by its interval."""
    low, high = interval(ratios)
    if high <= line:
        return Verdict(what, MET, low, high)
    if low > line:
        return Verdict(what, MISSED, low, high)
    return Verdict(what, UNDECIDED, low, high, more_rounds(ratios, line))


def within(what: str, low: float, high: float, line: float) -> Verdict:
    """The target "<= `line`" for a ratio known only by a range (runs that kept no rounds)."""
    state = MET if high <= line else MISSED if low > line else UNDECIDED
    return Verdict(what, state, low, high, kept_rounds=False)


def plain(what: str, ok: bool) -> Verdict:
    """A target that is no ratio of noisy times: met or missed as it stands."""
    return Verdict(what, MET if ok else MISSED)


def every(what: str, verdicts: list[Verdict]) -> Verdict:
    """Several rows' verdicts as one: missed if one is, else undecided if one is, else met. The
    interval shown is the worst row's."""
    if not verdicts:
        return plain(what, True)
    for state in (MISSED, UNDECIDED):
        chosen = [v for v in verdicts if v.state == state]
        if chosen:
            worst = max(chosen, key=lambda v: v.high if v.high is not None else 0.0)
            more = max((v.more for v in chosen if v.more is not None), default=None)
            return Verdict(what, state, worst.low, worst.high, more, all(v.kept_rounds for v in chosen))
    worst = max(verdicts, key=lambda v: v.high if v.high is not None else 0.0)
    return Verdict(what, MET, worst.low, worst.high)
