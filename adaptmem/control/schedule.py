"""When a step is measured block by block, and when only its peak is read.

A step measured block by block reads the probe at every block boundary (and, on
CUDA, waits for the device): it teaches the cost model each block's bytes and
time. A light step reads the step's peak only, which is compared with the
prediction. A step is measured when it has something to teach:

  - the cost model is young (under 3 steps learned);
  - an escalation or an out-of-memory error asked (the next step, and the next
    step of every shape bucket seen), or the bucket's last prediction missed the
    observed peak by more than `replan_tolerance` of the budget;
  - its plan runs a mode no block has been measured in, tried on one block or chosen on
    its guess (`PlanRecord.trial`, `PlanRecord.guessed`; with the policy's `try_modes`);
  - its plan offloads a block whose only time reading is its first offload's
    (cold: it allocated its host memory) while no block of its class has a warm
    one, so the warm time replaces it;
  - the fits do not generalise to its shape (`coverage.generalises`: 2 sizes
    measured at its batch, and it at most twice the largest, 4 times with 3
    sizes), and this bucket was never measured, or under another plan or for a
    smaller input. Where they do, a new length is predicted (and, with `try_modes`
    off, a mode no block has run yet, from the priors): a light step's peak checks the
    prediction, a miss measures the bucket's next step, and an out-of-memory
    error retries the step measured;
  - the bucket's schedule: every `measure_every`-th of its own steps (twice that
    where its steps alternate with those that find the gradients resident), also
    where the fits generalise to it (which spares only its first steps). Each
    time a whole period passes with the plan held and every light step's peak where
    predicted, the next period doubles, up to `MAX_STRETCH` times (320 steps at the
    default 10): a measured step costs the host a reading per block boundary and a
    fit per block (on 24 small blocks about 3 ms, and the next step's check of the
    cached plan against what was learned about 1 ms more, against about 0.3 ms for a
    light step; on a GPU it also waits for the device at every boundary), and in
    steady state it teaches little: a light step's peak is still compared with the
    prediction every step. A miss, an escalation or an out-of-memory error starts the
    bucket's period again from `measure_every`.
"""

from __future__ import annotations

from adaptmem.config.policy import Policy
from adaptmem.control.costs import CostModel
from adaptmem.control.coverage import generalises, guessed_in, needs_warm
from adaptmem.control.plans import MAX_CACHED_PLANS, Key, PlanRecord
from adaptmem.modes import Mode

#: The most a bucket's measuring period stretches in steady state, in periods of `measure_every`.
MAX_STRETCH = 32


class MeasureSchedule:
    def __init__(self, policy: Policy, costs: CostModel) -> None:
        self.policy, self.costs = policy, costs
        # per bucket: (plan, its light steps since measured, input planned for, its period's stretch),
        # or None: measure its next
        self.buckets: dict[Key, tuple | None] = {}
        self.next = False  # measure the next step, whatever its bucket

    def worth(self, record: PlanRecord) -> bool:
        """Measure the step about to run under `record` block by block (and note it either way)."""
        key = record.key
        last = self.buckets.get(key)
        batch, bucket, resident = key
        period = self.policy.measure_every * (2 if (batch, bucket, not resident) in self.buckets else 1)
        young = (
            self.costs.steps_learned < 3
            or self.next
            or record.trial is not None
            or (record.guessed and bool(guessed_in(self.costs, record.modes)))
            or needs_warm(self.costs, record.modes)
        )
        self.next = False
        if len(self.buckets) >= MAX_CACHED_PLANS:
            self.buckets.clear()
        stretch, due = 1, False
        if not young and last is not None and last[0] == record.modes and last[2] == record.seen:
            if last[1] + 1 < period * last[3]:
                self.buckets[key] = (last[0], last[1] + 1, last[2], last[3])
                self.costs.ran(record.modes)
                return False
            stretch, due = min(2 * last[3], MAX_STRETCH), True  # a whole period held, on target: the next is longer
        if (
            not young
            and not due
            and (last is not None or key not in self.buckets)
            and generalises(self.costs, batch, record.seen)
        ):
            self.buckets[key] = (record.modes, 1, record.seen, 1)
            self.costs.ran(record.modes)
            return False
        self.buckets[key] = (record.modes, 0, record.seen, stretch)
        return True

    def missed(self, key: Key | None) -> None:
        """The bucket's prediction missed: its next step is measured."""
        if key is not None:
            self.buckets[key] = None

    def again(self) -> None:
        """An escalation or OOM: the next step is measured, and the next of every bucket seen."""
        self.buckets = dict.fromkeys(self.buckets)
        self.next = True

    def copy(self) -> MeasureSchedule:
        other = MeasureSchedule(self.policy, self.costs)
        other.buckets, other.next = dict(self.buckets), self.next
        return other

    def state_dict(self) -> dict:
        """Each bucket's place in its period, for a saved state: a resumed run measures the steps the
        run never interrupted would (a step measured teaches the fits, and so moves predictions)."""
        rows = [
            [list(key), None if last is None else [[m.label for m in last[0]], *last[1:]]]
            for key, last in self.buckets.items()
        ]
        return {"buckets": rows, "next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.buckets = {
            (int(b), int(e), bool(r)): None
            if last is None
            else (tuple(Mode.parse(m) for m in last[0]), int(last[1]), int(last[2]), int(last[3]))
            for (b, e, r), last in state["buckets"]
        }
        self.next = bool(state["next"])
