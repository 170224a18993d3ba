"""A batch no plan can fit: given up at once, naming what would fit, and leaving no trace."""

import contextlib

import pytest
import torch
from helpers import TickingProbe, assert_same_state, gpt2, hf_batch, llama, training_state

import adaptmem
from adaptmem import StepOutOfMemoryError
from adaptmem.devices.tiers import host_allocations
from adaptmem.testing import SimulatedDevice

MiB = 2**20
VOCAB = 512
SHORT = [64, 96, 128, 64, 160, 96, 128, 192, 64, 128]
ARCHS = {"llama": lambda: llama(layers=4, hidden=128, vocab=VOCAB), "gpt2": lambda: gpt2(layers=4, hidden=128)}
OUTLIER = {"llama": 4096, "gpt2": 1024}  # GPT-2's longest position; either's attention scores outgrow the device


#: Where the outlier comes, and where the run without it asks how long, as the other does after it.
ASKED_AT = 4


def run(arch: str, outlier_at: int | None, room: int = 24 * MiB):
    """Train SHORT (and the outlier before batch `outlier_at`, caught and skipped as the README shows).
    Returns the plans of the SHORT steps, the manager, what the outlier raised, and the state around it."""
    torch.manual_seed(0)
    model = ARCHS[arch]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    plans, caught, around = [], None, None
    # on a ticking clock: the two runs' steps time alike however loaded the machine, so where two plans'
    # costs come close the two runs choose alike (on the wall clock, one run in four chose another)
    with dev, adaptmem.manage(model, device=TickingProbe(dev), budget=None) as mem:
        for i, seq in enumerate(SHORT):
            if i == 1:  # the optimizer's state exists now: the device is what it holds plus `room`
                dev.set_capacity(dev.allocated_bytes + room)
                mem.set_budget("90%")
            if i == outlier_at:
                with host_allocations():  # the copies are the test's, not the device's
                    before = (training_state(model, opt), torch.get_rng_state(), mem.state_dict(), dev.allocated_bytes)
                try:
                    mem.run_step(lambda: model(**hf_batch(1, OUTLIER[arch], VOCAB)).loss.backward())
                except StepOutOfMemoryError as err:  # skip the batch and go on
                    caught = err
                    caught.asked_after = mem.longest_sequence(1).length
                opt.zero_grad(set_to_none=True)
                with host_allocations():
                    around = (
                        before,
                        (training_state(model, opt), torch.get_rng_state(), mem.state_dict(), dev.allocated_bytes),
                    )
            elif i == ASKED_AT:  # the run without the outlier asks where the other did (an answer that
                mem.longest_sequence(1)  # counted a mode no block has run has the next steps try it)
            mem.run_step(lambda: model(**hf_batch(1, seq, VOCAB)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
            last = mem.last_step
            plans.append((tuple(last["plan"]), last["head"], last["predicted_peak_bytes"]))
        final = mem.state_dict()
    return plans, final, caught, around, mem


def _learned(state: dict) -> dict:
    """What the controller plans from: everything in its state but the counters."""
    return {k: v for k, v in state.items() if k not in ("counters", "run")}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_an_outlier_fails_fast_and_later_plans_are_as_without_it(arch):
    plain, plain_state, _, _, _ = run(arch, None)
    with_outlier, state, err, (before, after), mem = run(arch, ASKED_AT)
    assert err is not None, "the outlier should not fit"
    # fast: one attempt at most (a size never measured runs once under the tightest plan)
    assert len(err.attempts) <= 1
    text = str(err)
    assert f"batch 1 x {OUTLIER[arch]:,} tokens" in text and "floor" in text and "budget" in text
    # the length named is the one longest_sequence answers right after: the batch left no trace
    assert f"longest sequence predicted to fit at batch 1: {err.asked_after:,} tokens" in text
    assert isinstance(err, torch.OutOfMemoryError)
    # no trace: weights, gradients, optimizer, RNG and the controller's learned state as before the batch
    assert_same_state(after[0], before[0])
    assert torch.equal(after[1], before[1])
    assert _learned(after[2]) == _learned(before[2])
    assert after[3] == before[3]  # and nothing of it left on the device
    # and every later batch is planned as in the run without the outlier
    assert with_outlier == plain
    # (the cost models differ in their timings, wall-clock figures of two runs; not in what decides)
    assert state["decider"] == plain_state["decider"] and state["lengths"] == plain_state["lengths"]
    assert mem.headroom >= mem.policy.headroom  # never lowered by the outlier
    assert mem.events.of_type("refused")[-1]["attempts"] == len(err.attempts)


def test_a_measured_shape_predicted_far_over_the_device_is_refused_before_any_block_runs(caplog):
    torch.manual_seed(0)
    model = llama(layers=4, hidden=128, vocab=VOCAB)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    ran = []
    model.model.layers[0].register_forward_hook(lambda *a: ran.append(1))  # the first block finished
    with dev, adaptmem.manage(model, device=dev, budget=None) as mem:
        for _ in range(3):
            mem.run_step(lambda: model(**hf_batch(2, 512, VOCAB)).loss.backward())
            model.zero_grad(set_to_none=True)
        dev.set_capacity(dev.allocated_bytes + MiB)  # the card is now far too small for this shape
        mem.set_budget("90%")
        headroom = mem.headroom
        ran.clear()
        with pytest.raises(StepOutOfMemoryError) as err, caplog.at_level("WARNING", logger="adaptmem"):
            mem.run_step(lambda: model(**hf_batch(2, 512, VOCAB)).loss.backward())
        assert err.value.attempts == [] and ran == []  # no attempt: refused at the plan point
        # and no warning announces a plan as running that never ran
        assert not [r for r in caplog.records if "Running" in r.getMessage()], caplog.text
        assert mem.ooms == 0 and mem.headroom == headroom
        assert "the tightest plan is predicted over the device's usable memory" in str(err.value)
        assert mem.events.of_type("refused")[-1]["attempts"] == 0
        # step() refuses alike, and the next batch that fits runs
        with pytest.raises(StepOutOfMemoryError), mem.step():
            model(**hf_batch(2, 512, VOCAB)).loss.backward()
        assert not mem.in_step and mem.ooms == 0
        dev.set_capacity(dev.allocated_bytes + 64 * MiB)  # a card that holds it: the same batch trains
        mem.set_budget("90%")
        mem.run_step(lambda: model(**hf_batch(2, 512, VOCAB)).loss.backward())
        assert mem.last_step["batch"] == 2 and mem.ooms == 0


def test_after_an_oom_episode_the_plan_is_all_none_again_within_seven_steps():
    """An OOM (here injected, once) backs the headroom off to 0.94 x 0.8 of the budget, under what
    all-NONE needs; the calm steps after it recover the headroom, and the plan is all-NONE again
    within the 7 steps the recovery rule states."""
    from helpers import tiny, tiny_batch

    from adaptmem import Mode
    from adaptmem.testing import measure_peak

    model = tiny(n_layers=4)
    batch = tiny_batch(model, batch=4, seq=64)
    none_peak = measure_peak(tiny(n_layers=4), lambda: batch)
    budget = int(none_peak / 0.86)  # all-NONE fits at 0.94 of the budget, not at 0.94 x 0.8
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    fail = []

    def once(module, args):
        if fail:
            fail.pop()
            raise torch.OutOfMemoryError("injected")

    model.blocks[2].register_forward_pre_hook(once)
    with dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for _ in range(4):
            mem.run_step(lambda: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
        assert set(mem.plan.values()) == {Mode.NONE}
        fail.append(1)
        plans = []
        for _ in range(8):
            mem.run_step(lambda: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
            plans.append(set(mem.last_step["plan"]))
        assert mem.ooms == 1 and mem.summary()["ooms_recovered"] == 1
        assert plans[0] != {"NONE"}  # the retry and the steps right after aim lower
        back = plans.index({"NONE"})
        assert back <= 7 and all(p == {"NONE"} for p in plans[back:]), plans
        assert mem.headroom == pytest.approx(mem.policy.headroom)


def test_a_refusal_never_names_a_longest_length_at_or_above_the_one_it_refused():
    """The cost model can be wrong at a length a batch has just run out of memory at (its retries
    exhausted): the longest length it predicts to fit, 389 tokens where 295 were refused, is then
    no answer, and the message leaves it out."""
    from types import SimpleNamespace

    from adaptmem import Mode
    from adaptmem.control.unfit import refusal

    record = SimpleNamespace(exhausted=True, modes=(Mode.CHECKPOINT,) * 3 + (Mode.NONE,), head=None)

    def text(longest):
        return refusal(
            record, 2, 295 * 128, 295, 10 * 2**20, [], predicted=2**24, budget=2**24, limit=2**25,
            longest=lambda batch: SimpleNamespace(length=longest),
        )  # fmt: skip

    assert "The longest sequence predicted to fit at batch 2: 240 tokens." in text(240)
    assert "longest sequence" not in text(389) and "Split or truncate this batch" in text(389)
    # the tightest plan by the figures may be one that failed in the step: the message says so
    failed = refusal(
        record, 2, 295 * 128, 295, 10 * 2**20, [], predicted=2**23, budget=2**24, limit=2**25,
        longest=lambda batch: SimpleNamespace(length=240), failed_here=True,
    )  # fmt: skip
    assert "predicted peak now 8.00 MiB; it ran out of memory in this step all the same" in failed
    assert "all the same" not in text(240)


@contextlib.contextmanager
def calibrated_plans(forget_ran: bool = True):
    """(manager, plan book, bucket, shape) of a tiny model after three steps at 2 x 64 tokens (every
    block checkpointed, the calibration, then in NONE); with `forget_ran`, nothing kept of the plans
    that ran the shape (which a retry would take first)."""
    from helpers import tiny, tiny_batch

    model = tiny(n_layers=4)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev, budget="1GiB") as mem:
        for _ in range(3):
            mem.run_step(lambda: model(**tiny_batch(model, batch=2, seq=64)).loss.backward())
            model.zero_grad(set_to_none=True)
        plans = mem._controller.plans
        if forget_ran:
            plans.ran_at.clear()
        yield mem, plans, plans.bucket(2, 64 * 64), (2, 64 * 64)


def test_with_no_plan_predicted_lower_a_retry_runs_one_tighter_in_every_block_before_giving_up(monkeypatch):
    """At a size not run yet the predictions carry margins and may rank plans wrongly. After an
    out-of-memory error with nothing predicted lower, a retry still runs a plan no looser in any block
    than every plan that failed and tighter in some; the batch is given up only when there is none."""
    from adaptmem import Mode
    from adaptmem.modes import LADDER

    with calibrated_plans(forget_ran=False) as (mem, plans, key, shape):
        monkeypatch.setattr(plans, "predict", lambda *args, **kwargs: 900.0 * MiB)  # every plan alike
        rank = {m: i for i, m in enumerate(mode for mode in LADDER if mode in plans.allowed)}
        tried = [(Mode.NONE, Mode.CHECKPOINT, Mode.NONE, Mode.OFFLOAD)]
        for attempt in range(1, 20):
            plans.start_attempt(attempt)
            plans.failure(tried[-1], None, shape, foreseen=True)
            record = plans.make(key, 0, mem.budget, fixed={}, reason="retry")
            assert record.predicted == plans.predict(record.modes, *shape, 0, record.head)  # the retry's own
            if record.exhausted:
                break
            for failed in tried:  # no looser anywhere than any plan that failed, tighter somewhere
                assert all(rank[m] >= rank[f] for m, f in zip(record.modes, failed)) and record.modes != failed
            tried.append(record.modes)
        top = max(rank, key=rank.get)
        assert record.exhausted and tried[-1] == (top,) * 4, tried  # given up once every block is at the top
        assert len(tried) > 2


def test_a_plan_whose_blocks_never_ran_it_here_is_refused_only_far_beyond_the_device():
    """Refusing without running trusts a plan's prediction at a measured shape to within a quarter of
    its bytes above the start where each block ran its mode there, and to within a half where some
    block's figures are borrowed (from a block alike, or carried from other sizes)."""
    from adaptmem.control.plans import PlanRecord
    from adaptmem.control.unfit import unfittable
    from adaptmem.modes import Mode

    torch.manual_seed(0)
    model = llama(layers=4, hidden=128, vocab=VOCAB)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    policy = adaptmem.load_policy().model_copy(update={"modes": ("CHECKPOINT",)})
    batch = hf_batch(2, 128, VOCAB)
    with dev, adaptmem.manage(model, device=dev, budget=None, policy=policy, head=None) as mem:
        for _ in range(3):
            mem.run_step(lambda: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
        costs, b, e = mem._controller.costs, mem.last_step["batch"], mem.last_step["sample_elements"]
        ck, off = Mode.CHECKPOINT, Mode.OFFLOAD
        assert costs.measured(b, e) and costs.ran_here((ck,) * 4, b, e)
        assert not costs.ran_here((ck, ck, ck, off), b, e)  # OFFLOAD never ran on the last block
        assert not costs.ran_here((ck,) * 4, b, 2 * e)  # nor CHECKPOINT at another size
    start, limit = 100 * MiB, 130 * MiB
    plan = dict(modes=(ck,) * 4, key=(2, 128, False), extent=128, start=start, reason="replan", feasible=False)
    record = PlanRecord(predicted=start + 50 * MiB, **plan)  # 50 MiB above the start, where 30 are left
    assert unfittable(record, start, limit, measured=True, ran=True)
    assert not unfittable(record, start, limit, measured=True, ran=False)  # runs once instead
    assert not unfittable(record, start, limit, measured=False, ran=True)
    far = PlanRecord(predicted=start + 80 * MiB, **plan)
    assert unfittable(far, start, limit, measured=True, ran=False)  # 80 MiB, halved, is still over
    # a plan priced by a guess (a mode no block of its kind has run: OFFLOAD on a mixture of experts,
    # guessed at 93 MiB where it trained at 34) runs once, measured, however far over it reads
    assert not unfittable(far, start, limit, measured=True, ran=False, guessed=True)


def test_a_plan_that_ran_a_shape_is_run_where_the_figures_fit_none_and_retried_first(monkeypatch):
    """Predictions past the sizes measured may rank plans wrongly (a Gemma 2 whose 2 x 2,048 batch had
    trained under 4 x OFFLOAD was planned 4 x CHECKPOINT+OFFLOAD, predicted tighter, and given up
    after three retries that climbed the ladder away from OFFLOAD). The plan of the lowest peak that
    ran a shape to its end is kept: where no plan is predicted to fit that shape, or one as large in
    both batch and length, it runs in place of the tightest predicted, and it is a retry's first
    plan; once it fails there it is no longer taken for one that fits."""
    from helpers import tiny, tiny_batch

    from adaptmem import Mode

    model = tiny(n_layers=4)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    none, off, ck = Mode.NONE, Mode.OFFLOAD, Mode.CHECKPOINT
    with dev, adaptmem.manage(model, device=dev, budget="1GiB") as mem:
        for _ in range(3):  # calibrated with every block checkpointed, then every block in NONE
            mem.run_step(lambda: model(**tiny_batch(model, batch=2, seq=64)).loss.backward())
            model.zero_grad(set_to_none=True)
        last, ctl = mem.last_step, mem._controller
        plans, shape = ctl.plans, (2, 64 * 64)
        assert tuple(Mode.parse(m) for m in last["plan"]) == (none,) * 4
        ran = plans.ran_at[(*shape, False)]  # the plan of the lowest peak that ran, and that peak above its start
        assert ran[0] == (ck,) * 4 and 0 < ran[2] < last["observed_peak_bytes"] - ctl.now.start
        worked = (off, none, off, none)
        plans.ran(shape, False, worked, None, 1024)  # lower than what ran before (and any prediction): kept
        plans.ran(shape, False, (none, ck, ck, ck), None, 2048)  # higher: not
        kept = dict(plans.ran_at)
        mem.load_state_dict(mem.state_dict())  # a resumed run keeps them
        assert dict(plans.ran_at) == kept and kept[(*shape, False)] == (worked, None, 1024)
        monkeypatch.setattr(plans, "_aim", lambda start, budget: 1.0)  # no plan is predicted to fit
        key, start = plans.bucket(*shape), 100 * MiB
        first = plans.make(key, start, mem.budget, fixed={}, reason="replan", extent=shape[1])
        assert first.modes == worked and first.predicted == start + 1024 and "ran here before" in first.reason
        smaller = plans.make(plans.bucket(2, 32 * 64), start, mem.budget, fixed={}, reason="replan", extent=32 * 64)
        assert smaller.modes == worked  # a plan that ran a larger shape peaks no higher on a smaller one
        larger = plans.make(plans.bucket(2, 128 * 64), start, mem.budget, fixed={}, reason="replan", extent=128 * 64)
        assert larger.modes != worked or "ran here before" not in larger.reason
        # a hair longer (under 1%: a Gemma 3 trained 2 x 1,321 tokens under 4 x OFFLOAD and at 1,322 ran, and
        # retried, recomputing plans its figures priced low), with its peak grown as the square of the length
        hair = shape[1] + 1
        near = plans.make(plans.bucket(2, hair), start, mem.budget, fixed={}, reason="replan", extent=hair)
        assert near.modes == worked and near.predicted == pytest.approx(start + 1024 * (hair / shape[1]) ** 2)
        plans.start_attempt(1)
        plans.failure((ck,) * 4, None, shape, foreseen=True)
        retry = plans.make(key, start, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert retry.modes == worked and retry.predicted == start + 1024  # tried first, as high as it ran
        plans.start_attempt(2)
        plans.ran((2, 128 * 64), False, worked, None, 4096)  # it ran a larger shape too
        plans.failure(worked, None, shape, foreseen=True)
        assert (*shape, False) not in plans.ran_at  # failed here: no longer evidence, here or larger
        assert (2, 128 * 64, False) not in plans.ran_at
        again = plans.make(key, start, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert again.modes != worked
        plans.succeeded()


def test_a_retry_tries_every_block_in_a_mode_never_run_before_the_ones_the_figures_rank(monkeypatch):
    """A lossless mode no block has run is priced by a guess made to err high, so the figures rank its
    plans last. On a mixture of experts OFFLOAD, never run, fitted a batch at 78% of the budget that
    its retries, climbing to CHECKPOINT+OFFLOAD (which recomputes a block whole in backward and
    peaked as CHECKPOINT did), gave up. After an out-of-memory error a retry first runs every block in
    such a mode, where it is no looser than any block of the plan that failed; once it has run, or
    where it would be looser, the figures rank the retries again."""
    from adaptmem import Mode
    from adaptmem.control.coverage import guessed

    ck, off, sel, co = Mode.CHECKPOINT, Mode.OFFLOAD, Mode.SELECTIVE, Mode.CHECKPOINT | Mode.OFFLOAD
    with calibrated_plans() as (mem, plans, key, shape):
        assert guessed(plans.costs, off) and guessed(plans.costs, sel) and not guessed(plans.costs, ck)
        guess = {off: 900.0 * MiB, sel: 950.0 * MiB}  # the guesses, ranked over every plan measured
        monkeypatch.setattr(plans, "predict", lambda modes, *a, **k: max(guess.get(m, 500.0 * MiB) for m in modes))
        plans.start_attempt(1)
        plans.failure((ck, ck, ck, Mode.NONE), None, shape, foreseen=True)
        first = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert first.modes == (off,) * 4  # not SELECTIVE, guessed too but looser than CHECKPOINT
        plans.start_attempt(2)
        plans.failure(first.modes, None, shape, foreseen=True)
        second = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert second.modes != (off,) * 4  # it failed: the figures rank the next
        plans.succeeded()
        plans.start_attempt(1)
        plans.failure((co,) * 4, None, shape, foreseen=True)  # OFFLOAD is looser than every block of it
        third = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert third.modes != (off,) * 4
        plans.succeeded()


def test_a_retry_offloads_every_block_where_the_failed_plan_kept_a_block_whole(monkeypatch):
    """A first plan of CHECKPOINT+OFFLOAD blocks (tighter on the ladder than OFFLOAD) and one block in
    NONE ran out of memory on a mixture of experts; its guess put OFFLOAD above it, the retries climbed
    to CHECKPOINT+OFFLOAD everywhere (which peaked as CHECKPOINT did) and the batch was given up, where
    4 x OFFLOAD fitted it at 78% of the budget. OFFLOAD keeps none of a block's saved tensors on the
    device: where the failed plan kept a block looser than it, a retry runs every block in it while its
    figures are a guess. SELECTIVE, a guess too but keeping some, is not tried so."""
    from adaptmem import Mode

    none, off, sel, co = Mode.NONE, Mode.OFFLOAD, Mode.SELECTIVE, Mode.CHECKPOINT | Mode.OFFLOAD
    with calibrated_plans() as (mem, plans, key, shape):
        guess = {off: 900.0 * MiB, sel: 950.0 * MiB, none: 800.0 * MiB}  # every plan measured: 500 MiB
        monkeypatch.setattr(plans, "predict", lambda modes, *a, **k: max(guess.get(m, 500.0 * MiB) for m in modes))
        plans.start_attempt(1)
        plans.failure((co, co, co, none), None, shape, foreseen=True)
        first = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert first.modes == (off,) * 4
        plans.start_attempt(2)
        plans.failure(first.modes, None, shape, foreseen=True)
        # another plan with a block in NONE fails: SELECTIVE, still a guess, keeps some, and is not run so
        plans.failure((co, co, co, none), None, shape, foreseen=True)
        second = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert second.modes not in ((off,) * 4, (sel,) * 4)
        plans.succeeded()


def test_a_retry_never_runs_a_uniform_plan_looser_than_every_block_of_one_that_failed(monkeypatch):
    """At a size never run every figure is extrapolated: an Arcee's 4 x OFFLOAD was predicted at 224 MiB
    and ran out; the plans tighter in every block (4 x CHECKPOINT+OFFLOAD) were predicted at 1.08 GiB and
    4 x SELECTIVE at 948 MiB, which ran, as the uniform plan predicted lowest, and ran out too. A plan
    looser than every block of one that failed holds more in each: the retry is the tighter one."""
    from adaptmem import Mode

    off, sel, co = Mode.OFFLOAD, Mode.SELECTIVE, Mode.CHECKPOINT | Mode.OFFLOAD
    with calibrated_plans() as (mem, plans, key, shape):
        assert co in plans.allowed and sel in plans.allowed
        figures = {off: 224.0 * MiB, sel: 948.0 * MiB}  # every other mode: 1.08 GiB
        monkeypatch.setattr(plans, "predict", lambda modes, *a, **k: max(figures.get(m, 1106.0 * MiB) for m in modes))
        plans.start_attempt(1)
        plans.failure((off,) * 4, None, shape, foreseen=True)
        retry = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert retry.modes == (co,) * 4 and not retry.exhausted, retry.modes
        plans.succeeded()


def test_a_retry_never_runs_a_plan_that_only_puts_blocks_of_a_failed_one_in_none(monkeypatch):
    """A block in NONE keeps all it saves: a plan that differs from one that ran out of memory in this
    step only by blocks in NONE holds at least what it held, and would fail too. A T5 whose figures
    were for its source length (its decoder's target four times longer) retried 4 x NONE, which had run
    a longer source, after 3 x NONE and 1 x OFFLOAD failed, and the batch was given up; it is
    neither a retry's plan that ran the shape (a larger one) nor one the figures rank lowest."""
    from adaptmem import Mode

    none, off = Mode.NONE, Mode.OFFLOAD
    with calibrated_plans() as (mem, plans, key, shape):
        all_none = (none,) * 4
        plans.ran((2, 2 * 64 * 64), plans.costs.grads_resident, all_none, None, 10 * MiB)  # a larger shape
        plans.start_attempt(1)
        plans.failure((none, none, none, off), None, shape, foreseen=True)
        first = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert first.modes != all_none
        plans.succeeded()
        plans.ran_at.clear()
        # the figures (for another length) rank every block in NONE lowest; the modes never run are
        # left out here (a retry would run them first)
        monkeypatch.setattr(plans, "_guessed_uniform", lambda head: None)
        monkeypatch.setattr(
            plans, "predict", lambda modes, *a, **k: 100.0 * MiB if set(modes) == {none} else 500.0 * MiB
        )
        plans.start_attempt(1)
        plans.failure((none, none, none, off), None, shape, foreseen=False)
        second = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert second.modes != all_none
        plans.succeeded()


def test_a_plan_predicted_to_fit_that_failed_runs_again_rather_than_a_looser_one(monkeypatch):
    """Plans predicted to fit that ran out of memory (the figures wrong, not the batch: another process
    took memory for a while, say): with no plan predicted lower and none tighter in every block, the
    plan that failed runs again, never one looser than a plan that failed. On a Phi-3 whose loss was
    made outside its head, 4 x SELECTIVE ran after 4 x OFFLOAD and 4 x CHECKPOINT+OFFLOAD failed."""
    from adaptmem import Mode

    top = (Mode.CHECKPOINT | Mode.OFFLOAD,) * 4
    with calibrated_plans() as (mem, plans, key, shape):
        monkeypatch.setattr(plans, "_guessed_uniform", lambda head: None)
        monkeypatch.setattr(plans, "predict", lambda modes, *a, **k: (90.0 if modes == top else 95.0) * MiB)
        plans.start_attempt(1)
        for failed in ((Mode.CHECKPOINT,) * 4, (Mode.OFFLOAD,) * 4, top):
            plans.failure(failed, None, shape, foreseen=False)
        retry = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert retry.modes == top
        plans.succeeded()


def test_a_refusal_after_an_attempt_names_the_plan_a_retry_would_run_not_the_tightest():
    """After an attempt ran out of memory, the plan refused is the retry's (the ladder it retreats
    along), which may be predicted higher than the attempt's: it was called the tightest plan."""
    from types import SimpleNamespace

    from adaptmem.control.unfit import refusal
    from adaptmem.modes import Mode

    record = SimpleNamespace(exhausted=False, modes=(Mode.CHECKPOINT,) * 4, head=None)
    failed = {"plan_counts": {"OFFLOAD": 4}, "predicted_peak_bytes": 154 * 2**20, "phase": "backward"}
    common = dict(predicted=253 * 2**20, budget=121 * 2**20, limit=132 * 2**20, longest=lambda b: None)
    first = refusal(record, 2, 2415 * 256, 2415, 80 * 2**20, [], **common)
    after = refusal(record, 2, 2415 * 256, 2415, 80 * 2**20, [failed], **common)
    assert "  tightest plan: 4 x CHECKPOINT; predicted peak now 253.00 MiB" in first
    assert "  plan a retry would run: 4 x CHECKPOINT; predicted peak now 253.00 MiB" in after
    assert "tightest" not in after and "attempt 1: 4 x OFFLOAD; predicted peak 154.00 MiB" in after


class _Switching(torch.nn.Module):
    """A block whose own code takes 8 times the memory past `threshold` tokens: no prediction
    from shorter lengths sees it."""

    def __init__(self, width: int, threshold: int) -> None:
        super().__init__()
        self.lin, self.threshold = torch.nn.Linear(width, width), threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[1] > self.threshold:
            b, n, w = h.shape
            h = h + torch.tanh(h.repeat(1, 1, 8)).view(b, n, 8, w).mean(2)
        return x + torch.tanh(h)


class SwitchingNet(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, threshold: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, width)
        self.blocks = torch.nn.ModuleList(_Switching(width, threshold) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@contextlib.contextmanager
def switching_run():
    """A `SwitchingNet` on a 24 MiB stand-in, every block checkpointed (the plan is fixed), after
    two rounds of 64, 128 and 256 tokens at batch 2. Yields (model, device, manager, step), where
    step(length) trains a batch of 2 or returns the error that gave it up."""
    model = SwitchingNet()
    dev = SimulatedDevice(24 * MiB)
    dev.track(model)
    policy = adaptmem.Policy(modes=("CHECKPOINT",))
    with dev, adaptmem.manage(model, policy=policy, device=dev) as mem:

        def step(length: int) -> StepOutOfMemoryError | None:
            ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(length))
            try:
                mem.run_step(lambda: model(ids).backward())
            except StepOutOfMemoryError as err:
                return err
            finally:
                model.zero_grad(set_to_none=True)
            return None

        for length in (64, 128, 256) * 2:
            assert step(length) is None
        yield model, dev, mem, step


def test_a_length_given_up_is_not_named_again_until_a_step_that_long_trains():
    """A model whose memory jumps past the lengths measured is refused at the length
    `longest_sequence` named. Asked again, it names less than `GIVEN_UP_BACKOFF` of that length
    (it named the same length again and again), the refusal names what it answers after, and
    `largest_batch` at that length is below the batch given up. The learned state is as before
    the batch. With more room than the refusal had, the bound no longer holds, and a step at that
    length, once it trains, lifts it."""
    from adaptmem.control.reach import GIVEN_UP_BACKOFF

    with switching_run() as (model, dev, mem, step):
        named = mem.longest_sequence(2).length
        before = _learned(mem.state_dict())
        err = step(named)
        assert err is not None, f"{named} tokens were expected to run out of memory past the switch"
        after = mem.longest_sequence(2).length
        assert after < GIVEN_UP_BACKOFF * named
        assert mem.longest_sequence(2).measured_length < named  # an attempt that ran out measured no length
        assert f"The longest sequence predicted to fit at batch 2: {after:,} tokens." in str(err)
        assert mem.largest_batch(named).batch < 2
        assert _learned(mem.state_dict()) == before
        lesson = mem._controller.lesson  # what the failed attempt taught, kept apart from the plans' figures
        assert (lesson.batch, lesson.seq) == (2, named) and lesson.longest < named
        assert mem.longest_sequence(2, limit="23MiB").length < named  # no more room than it had: bound
        dev.set_capacity(1 << 30)  # a card that holds it
        assert mem.longest_sequence(2).length >= named  # more room than the refusal had: not bound
        assert mem.longest_sequence(2, limit="23MiB").length < named
        assert step(named) is None  # it trains here: the bound is lifted
        assert mem._controller.given_up == [] and mem._controller.lesson is None


def test_a_batch_given_up_is_freed_without_a_garbage_collection():
    """The error a refused batch raises, re-raised from the retry loop, was held by that loop's frame
    on its own traceback: a cycle that kept the error, and through its traceback the frame that
    caught it (a function that skips the batch, with the batch in its locals), allocated until
    Python's cyclic collector ran."""
    import gc
    import weakref

    with switching_run() as (model, dev, mem, step):
        length = mem.longest_sequence(2).length

        def skipped():  # train a batch, or skip it as the README shows
            ids = torch.randint(0, 100, (2, length))
            try:
                mem.run_step(lambda: model(ids).backward())
            except StepOutOfMemoryError:
                return weakref.ref(ids)
            raise AssertionError(f"{length} tokens were expected to be given up")

        gc.disable()
        try:
            held = skipped()
            assert held() is None, "the batch given up is still alive without a collection"
        finally:
            gc.enable()


@pytest.mark.slow
def test_a_batch_given_up_past_a_length_that_trained_leaves_that_length_an_answer():
    """A Gemma 3 (sliding and full attention) asked how long fits at batch 2, trained at the answer
    at the limit, then given a batch a tenth longer, which is refused: the answer after it stays the
    length that trained (it read 5,239 after 2 x 5,293 had trained at 195.93 of 196 MiB)."""
    import random

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    order = random.Random(0)
    config = Gemma3TextConfig(
        vocab_size=8000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=32768,
        use_cache=False,
    )
    model = Gemma3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(200 * MiB)
    dev.track(model)

    def step(mem, length: int) -> bool:
        ids = torch.randint(0, 8000, (2, length))

        def forward_backward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

        try:
            mem.run_step(forward_backward)
        except StepOutOfMemoryError:
            return False
        finally:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return True

    with dev, adaptmem.manage(model, device=dev) as mem:
        for _ in range(15):
            step(mem, order.randint(64, 768))
        assert step(mem, int(mem.longest_sequence(batch=2).length * 0.9))
        answer = mem.longest_sequence(batch=2).length
        assert step(mem, answer)
        assert mem.longest_sequence(batch=2).length >= answer
        assert not step(mem, int(answer * 1.1))
        assert mem.longest_sequence(batch=2).length >= answer


def test_a_batch_that_ran_out_of_memory_measures_no_length_an_answer_names():
    """A batch far past the lengths measured runs (its size not run yet), runs out of memory in
    forward and is given up: the answers after it name the longest length measured by steps that
    ran, and say they are extrapolated past it (a Falcon-H1's answer after a refused 2 x 16,384
    called 4,222 tokens measured, at 832 measured)."""
    model = llama(layers=2, hidden=64, dropout=0.0)
    dev = SimulatedDevice(48 * MiB)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev) as mem:
        for seq in (64, 96, 128, 96):
            mem.run_step(lambda: model(**hf_batch(2, seq)).loss.backward())
            model.zero_grad(set_to_none=True)
        with pytest.raises(StepOutOfMemoryError):
            mem.run_step(lambda: model(**hf_batch(2, 8192)).loss.backward())
        model.zero_grad(set_to_none=True)
        for limit in (None, mem.budget):
            answer = mem.longest_sequence(2, limit=limit)
            assert answer.measured_length == 128, answer
            assert answer.extrapolated == (answer.length > 128), answer


def test_a_length_given_up_is_given_up_before_it_runs_until_the_step_has_more_room():
    """A length that trained, given up once the loop's own tensors hold more of the device, is given
    up before it runs at each batch of it, or longer, while the step has no more room above its floor
    (a MiniMax's 1 x 1,536, given up once the user's copies of the weights held 5.8 MiB, ran its four
    attempts out of memory again at each batch of that length after it); a shorter one trains, and
    with the copies let go of, the length trains again."""
    torch.manual_seed(0)
    model = llama(layers=4, hidden=128, vocab=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    failing, calls = [False], []

    def out_of_memory(module, args):  # the step no longer fits: every attempt runs out in forward
        calls.append(1)
        if failing[0]:
            raise torch.OutOfMemoryError("out of memory in block 2")

    model.model.layers[2].register_forward_pre_hook(out_of_memory)

    def step(seq: int) -> StepOutOfMemoryError | None:
        try:
            mem.run_step(lambda: model(**hf_batch(1, seq, VOCAB)).loss.backward())
        except StepOutOfMemoryError as err:
            return err
        finally:
            opt.zero_grad(set_to_none=True)
        opt.step()
        return None

    with dev, adaptmem.manage(model, device=dev, budget="50%") as mem:
        assert all(step(seq) is None for seq in (64, 128, 256))
        held = torch.ones(2 * MiB // 4)  # the loop's own tensors, on the device
        failing[0] = True
        first = step(256)
        assert first is not None and first.attempts  # it ran, and ran out of memory
        for seq in (256, 320):
            ran = len(calls)
            again = step(seq)
            assert again is not None and again.attempts == [] and len(calls) == ran  # no block ran
            assert "a batch of 1 x 256 tokens was given up earlier in this run" in str(again)
        failing[0] = False
        assert step(128) is None
        del held
        assert step(256) is None and mem.last_step["seq"] == 256


def test_a_shorter_input_in_a_bucket_whose_longest_no_plan_fits_is_planned_for_its_own_size(caplog):
    """A bucket's plan is made for the longest input it has seen; where no plan fits that, an input
    under it is planned for its own size (a MiniMax answered 1,382 tokens under its budget, and the
    step at 1,382, planned for its bucket's 1,536, ran the tightest plan with a warning to shorten it)."""
    torch.manual_seed(0)
    model = llama(layers=4, hidden=128, vocab=VOCAB)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, device=TickingProbe(dev), budget=2**30) as mem:

        def step(seq: int) -> dict:
            caplog.clear()
            with caplog.at_level("WARNING", logger="adaptmem"):
                mem.run_step(lambda: model(**hf_batch(1, seq, VOCAB)).loss.backward())
            model.zero_grad(set_to_none=True)
            unfit = [r for r in caplog.records if "no plan is predicted to fit" in r.getMessage()]
            return {**mem.last_step, "reason": mem.events.of_type("plan")[-1]["reason"], "unfit": unfit}

        for seq in (64, 128, 256, 384):
            step(seq)
        mem.set_budget(18 * MiB)
        book = mem._controller.plans
        width = mem.last_step["sample_elements"] // 384
        assert book.bucket(1, 440 * width) == book.bucket(1, 512 * width)  # one bucket
        longest = [step(512) for _ in range(3)][-1]
        assert longest["predicted_peak_bytes"] > mem.budget  # no plan fits 512 tokens
        shorter = step(440)
    assert shorter["reason"] == "shorter input" and not shorter["unfit"]
    assert shorter["predicted_peak_bytes"] <= mem.budget and shorter["observed_peak_bytes"] <= mem.budget
