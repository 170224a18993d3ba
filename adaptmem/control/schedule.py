"""When a step is measured block by block, and when only its peak is read.

A step measured block by block reads the probe at every block boundary (and, on
CUDA, waits for the device): it teaches the cost model each block's bytes and
time. A light step reads the step's peak only, which is compared with the
prediction. A step is measured when it has something to teach:

  - the cost model is young (under 3 steps learned) or holds a first offload's
    cold time;
  - an escalation or an out-of-memory error asked (the next step, and the next
    step of every shape bucket seen), or the bucket's last prediction missed the
    observed peak by more than `replan_tolerance` of the budget;
  - the bucket was never measured, or under another plan or for a smaller
    input, and the fits do not cover it (`CostModel.covers`: 3 sizes
    measured at this batch, this one at most one bucket past the largest) and every
    block's mode and the head's was measured: a new length among lengths already
    seen is predicted;
  - the bucket's schedule: every `measure_every`-th of its own steps (twice that
    where its steps alternate with those that find the gradients kept).
"""

from __future__ import annotations

from adaptmem.config.policy import Policy
from adaptmem.control.costs import CostModel
from adaptmem.control.plans import MAX_CACHED_PLANS, Key, PlanRecord
from adaptmem.modes import HeadMode


class MeasureSchedule:
    def __init__(self, policy: Policy, costs: CostModel) -> None:
        self.policy, self.costs = policy, costs
        # per bucket: (plan, its light steps since measured, input planned for), or None: measure its next
        self.buckets: dict[Key, tuple | None] = {}
        self.next = False  # measure the next step, whatever its bucket

    def worth(self, record: PlanRecord) -> bool:
        """Measure the step about to run under `record` block by block (and note it either way)."""
        key = record.key
        last = self.buckets.get(key)
        batch, bucket, kept = key
        period = self.policy.measure_every * (2 if (batch, bucket, not kept) in self.buckets else 1)
        young = self.costs.steps_learned < 3 or self.costs.provisional or self.next
        self.next = False
        if len(self.buckets) >= MAX_CACHED_PLANS:
            self.buckets.clear()
        if not young and last is not None and last[0] == record.modes and last[2] == record.seen \
                and last[1] + 1 < period:
            self.buckets[key] = (last[0], last[1] + 1, last[2])
            return False
        if not young and (last is not None or key not in self.buckets) and self._covered(record):
            self.buckets[key] = (record.modes, 1, record.seen)
            return False
        self.buckets[key] = (record.modes, 0, record.seen)
        return True

    def _covered(self, record: PlanRecord) -> bool:
        """The fits cover the shape (`CostModel.covers`), and every block's mode, and the head's, has
        been measured at some size."""
        costs = self.costs
        if not costs.covers(record.key[0], record.seen):
            return False
        if any(m not in costs.direct[i] for i, m in enumerate(record.modes)):
            return False
        if record.head is None or costs.head_costs is None:
            return True
        fit = costs.head_costs.kept if record.head.mode is HeadMode.KEPT else costs.head_costs.chunked
        return bool(fit.points)

    def missed(self, key: Key | None) -> None:
        """The bucket's prediction missed: its next step is measured."""
        if key is not None:
            self.buckets[key] = None

    def again(self) -> None:
        """An escalation or OOM: the next step is measured, and the next of every bucket seen."""
        self.buckets = dict.fromkeys(self.buckets)
        self.next = True

    def copy(self) -> "MeasureSchedule":
        other = MeasureSchedule(self.policy, self.costs)
        other.buckets, other.next = dict(self.buckets), self.next
        return other
