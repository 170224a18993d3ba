"""When to tighten or loosen: watermarks with hysteresis, as a small pure state machine.

The planner aims the predicted peak at `headroom x budget`. After each step the
observed peak is compared with the budget:

  above the high watermark   escalate at once: headroom shrinks (at least by
                             `escalate_factor`, more if the overshoot was larger)
  under the low watermark    count a calm step; after `calm_steps` of them,
                             relax: headroom grows by `relax_factor`
  in between                 hold, and the calm count starts over

Predictions carry margins, so a held plan's observed peak usually sits under its
prediction: `bias` (observed over predicted, above the step's start, over recent
held steps; never above 1) lets the planner aim the prediction that much higher
(never past `max_headroom` of the budget as predicted), so the budget is used
rather than left to the margins. Any escalation or
out-of-memory error sets it back to 1.

Headroom lost to an escalation or an out-of-memory error is a lesson about
one episode, not about the rest of the run: while it is below where it started
(the policy's `headroom`, or the ceiling if lower), every calm step recovers
half of what is missing (the last 0.005 at once), so from `min_headroom` 0.5
back to 0.94 takes 7 calm steps (`RECOVER`), and the plan returns to what fits
once the pressure is gone. Above the start, relaxing is slow (`calm_steps`
calm steps for each `relax_factor`).

A relaxation or recovery that has to be undone (an escalation within the calm
window that follows it) caps later ones below the headroom that went too far and
doubles the calm steps needed, so the controller cannot flip-flop between two
plans in steady state.

How close to the budget plans go comes from how well they land. Each step
with a prediction notes its miss: the observed peak less where the plan aimed
it (the prediction above the step's start times the bias in force), as a share
of the budget. Once `SPREAD_MIN` are noted, the margin is `SPREAD_Z` times
their spread over the last `SPREAD_WINDOW` (their median size as a standard
deviation), and never under the latest few. Where 1 - margin is above
the policy's `max_headroom`, the predictions have earned more of the budget, and
three figures move from the policy's constants:

  fill        the most of the budget a plan aims at: 1 - margin, at most
              `FILL_CAP` (0.99)
  high line   an observed peak over it escalates: fill + margin, at most the
              budget, at least `high_watermark`
  calm line   an observed peak under it is calm: the headroom + margin, at
              least `low_watermark` (so a plan landing within its spread of
              its aim lets the headroom keep relaxing towards the fill)

Predictions that land within 0.2% of their aim as a rule let plans fill 99% of
the budget, as a fixed plan chosen with hindsight does; those that miss by 0.7%
or more keep the policy's 97% and watermarks.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from adaptmem.config.policy import Policy

HOLD, ESCALATE, RELAX, RECOVER = "hold", "escalate", "relax", "recover"
BIAS_FLOOR = 0.8  # predictions are never taken to be more than 25% too high
RECOVER_SNAP = 0.005  # a recovery this close to its target takes the rest at once
SPREAD_Z = 3.0  # the margin: this many spreads of the misses (median size as a standard deviation)
SPREAD_WINDOW = 20  # misses kept, newest last
SPREAD_MIN = 5  # misses noted before the margin stands in for the policy's constants
RECENT = 3  # the margin is never under the largest of this many latest misses
FILL_CAP = 0.99  # plans never aim past this share of the budget: the allocator rounds blocks up
FILL_MOVE = 0.005  # a fill moved this far (a share of the budget) makes the cached plans again


@dataclass
class Decider:
    policy: Policy
    headroom: float = field(init=False)
    calm: int = field(default=0, init=False)
    calm_needed: int = field(init=False)
    ceiling: float = field(init=False)
    steps_since_relax: int | None = field(default=None, init=False)
    relaxed_from: float | None = field(default=None, init=False)
    bias: float = field(default=1.0, init=False)
    misses: deque = field(default_factory=lambda: deque(maxlen=SPREAD_WINDOW), init=False)
    _margin: float | None = field(default=None, init=False, repr=False)  # `margin`, made when misses change
    agreed_fill: float | None = field(default=None, init=False)  # with other ranks: the smallest fill of all

    def __post_init__(self) -> None:
        self.headroom = self.policy.headroom
        self.calm_needed = self.policy.calm_steps
        self.ceiling = FILL_CAP

    def note_miss(self, predicted: float, observed: float, budget: float) -> bool:
        """A planned step's peak above its start, predicted and observed (bytes): how far it landed
        from where the plan aimed it (the prediction times the bias in force), as a share of the budget.
        True when the fill moved by more than `FILL_MOVE`: plans made before aimed elsewhere."""
        if budget <= 0 or predicted <= 0:
            return False
        before = self.fill
        self.misses.append((observed - predicted * self.bias) / budget)
        self._margin = self._spread_margin()
        return abs(self.fill - before) > FILL_MOVE

    @property
    def margin(self) -> float | None:
        """How far from their aim plans may land, as a share of the budget: `SPREAD_Z` times the misses'
        spread over the window (their median size scaled to a standard deviation, so that one stray
        miss, a first plan made on priors, does not set it for the window's length), and never under
        the `RECENT` latest misses. None before `SPREAD_MIN` misses. Made as a miss is noted: every
        step reads it a few times."""
        return self._margin

    def _spread_margin(self) -> float | None:
        misses = self.misses
        if len(misses) < SPREAD_MIN:
            return None
        spread = 1.4826 * statistics.median([abs(m) for m in misses])
        recent = max(abs(m) for m in list(misses)[-RECENT:])
        return max(SPREAD_Z * spread, recent)

    @property
    def fill(self) -> float:
        """The most of the budget a plan aims at: `max_headroom` until the misses earn more (with
        other ranks, the smallest of every rank's, agreed at the plan point)."""
        own = self.own_fill
        return own if self.agreed_fill is None else min(own, self.agreed_fill)

    @property
    def own_fill(self) -> float:
        """The fill this rank's own misses earn."""
        return self._fill(self.margin)

    def _fill(self, margin: float | None) -> float:
        prior = self.policy.max_headroom
        if margin is None or 1.0 - margin <= prior:
            return prior
        return min(FILL_CAP, 1.0 - margin)

    def lines(self) -> tuple[float, float]:
        """(calm line, high line): shares of the budget an observed peak is calm under and escalates
        over. The policy's watermarks, until the misses earn a fill above `max_headroom`."""
        p, margin = self.policy, self.margin
        fill = self._fill(margin)
        if margin is None or fill <= p.max_headroom:
            return p.low_watermark, p.high_watermark
        high = max(p.high_watermark, min(1.0, fill + margin))
        return min(max(p.low_watermark, self.headroom + margin), high), high

    def update(self, observed: float, budget: float) -> str:
        """One step's verdict from its observed peak (bytes) against the budget (bytes)."""
        p = self.policy
        ratio = observed / budget if budget > 0 else float("inf")
        calm_line, high_line = self.lines()
        if self.steps_since_relax is not None:
            self.steps_since_relax += 1
        if ratio > high_line:
            self.calm = 0
            if self.steps_since_relax is not None and self.steps_since_relax <= self.calm_needed:
                # the last relaxation went too far: never go that high again, and wait longer
                self.ceiling = min(self.ceiling, self.relaxed_from or self.headroom)
                self.calm_needed *= 2
            self.steps_since_relax = None
            self.bias = 1.0  # the predictions were not too high after all
            shrink = min(p.escalate_factor, high_line / ratio)
            new = max(p.min_headroom, self.headroom * shrink)
            if new >= self.headroom:
                return HOLD
            self.headroom = new
            return ESCALATE
        if ratio < calm_line:
            target = min(p.headroom, self.ceiling)
            if self.headroom < target:  # recovering from an episode: half the way back per calm step
                new = self.headroom + 0.5 * (target - self.headroom)
                self.relaxed_from, self.steps_since_relax, self.calm = self.headroom, 0, 0
                self.headroom = target if target - new < RECOVER_SNAP else new
                return RECOVER
            self.calm += 1
            if self.calm >= self.calm_needed:
                new = min(self.fill, self.ceiling, self.headroom * p.relax_factor)
                self.calm = 0
                if new > self.headroom:
                    self.relaxed_from = self.headroom
                    self.headroom = new
                    self.steps_since_relax = 0
                    return RELAX
            return HOLD
        self.calm = 0
        return HOLD

    def learn_bias(self, predicted: float, observed: float) -> bool:
        """A held plan's peak above the step's start, predicted and observed (bytes). True when
        the bias moved enough (3%) that plans made with the old one should be made again."""
        if predicted <= 0 or observed <= 0:
            return False
        ratio = min(1.0, max(BIAS_FLOOR, observed / predicted))
        new = 0.5 * (self.bias + ratio)
        moved = abs(new - self.bias) > 0.03
        self.bias = new
        return moved

    def forget_bias(self) -> None:
        """The predictions were not too high after all: aim with them as they are."""
        self.bias = 1.0

    def escalate(self) -> str:
        """Escalate for a reason other than the peak (the allocator retrying, say)."""
        self.bias = 1.0
        self.calm = 0
        self.steps_since_relax = None
        new = max(self.policy.min_headroom, self.headroom * self.policy.escalate_factor)
        if new >= self.headroom:
            return HOLD
        self.headroom = new
        return ESCALATE

    def after_oom(self) -> None:
        """An out-of-memory error: aim lower at once."""
        self.bias = 1.0
        self.calm = 0
        self.steps_since_relax = None
        self.headroom = max(self.policy.min_headroom, self.headroom * self.policy.oom_backoff)

    def state_dict(self) -> dict:
        """Everything the decider decides with, so a resumed one decides as this one would."""
        return {
            "headroom": self.headroom,
            "calm": self.calm,
            "calm_needed": self.calm_needed,
            "ceiling": self.ceiling,
            "steps_since_relax": self.steps_since_relax,
            "relaxed_from": self.relaxed_from,
            "bias": self.bias,
            "misses": list(self.misses),
        }

    def load_state_dict(self, state: dict) -> None:
        self.headroom = float(state["headroom"])
        self.calm = int(state["calm"])
        self.calm_needed = int(state["calm_needed"])
        self.ceiling = float(state["ceiling"])
        since, relaxed = state.get("steps_since_relax"), state.get("relaxed_from")
        self.steps_since_relax = None if since is None else int(since)
        self.relaxed_from = None if relaxed is None else float(relaxed)
        self.bias = float(state.get("bias", 1.0))
        self.misses = deque((float(m) for m in state.get("misses", ())), maxlen=SPREAD_WINDOW)
        self._margin = self._spread_margin()
