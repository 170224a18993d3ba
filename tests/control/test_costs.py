"""The cost model: shape fits, and predictions learned from the run itself."""

from dataclasses import fields, replace

import pytest
from helpers import hf_batch, llama, tiny, tiny_batch

import adaptmem
from adaptmem import ALLOWED_MODES, Mode
from adaptmem.config.policy import load_policy
from adaptmem.control.costs import CostModel
from adaptmem.control.fits import MAX_SHAPES, Fit
from adaptmem.control.planner import predicted_peak
from adaptmem.control.plans import MAX_CACHED_PLANS
from adaptmem.control.priors import DERIVATIONS, HOST_PRIORS, Assumptions, Latents, Priors
from adaptmem.control.recorder import StepRecorder
from adaptmem.testing import SimulatedDevice, SimulatedProbe
from adaptmem.wrapping import get_instrumentation


def test_activation_fit_scales_with_tokens_and_learns_the_quadratic_term():
    fit = Fit("act")
    fit.add(2, 100, 2 * 100 * 10.0)  # 10 bytes per token
    assert fit.predict(4, 100) == pytest.approx(4000)
    assert fit.predict(2, 50) == pytest.approx(1000)
    assert fit.predict(2, 200, quadratic=0.5) == pytest.approx(4000 * (0.5 + 0.5 * 2))
    truth = lambda b, s: 7.0 * b * s + 0.25 * b * s * s
    fit = Fit("act")
    for b, s in ((2, 128), (2, 512)):
        fit.add(b, s, truth(b, s))
    assert fit.predict(3, 1024) == pytest.approx(truth(3, 1024), rel=1e-6)


def test_an_activation_fit_through_three_lengths_reads_a_part_that_shows_past_some_size_as_an_offset():
    """A Llama block's backward temporaries less the gradients they overlap, 0 at 2 x 128 tokens, then
    1.9, 5.9 and 12.5 MiB to 2 x 1,728: a line below zero at no tokens. Through the origin the fit took
    a square and read 289 MiB at 2 x 13,120 (the line through the two longest: 108; with an offset, 127);
    a quantity that is a square still is one."""
    mib = 2**20
    fit = Fit("act")
    for seq, y in ((128, 0.0), (384, 1.9), (896, 5.9), (1728, 12.5)):
        fit.add(2, seq, y * mib)
    line = (12.5 - 5.9) / (2 * (1728 - 896))  # MiB a token, between the two longest
    truth = 12.5 + line * 2 * (13120 - 1728)
    assert truth * mib <= fit.predict(2, 13120) <= 1.25 * truth * mib
    assert fit.predict(2, 64) >= 0
    square = lambda b, s: 7.0 * b * s + 0.25 * b * s * s
    fit = Fit("act")
    for seq in (128, 512, 1024):
        fit.add(2, seq, square(2, seq))
    assert fit.predict(2, 8192) == pytest.approx(square(2, 8192), rel=1e-6)


def test_base_fit_is_constant_downwards_and_linear_once_two_sizes_are_seen():
    fit = Fit("base")
    fit.add(1, 100, 5000.0)
    assert fit.predict(1, 50) == 5000.0
    assert fit.predict(1, 200) == 10000.0
    fit.add(1, 300, 7000.0)
    assert fit.predict(1, 500) == pytest.approx(9000.0)


def test_a_base_fit_grows_at_most_in_proportion_to_the_tokens():
    """Two close sizes whose values grew faster than the sizes (a step's other changes, its plan or its
    head's chunks, read as bytes per token) would put the line below zero at no tokens and extrapolate
    it steeply: a constant part plus a part per token cannot do that, so the fit goes through the origin."""
    fit = Fit("base")
    fit.add(2, 752, 2.49e6)  # a Nemotron block's gradient figure at 1,504 and 1,554 tokens
    fit.add(2, 777, 4.72e6)
    through = (1504 * 2.49e6 + 1554 * 4.72e6) / (1504**2 + 1554**2)
    assert fit.predict(2, 1796) == pytest.approx(through * 3592)  # the line read 100 MB here
    assert fit.predict(2, 1796) <= 4.72e6 * 3592 / 1554  # no more than in proportion to the larger
    growing = Fit("base")  # an intercept at or above zero: the line itself
    growing.add(1, 100, 5000.0)
    growing.add(1, 300, 7000.0)
    assert growing.predict(1, 500) == pytest.approx(9000.0)


def test_steps_that_find_the_gradients_kept_are_learned_apart_from_steps_that_allocate_them():
    """Accumulating, a step that finds the weights' gradients kept from the one before starts each
    block's backward without the later blocks' ones: learned in one fit, the two kinds of step
    would each be predicted as their mean, and alternating, every step would miss."""
    costs = CostModel(["Layer"] * 3, load_policy("balanced"), cuda=False, weight_grad_bytes=[10, 20, 30])
    step = _timed_step([Mode.NONE] * 3, [0.03] * 3, [1000] * 3)

    def starting(extra, resident):  # each block's backward starts `extra[i]` above its saved tensors
        return replace(
            step,
            grads_resident=resident,
            blocks=[replace(b, bwd_start=b.bwd_start + e) for b, e in zip(step.blocks, extra)],
        )

    def grads(resident):
        costs.expect_gradients(resident)  # as the controller sets it at the start of the step it plans
        return [costs.grad_bytes(i, 2, 1000) for i in range(3)]

    costs.learn(starting([55, 35, 5], resident=False))  # 5 of activation gradients, and the later weights'
    assert grads(False) == [55, 35, 5]
    assert grads(True) == [5, 5, 5]  # not yet seen kept: the same, less the later blocks' weights
    costs.learn(starting([7, 7, 7], resident=True))
    assert grads(True) == [7, 7, 7] and grads(False) == [55, 35, 5]  # each as learned, unmixed
    again = CostModel(["Layer"] * 3, load_policy("balanced"), cuda=False, weight_grad_bytes=[10, 20, 30])
    again.load_state_dict(costs.state_dict())
    for resident in (False, True):
        again.expect_gradients(resident)
        assert [again.grad_bytes(i, 2, 1000) for i in range(3)] == grads(resident)


def test_a_figure_of_accumulating_steps_seen_at_one_size_follows_the_other_states_fit():
    """The tail after the blocks' backward (an embedding's gradient, mostly) and what a backward
    starts with, seen with the gradients resident at one size only: the fit of the steps that
    allocate them, shifted by the difference where both were seen. Scaled with the tokens from one
    size, the tail was predicted 12 times over at 12 times the size."""
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False, weight_grad_bytes=[100, 100])
    for extent in (1000, 2000):  # fresh: 5000 bytes whatever the shape, and 1 a token element
        costs.tail.add(2, extent, 5000 + 2 * extent)
        costs.grad[0].add(2, extent, 100 + 3 * 2 * extent)
    costs.tail_resident.add(2, 1000, 7000 + 2 * 1000)  # 2000 more, resident
    costs.grad_resident[0].add(2, 1000, 3 * 2 * 1000)  # the later block's 100 less
    costs.expect_gradients(True)
    assert costs.tail_bytes(2, 12000) == pytest.approx(7000 + 2 * 12000)
    assert costs.grad_bytes(0, 2, 12000) == pytest.approx(3 * 2 * 12000)
    costs.expect_gradients(False)
    assert costs.tail_bytes(2, 12000) == pytest.approx(5000 + 2 * 12000)
    costs.expect_gradients(True)
    costs.tail_resident.add(2, 3000, 7000 + 2 * 3000 + 50)  # two sizes of its own: its own fit
    assert costs.tail_bytes(2, 12000) > 7000 + 2 * 12000 + 50


def test_a_figure_of_fresh_steps_seen_at_one_size_follows_the_resident_states_fit():
    """The other way round: a loop whose steps all find the gradients resident but its first (as
    under Lightning's closure, which drops them between forward and backward), and a loop after it
    that zeroes them after each optimizer step. The fresh steps' figures, seen at the first
    step's size only, follow the resident fit shifted by the difference there. Scaled with the
    tokens, a step 14 times the first's length was predicted at 94 MiB where it took 41."""
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False, weight_grad_bytes=[100, 100])
    costs.tail.add(2, 1000, 9000 + 2 * 1000)  # fresh: 2000 more than resident, whatever the shape
    costs.grad[0].add(2, 1000, 100 + 3 * 2 * 1000)
    for extent in (2000, 4000, 6000):
        costs.tail_resident.add(2, extent, 7000 + 2 * extent)
        costs.grad_resident[0].add(2, extent, 3 * 2 * extent)
    costs.expect_gradients(False)
    assert costs.tail_bytes(2, 14000) == pytest.approx(9000 + 2 * 14000)
    assert costs.grad_bytes(0, 2, 14000) == pytest.approx(100 + 3 * 2 * 14000)
    costs.tail.add(2, 3000, 9000 + 2 * 3000 + 50)  # two sizes of its own: its own fit
    assert costs.tail_bytes(2, 14000) > 9000 + 2 * 14000 + 50


def test_a_base_fits_constant_part_is_not_scaled_from_one_shape():
    fit = Fit("base")
    fixed = 3000.0  # the gradients of the weights whose backward has run
    fit.add(1, 100, 5000.0)
    assert fit.predict(1, 300, constant=fixed) == pytest.approx(3000 + 2000 * 3)
    assert fit.predict(1, 50, constant=fixed) == 5000.0
    assert Fit.from_state(fit.state_dict()).predict(1, 300, constant=fixed) == fit.predict(1, 300, constant=fixed)
    costs = CostModel(["Layer"] * 3, load_policy("balanced"), cuda=False, weight_grad_bytes=[10, 20, 30])
    assert [costs.grad_constant(i) for i in range(3)] == [50, 30, 0]  # the later blocks' weights
    accumulating = replace(_timed_step([Mode.NONE] * 3, [0.03] * 3, [1000] * 3), grads_resident=True)
    costs.learn(accumulating)  # gradients kept from the step before: none is allocated in this one
    assert [costs.grad_constant(i) for i in range(3)] == [0, 0, 0]
    costs.learn(replace(accumulating, grads_resident=False))
    assert [costs.grad_constant(i) for i in range(3)] == [50, 30, 0]


def test_the_shape_cache_forgets_the_least_recently_used_shape():
    fit = Fit("act")
    for seq in range(1, MAX_SHAPES + 1):
        fit.add(1, seq, float(seq))
    fit.add(1, 1, 1.0)  # the first shape seen comes back: now the most recent
    fit.add(1, 1000, 1000.0)  # one too many: the least recently used, seq=2, goes
    assert (1, 1) in fit.points and (1, 2) not in fit.points and len(fit.points) == MAX_SHAPES
    assert Fit.from_state(fit.state_dict()).points == fit.points  # order kept through a resume


def test_a_time_is_the_mean_of_its_last_readings_and_bytes_follow_a_change_at_once():
    time = Fit(span=4)
    for reading in (10.0, 14.0, 12.0, 8.0):  # the plain mean of the first four
        time.add(1, 100, reading)
    assert time.predict(1, 100) == pytest.approx(11.0)
    time.add(1, 100, 15.0)  # then each new one weighs a quarter
    assert time.predict(1, 100) == pytest.approx(0.75 * 11.0 + 0.25 * 15.0)
    resumed = Fit.from_state(time.state_dict())
    resumed.add(1, 100, 15.0)
    time.add(1, 100, 15.0)
    assert resumed.predict(1, 100) == time.predict(1, 100)  # the count survives a resume
    held = Fit()  # bytes: the default span of 2
    held.add(1, 100, 1000.0)
    held.add(1, 100, 1000.0)
    held.add(1, 100, 2000.0)
    assert held.predict(1, 100) == pytest.approx(1500.0)
    model = CostModel(["Layer"], load_policy(None), cuda=False)
    assert model.latent[0]["none_s"].span > model.latent[0]["activations"].span == 2


def test_pinned_bytes_at_a_shape_seen_are_what_was_seen_there_and_a_time_is_smoothed():
    """A constant part (FSDP2's gathered parameters of a block) is not proportional to the tokens:
    the least-squares terms through three lengths miss each one, but a length seen is predicted at
    what was seen; a length between them still comes from the terms. Times, noisy, are not pinned."""
    gathered, per_token = 200_000.0, 300.0
    held, time = Fit(exact=True), Fit(span=4)
    for seq in (24, 32, 40):
        held.add(2, seq, gathered + per_token * 2 * seq)
        time.add(2, seq, gathered + per_token * 2 * seq)
    lin, quad, _ = held._activation_terms()
    assert abs(lin * 80 + quad * 80 * 40 - (gathered + per_token * 80)) > 0.01 * (gathered + per_token * 80)
    for seq in (24, 32, 40):
        assert held.predict(2, seq) == gathered + per_token * 2 * seq
        assert Fit.from_state(held.state_dict()).predict(2, seq) == held.predict(2, seq)
    assert time.predict(2, 40) != gathered + per_token * 80  # the terms, not the reading
    assert not Fit.from_state(time.state_dict()).exact
    assert held.predict(2, 36) == max(lin * 72 + quad * 72 * 36, held.predict(2, 32) * 36 / 32)
    model = CostModel(["Layer"], load_policy(None), cuda=False)  # pinned under FSDP2 only
    model.direct[0][Mode.NONE] = {"held": Fit(), "seconds": Fit(span=4)}
    assert not model.direct[0][Mode.NONE]["held"].exact
    model.pin_seen_bytes()
    assert model.direct[0][Mode.NONE]["held"].exact and not model.direct[0][Mode.NONE]["seconds"].exact


def test_the_plan_cache_forgets_the_least_recently_used_bucket():
    model = tiny(n_layers=2)
    with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        with mem.step():
            model(**tiny_batch(model)).loss.backward()
        book = mem._controller.plans
        for seq in range(1, MAX_CACHED_PLANS + 1):
            book.choose(seq, 64, 0, mem.budget)
        book.choose(1, 64, 0, mem.budget)  # used again
        book.choose(999, 64, 0, mem.budget)
        keys = list(book.cache)
    assert len(keys) == MAX_CACHED_PLANS and book.bucket(1, 64) in keys and book.bucket(2, 64) not in keys


def test_every_mode_has_a_documented_derivation_and_priors_are_named():
    for mode in ALLOWED_MODES:
        derive = DERIVATIONS[mode]
        assert derive.__doc__ and len(derive.__doc__.split()) >= 4, mode.label
    assert {f.name for f in fields(Priors)} >= {
        "link_bytes_per_s",
        "hidden_share",
        "codec_bytes_per_s",
        "selective_keep_share",
        "selective_recompute_share",
    }


def test_a_faster_link_makes_offload_cheaper_and_nothing_else():
    lat = Latents(
        input_bytes=1e6,
        output_growth=0.0,
        activations=8e6,
        backward_temp=2e6,
        forward_transient=9e6,
        forward_s=0.01,
        recompute_s=0.01,
        none_s=0.03,
    )
    slow = Assumptions(HOST_PRIORS, guess=1.25, kappa=0.27)
    fast = Assumptions(replace(HOST_PRIORS, link_bytes_per_s=2 * HOST_PRIORS.link_bytes_per_s), 1.25, 0.27)
    for mode in ALLOWED_MODES:
        a, b = DERIVATIONS[mode](lat, slow), DERIVATIONS[mode](lat, fast)
        assert (a.held, a.forward_transient, a.backward_transient, a.host) == (
            b.held,
            b.forward_transient,
            b.backward_transient,
            b.host,
        ), mode.label
        if Mode.OFFLOAD in mode:
            assert b.seconds < a.seconds, mode.label
        else:
            assert b.seconds == a.seconds, mode.label


def test_copies_in_flight_count_in_what_offload_holds_within_the_window():
    """The backlog a link cannot clear during the block's forward stays on the device, up to the window."""
    lat = Latents(input_bytes=1e6, activations=8e6, forward_transient=9e6, forward_s=0.001, residue=0.2e6)
    kept = (1e6 + 0.2e6) * 1.25  # the input, and what it leaves on the device

    def held(link, cap):
        priors = replace(HOST_PRIORS, link_bytes_per_s=link, in_flight_cap=cap)
        return DERIVATIONS[Mode.OFFLOAD](lat, Assumptions(priors, guess=1.25, kappa=0.27)).held

    assert held(1e9, 0.0) == pytest.approx(kept)  # instant copies: nothing in flight
    assert held(1e9, 64e6) == pytest.approx(kept + 1.25 * (9e6 - 1e6))  # 1 MB sent in 1 ms, 8 MB behind
    assert held(1e9, 2e6) == pytest.approx(kept + 1.25 * 2e6)  # the window caps it
    assert held(1e12, 64e6) == pytest.approx(kept)  # a link faster than the forward: none left


def test_on_a_link_that_runs_beside_compute_an_offload_costs_what_its_travel_outlasts():
    """Going out, a copy hides behind the forward of the blocks after it; coming back (prefetched),
    behind the next block's backward. Only the host's work on the copies always shows: side by
    side on the stand-in's link, offloading only the first block cost that work alone, and only
    the last, twice its travel besides."""
    lat = Latents(input_bytes=1e6, activations=7e6, forward_s=0.01, none_s=0.03)
    linked = replace(HOST_PRIORS, link_bytes_per_s=1e9, covered_by_compute=True, copy_bytes_per_s=4e9)
    work, travel = 2 * 8e6 / 4e9, 8e6 / 1e9

    def seconds(out, back, priors=linked):
        return DERIVATIONS[Mode.OFFLOAD](lat, Assumptions(priors, 1.25, 0.27, out, back)).seconds

    assert seconds(0.05, 0.02) == pytest.approx(work)  # the first block: both ways hidden
    assert seconds(0.005, 0.02) == pytest.approx(work + travel - 0.005)  # little forward after it
    assert seconds(0.0, 0.0) == pytest.approx(work + 2 * travel)  # the last block
    assert seconds(0.05, 0.02, replace(linked, back_covered=False)) == pytest.approx(work + travel)
    flat = replace(linked, covered_by_compute=False, hidden_share=0.7)  # CUDA's: a share of each copy hides
    assert seconds(0.05, 0.02, flat) == pytest.approx(work + 2 * travel * 0.3)


def test_a_stand_ins_link_prices_an_offload_by_where_its_block_sits():
    """Before any block has offloaded, the prior is cheapest for the first blocks, dearest for the
    last, from the forward and backward the cost model has learned; the options set the window
    and whether copies come back early."""
    from adaptmem.control.priors import priors_for
    from adaptmem.strategies import OffloadOptions

    probe = SimulatedProbe(SimulatedDevice(2**30, link_bytes_per_s=2e5))  # a block's copy: 20 ms each way
    priors = priors_for(probe, False, [OffloadOptions()] * 4)
    assert priors.covered_by_compute and priors.back_covered and priors.in_flight_cap == float("inf")
    later = priors_for(probe, False, [OffloadOptions(prefetch=False, max_in_flight_bytes=2**20)] * 4)
    assert not later.back_covered and later.in_flight_cap == 2**20
    assert not priors_for(SimulatedProbe(SimulatedDevice(2**30)), False).covered_by_compute
    assert not priors_for(probe, True).covered_by_compute  # CUDA keeps its flat share
    costs = CostModel(["Layer"] * 4, load_policy("balanced"), cuda=False, priors=priors)
    costs.learn(_timed_step([Mode.NONE] * 4, [0.030] * 4, [1000] * 4))  # forward 10 ms, backward 20
    moved = 1000 + 3000  # the input and the activations, as the step showed them
    travel, work = moved / 2e5, 2 * moved / priors.copy_bytes_per_s
    seconds = [costs.figures(i, Mode.OFFLOAD, 2, 1000).seconds for i in range(4)]
    # out: 30, 20, 10 and 0 ms of forward after it; back: the next block's 20 ms backward, none for the last
    assert seconds == pytest.approx([work, work, work + travel - 0.010, work + 2 * travel])


class Harness:
    """A model, a stand-in device, a recorder and a cost model, wired as the manager wires them."""

    def __init__(self, model, make_batch, policy="max-savings"):
        self.model, self.make_batch = model, make_batch
        self.handles = adaptmem.instrument(model)
        self.dev = SimulatedDevice()
        self.dev.track(model)
        self.recorder = StepRecorder(SimulatedProbe(self.dev))
        get_instrumentation(model).runtime.observer = self.recorder
        self.costs = CostModel([type(h.module).__name__ for h in self.handles], load_policy(policy), cuda=False)

    def run(self, modes, seq, learn=True):
        for h, m in zip(self.handles, modes):
            h.mode = m
        self.model.zero_grad(set_to_none=True)
        with self.dev:
            self.recorder.begin()
            self.model(**self.make_batch(seq)).loss.backward()
            sample = self.recorder.end()
        if learn:
            self.costs.learn(sample)
        return sample

    def predict(self, modes, sample):
        rows = self.costs.options(sample.batch, sample.extent, ALLOWED_MODES, fixed=dict(enumerate(modes)))
        head = self.costs.head_bytes(sample.batch, sample.extent)
        return sample.blocks[0].start + predicted_peak([r[0] for r in rows], head)


@pytest.fixture(params=["tiny", "hf-llama"])
def harness(request):
    if request.param == "tiny":
        model = tiny(dim=128, n_layers=4, vocab_size=256)
        return Harness(model, lambda s: tiny_batch(model, batch=4, seq=s))
    return Harness(llama(layers=4, hidden=128), lambda s: hf_batch(batch=2, seq=s))


def test_one_checkpoint_step_predicts_none_closely_and_every_mode_conservatively(harness):
    harness.run([Mode.CHECKPOINT] * 4, 256)
    for mode in ALLOWED_MODES:
        sample = harness.run([mode] * 4, 256, learn=False)
        predicted = harness.predict([mode] * 4, sample)
        assert predicted >= sample.peak * 0.97, mode.label  # never far below
        if mode in (Mode.NONE, Mode.CHECKPOINT, Mode.CHECKPOINT | Mode.OFFLOAD):
            assert predicted <= sample.peak * 1.10, mode.label  # follow from measurements
        if mode in (Mode.COMPRESS, Mode.COMPRESS | Mode.OFFLOAD):
            # a guess, with its margin, but of a backward that decodes each tensor as autograd reads it
            # (1.8x to 2.0x when it assumed them all back at once, a compressed copy counted twice)
            assert predicted <= sample.peak * 1.6, mode.label


def test_measured_modes_predict_mixed_plans(harness):
    for mode in ALLOWED_MODES:
        harness.run([mode] * 4, 256)
    for modes in (
        [Mode.NONE, Mode.OFFLOAD, Mode.COMPRESS, Mode.CHECKPOINT],
        [Mode.SELECTIVE, Mode.NONE, Mode.CHECKPOINT | Mode.OFFLOAD, Mode.NONE],
    ):
        sample = harness.run(modes, 256, learn=False)
        assert harness.predict(modes, sample) == pytest.approx(sample.peak, rel=0.08)


def test_two_lengths_predict_a_third_never_seen(harness):
    for seq in (64, 256):
        harness.run([Mode.NONE] * 4, seq)
    sample = harness.run([Mode.NONE] * 4, 512, learn=False)
    assert harness.predict([Mode.NONE] * 4, sample) == pytest.approx(sample.peak, rel=0.12)


def test_state_round_trip_and_mismatch(harness):
    harness.run([Mode.CHECKPOINT] * 4, 128)
    other = CostModel(harness.costs.classes, harness.costs.policy, cuda=False)
    other.load_state_dict(harness.costs.state_dict())
    assert other.figures(1, Mode.NONE, 2, 300) == harness.costs.figures(1, Mode.NONE, 2, 300)
    wrong = CostModel(["Other"] * 3, harness.costs.policy, cuda=False)
    with pytest.raises(ValueError, match="cost model state is for 4 blocks"):
        wrong.load_state_dict(harness.costs.state_dict())


def _timed_step(modes, seconds, sizes, batch=2, extent=1000, recompute=0.0, moved=None):
    """A step whose block i ran modes[i] for seconds[i] (forward and backward together), of which
    `recompute` recomputing in backward where its mode recomputes, and `moved[i]` in its pack and
    unpack hooks where its mode packs; an offloaded block keeps its input on the device and sends
    the rest of its activations away."""
    from adaptmem.control.samples import BlockSample, StepSample

    blocks, at = [], 0
    for i, (mode, took, size) in enumerate(zip(modes, seconds, sizes)):
        held = size if mode is Mode.OFFLOAD else 4 * size
        blocks.append(
            BlockSample(
                index=i,
                mode=mode,
                input_bytes=size,
                start=at,
                end=at + held,
                fwd_top=at + held + size,
                held=held,
                output_bytes=size,
                bwd_start=at + held,
                bwd_top=at + held + 2 * size,
                fwd_seconds=took / 3,
                bwd_seconds=2 * took / 3,
                recompute_seconds=recompute if mode & (Mode.CHECKPOINT | Mode.SELECTIVE) else 0.0,
                moved_seconds=moved[i] if moved and mode & (Mode.OFFLOAD | Mode.COMPRESS) else None,
            )
        )
        at += held
    return StepSample(batch=batch, extent=extent, blocks=blocks, completed=True, seconds=sum(seconds))


def test_a_modes_time_is_pooled_over_blocks_alike_and_only_those():
    """Block by block, timings are noisy: alike blocks (same class, same input size) share the mean of
    their measured overheads, so the planner does not pick blocks by noise; a block of the same class
    with another input size (a later stage) keeps its own."""
    policy = load_policy("balanced")
    costs = CostModel(["Layer"] * 5, policy, cuda=False)
    sizes = [1000, 1000, 1000, 1000, 500]  # the last: another stage, half the input
    costs.learn(_timed_step([Mode.NONE] * 5, [0.040, 0.042, 0.038, 0.060, 0.020], sizes))
    costs.learn(
        _timed_step(
            [Mode.CHECKPOINT, Mode.CHECKPOINT, Mode.NONE, Mode.CHECKPOINT, Mode.CHECKPOINT],
            [0.045, 0.062, 0.038, 0.061, 0.030],
            sizes,
        )
    )
    seconds = [costs.figures(i, Mode.CHECKPOINT, 2, 1000).seconds for i in range(5)]

    def own(i):  # block i's own fits: the checkpoint's time less NONE's
        return costs.direct[i][Mode.CHECKPOINT]["seconds"].predict(2, 1000) - costs.direct[i][Mode.NONE][
            "seconds"
        ].predict(2, 1000)

    assert seconds[0] == seconds[1] == seconds[2] == seconds[3] == pytest.approx((own(0) + own(1) + own(3)) / 3)
    assert len({round(own(i), 6) for i in (0, 1, 3)}) == 3  # the blocks did differ
    assert seconds[4] == pytest.approx(own(4)) and seconds[4] != pytest.approx(seconds[0])


def test_a_mode_not_run_on_a_block_is_borrowed_only_from_a_block_alike():
    """A block of the same class in another stage of a network (another input size) keeps other
    bytes: borrowed for the first stages of a CNN, a later stage's SELECTIVE put three stages
    at 96 pixels 1.14x over the budget. Blocks alike (class and size) do share."""
    S, N = Mode.SELECTIVE, Mode.NONE
    costs = CostModel(["Stage"] * 3, load_policy("balanced"), cuda=False)
    sizes = [500, 1000, 1000]  # the first: another stage, half the input
    costs.learn(_timed_step([N] * 3, [0.03] * 3, sizes))
    costs.learn(_timed_step([S, N, N], [0.03] * 3, sizes, recompute=0.002))
    derived = costs._derive(S, costs.latents(1, 2, 1000)).held
    assert costs.figures(1, S, 2, 1000).held == pytest.approx(derived)
    assert derived != pytest.approx(costs.direct[0][S]["held"].predict(2, 1000))
    costs.learn(_timed_step([S, S, N], [0.03] * 3, sizes, recompute=0.002))
    assert costs.figures(2, S, 2, 1000).held == pytest.approx(costs.direct[1][S]["held"].predict(2, 1000))


def test_a_recomputing_mode_costs_at_least_its_recompute_read_in_the_same_step():
    """A mode's overhead is its time less NONE's, read in different steps: read during a slow
    spell, NONE makes SELECTIVE look free, and once every block is in SELECTIVE no NONE reading
    comes to mend it. Its recompute, timed within its own step, is a floor."""
    costs = CostModel(["Layer"] * 4, load_policy("balanced"), cuda=False)
    sizes = [1000] * 4
    costs.learn(_timed_step([Mode.NONE] * 4, [0.060] * 4, sizes))  # a slow spell
    costs.learn(_timed_step([Mode.SELECTIVE] * 2 + [Mode.NONE] * 2, [0.050] * 2 + [0.040] * 2, sizes, recompute=0.006))
    assert costs.times.own_overhead(0, Mode.SELECTIVE, 2, 1000) < 0  # the difference alone: free
    assert costs.figures(0, Mode.SELECTIVE, 2, 1000).seconds == pytest.approx(0.006)
    assert costs.figures(3, Mode.SELECTIVE, 2, 1000).seconds == pytest.approx(0.006)  # alike: pooled
    costs.learn(_timed_step([Mode.CHECKPOINT] * 4, [0.070] * 4, sizes, recompute=0.025))
    assert costs.figures(0, Mode.CHECKPOINT, 2, 1000).seconds == pytest.approx(0.025)  # above the difference (0.015)
    assert costs.figures(0, Mode.SELECTIVE, 2, 1000).seconds == pytest.approx(0.006)  # each mode its own


def test_a_recomputing_mode_costs_its_recompute_not_a_difference_of_two_steps():
    """CHECKPOINT and SELECTIVE do nothing NONE does not but their recompute, read within their own
    step. Read on one block against NONE's time from other steps, SELECTIVE looked 20 ms dearer
    for a 3 ms recompute (side by side it cost 3.2 ms), and the planner never chose it again."""
    costs = CostModel(["Layer"] * 4, load_policy("balanced"), cuda=False)
    sizes = [1000] * 4
    costs.learn(_timed_step([Mode.CHECKPOINT] * 4, [0.120] * 4, sizes, recompute=0.025))
    costs.learn(
        _timed_step(
            [Mode.CHECKPOINT, Mode.SELECTIVE, Mode.NONE, Mode.NONE],
            [0.120, 0.118, 0.095, 0.095],
            sizes,
            recompute=0.003,
        )
    )
    assert costs.times.own_overhead(1, Mode.SELECTIVE, 2, 1000) > 0.015  # the difference: a cold, noisy reading
    for i in range(4):
        assert costs.figures(i, Mode.SELECTIVE, 2, 1000).seconds == pytest.approx(0.003)
    # CHECKPOINT: the mean of the alike blocks' recompute readings (block 0's second one was 3 ms)
    recomputes = [costs.direct[j][Mode.CHECKPOINT]["recompute_s"].predict(2, 1000) for j in range(4)]
    assert recomputes == pytest.approx([0.014, 0.025, 0.025, 0.025])
    assert costs.figures(2, Mode.CHECKPOINT, 2, 1000).seconds == pytest.approx(sum(recomputes) / 4)
    # an offload read without its hooks' time is a difference still: its copies are not a recompute
    costs.learn(_timed_step([Mode.OFFLOAD] + [Mode.NONE] * 3, [0.130] + [0.095] * 3, sizes))
    costs.learn(_timed_step([Mode.OFFLOAD] + [Mode.NONE] * 3, [0.130] + [0.095] * 3, sizes))
    assert costs.figures(0, Mode.OFFLOAD, 2, 1000).seconds > 0.02


def test_selective_costs_its_recompute_and_what_its_forward_takes_over_a_plain_one():
    """SELECTIVE's forward runs every op through a dispatch mode: side by side 1.1 to 2.4 ms a block,
    as much as its recompute. It is read as its blocks' forward less their plain forward (NONE's
    where they ran it, else the one learned from NONE and CHECKPOINT), pooled over the alike blocks."""
    S, N, C = Mode.SELECTIVE, Mode.NONE, Mode.CHECKPOINT
    costs = CostModel(["Layer"] * 4, load_policy("balanced"), cuda=False)
    sizes = [1000] * 4  # a block's forward is a third of its time here
    costs.learn(_timed_step([C] * 4, [0.090] * 4, sizes, recompute=0.030))  # plain forwards of 0.030
    costs.learn(_timed_step([N, N, S, S], [0.060, 0.060, 0.0696, 0.0696], sizes, recompute=0.003))
    # SELECTIVE's forward (0.0232) against the plain one learned from CHECKPOINT (0.030): nothing over
    assert costs.figures(0, S, 2, 1000).seconds == pytest.approx(0.003)
    costs.learn(_timed_step([S, S, N, N], [0.0696, 0.0696, 0.066, 0.066], sizes, recompute=0.003))
    # each block against its own NONE forward: 0.0232 - 0.020 on blocks 0 and 1, 0.0232 - 0.022 on 2 and 3
    extra = ((0.0232 - 0.020) + (0.0232 - 0.022)) / 2
    for i in range(4):
        assert costs.figures(i, S, 2, 1000).seconds == pytest.approx(0.003 + extra, abs=1e-6)


def test_a_packing_mode_costs_its_hooks_time_read_in_its_own_step():
    """OFFLOAD and COMPRESS do nothing NONE does not but what their pack and unpack hooks do
    (copies, waits for the link, codecs), timed within their own step. As a difference from NONE's
    time in other steps, an offload read from -26 to +22 ms a block where side by side it cost 5 to
    10 ms. An offload keeps its own block's reading, in block order; CHECKPOINT|OFFLOAD adds its
    recompute; on CUDA, whose copies the host does not wait for, the difference stays."""
    O, N, C, K = Mode.OFFLOAD, Mode.NONE, Mode.COMPRESS, Mode.CHECKPOINT | Mode.OFFLOAD
    sizes = [1000] * 4
    steps = [
        _timed_step([N] * 4, [0.095] * 4, sizes),
        _timed_step([O, O, N, N], [0.130, 0.090, 0.095, 0.095], sizes, moved=[0.004, 0.007, 0, 0]),
        _timed_step([O, O, N, N], [0.128, 0.093, 0.095, 0.095], sizes, moved=[0.004, 0.007, 0, 0]),
        _timed_step([K, C, N, N], [0.150, 0.100, 0.095, 0.095], sizes, recompute=0.020, moved=[0.002, 0.003, 0, 0]),
    ]
    host, cuda = (CostModel(["Layer"] * 4, load_policy("balanced"), cuda=on) for on in (False, True))
    for sample in steps:
        host.learn(sample)
        cuda.learn(replace(sample, blocks=[replace(b) for b in sample.blocks]))
    assert host.times.own_overhead(0, O, 2, 1000) > 0.03 and host.times.own_overhead(1, O, 2, 1000) < 0
    offload = [host.figures(i, O, 2, 1000).seconds for i in range(4)]
    assert offload == pytest.approx([0.004, 0.007, 0.007, 0.007], abs=1e-5)  # own, then held at the last
    assert host.figures(0, K, 2, 1000).seconds == pytest.approx(0.020 + 0.002, abs=1e-5)
    penalty = host.penalty(C, host.latents(1, 2, 1000))
    assert host.figures(3, C, 2, 1000).seconds == pytest.approx(0.003 + penalty, abs=1e-5)
    # the two blocks' second readings (a first offload's stands only until the next), non-decreasing: pooled
    difference = ((0.128 - 0.095) + (0.093 - 0.095)) / 2
    assert cuda.figures(0, O, 2, 1000).seconds == pytest.approx(difference, abs=1e-5)


def test_an_offload_keeps_its_own_blocks_time_where_it_ran_there():
    """Where a copy is made decides how much compute hides it: a block's own offload time is used,
    and the pooled one only for alike blocks that have not offloaded yet."""
    costs = CostModel(["Layer"] * 4, load_policy("balanced"), cuda=False)
    sizes = [1000] * 4
    costs.learn(_timed_step([Mode.NONE] * 4, [0.040] * 4, sizes))
    for _ in range(2):  # a block's first offload allocates its host memory: that time is not learned
        costs.learn(
            _timed_step([Mode.OFFLOAD, Mode.NONE, Mode.OFFLOAD, Mode.NONE], [0.045, 0.040, 0.080, 0.040], sizes)
        )
    seconds = [costs.figures(i, Mode.OFFLOAD, 2, 1000).seconds for i in range(4)]
    assert seconds[0] == pytest.approx(0.005) and seconds[2] == pytest.approx(0.04)  # their own
    assert seconds[1] == pytest.approx((0.005 + 0.04) / 2)  # pooled, between its neighbours
    assert seconds[3] == pytest.approx(0.04)  # pooled would be cheaper than block 2's: a later copy is not


def test_among_alike_blocks_a_later_offload_never_costs_less():
    """A copy made later has less compute after it to hide behind. One block's reading moves by as
    much as an offload costs, so readings that fall along the blocks are pooled (their mean), and
    the planner offloads the first blocks, not the ones that read cheap by chance."""
    from adaptmem.control.planner import plan

    costs = CostModel(["Layer"] * 8, load_policy("balanced"), cuda=False)
    sizes = [1000] * 8
    costs.learn(_timed_step([Mode.NONE] * 8, [0.040] * 8, sizes))
    O, N = Mode.OFFLOAD, Mode.NONE
    for _ in range(2):  # noisy readings: the later offloads read cheaper than the first ones
        costs.learn(_timed_step([O, O, N, N, N, O, O, N], [0.050, 0.049, 0.04, 0.04, 0.04, 0.045, 0.046, 0.04], sizes))
    seconds = [costs.figures(i, O, 2, 1000).seconds for i in range(8)]
    assert seconds == sorted(seconds)
    assert seconds[0] == seconds[1] == seconds[5] == seconds[6] == pytest.approx(0.0075)  # all pooled
    assert seconds[2] == seconds[7] == pytest.approx(0.0075)
    options = costs.options(2, 1000, (N, O))
    everything = sum(row[0].saved for row in options)
    result = plan(options, capacity=everything - 3.5 * (options[0][0].saved - options[0][1].saved))
    k = result.modes.count(O)
    assert result.feasible and 0 < k < 8 and result.modes == (O,) * k + (N,) * (8 - k)

    costs.learn(_timed_step([O, O, N, N, N, O, O, N], [0.044, 0.046, 0.04, 0.04, 0.04, 0.058, 0.060, 0.04], sizes))
    seconds = [costs.figures(i, O, 2, 1000).seconds for i in range(8)]
    own = [costs.times.own_overhead(i, O, 2, 1000) for i in (0, 1, 5, 6)]
    assert own == sorted(own) and [seconds[i] for i in (0, 1, 5, 6)] == pytest.approx(own)  # in order: their own
    assert own[1] <= seconds[3] <= own[2]  # between its measured neighbours

    # block 2's first offload is cold; while alike blocks have warm readings it counts as not yet read
    costs.learn(_timed_step([O, O, O, N, N, O, O, N], [0.044, 0.046, 0.300, 0.04, 0.04, 0.058, 0.060, 0.04], sizes))
    assert costs.provisional and costs.times.own_overhead(2, O, 2, 1000) > 0.25
    own = [costs.times.own_overhead(i, O, 2, 1000) for i in (0, 1, 5, 6)]
    assert own[1] <= costs.figures(2, O, 2, 1000).seconds <= own[2]


def test_a_block_before_every_measured_offload_costs_no_more_than_the_first_of_them():
    """Where only later blocks have offloaded, an earlier block's offload is priced at most as the
    first measured one (their mean, held between its neighbours): priced at the mean, it read dearer
    than a later block, and a plan with one offload took block 1 and never tried block 0."""
    from adaptmem.control.planner import plan, predicted_peak

    costs = CostModel(["Layer"] * 6, load_policy("balanced"), cuda=False)
    sizes = [1000] * 6
    N, O = Mode.NONE, Mode.OFFLOAD
    costs.learn(_timed_step([N] * 6, [0.040] * 6, sizes))
    for _ in range(2):
        costs.learn(_timed_step([N, O, N, O, N, N], [0.040, 0.044, 0.040, 0.050, 0.040, 0.040], sizes))
    seconds = [costs.figures(i, O, 2, 1000).seconds for i in range(6)]
    assert seconds == sorted(seconds)
    assert seconds[0] == pytest.approx(0.004) and seconds[2] == pytest.approx(0.007)  # at most block 1's; the mean
    assert seconds[4] == seconds[5] == pytest.approx(0.010)  # at least block 3's
    options = costs.options(2, 1000, (N, O))
    one = predicted_peak([options[0][1]] + [row[0] for row in options[1:]])  # the first block offloaded
    assert one < predicted_peak([row[0] for row in options])
    result = plan(options, capacity=one * 1.002)  # a little over: the planner rounds bytes up to its bins
    assert result.feasible and result.modes == (O,) + (N,) * 5


def test_a_blocks_first_offload_time_stands_only_until_the_next_reading():
    """The first offload of a block allocates the host memory it copies into (pinned buffers on CUDA,
    fresh pages on the host): that step's time is the allocation's as much as the mode's. It is used
    (the plan has nothing better) but not averaged in: the next reading replaces it, and the cost
    model asks for the next step to be measured so that the reading comes at once."""
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False)
    sizes = [1000] * 2
    costs.learn(_timed_step([Mode.NONE] * 2, [0.040] * 2, sizes))
    assert not costs.provisional
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.NONE], [0.300, 0.040], sizes))  # cold: 0.254 s of allocation
    assert costs.provisional
    assert costs.figures(0, Mode.OFFLOAD, 2, 1000).seconds == pytest.approx(0.26)
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.NONE], [0.046, 0.040], sizes))
    assert not costs.provisional
    assert costs.figures(0, Mode.OFFLOAD, 2, 1000).seconds == pytest.approx(0.006)  # replaced, not averaged
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.NONE], [0.050, 0.040], sizes))
    assert costs.figures(0, Mode.OFFLOAD, 2, 1000).seconds == pytest.approx(0.008)  # warm readings average
    costs.learn(_timed_step([Mode.CHECKPOINT | Mode.OFFLOAD, Mode.OFFLOAD], [0.300, 0.300], sizes))
    assert costs.provisional  # another offloading mode on block 0, and block 1's first offload


def test_among_equally_cheap_blocks_the_earliest_are_managed():
    """Pooled, alike blocks cost the same in a mode: the plan manages the first ones, whose bytes
    wait longest for backward, and an offload goes first of all: its copies have the most compute
    to hide behind there."""
    from adaptmem.control.planner import plan

    costs = CostModel(["Layer"] * 6, load_policy("balanced"), cuda=False)
    sizes = [1000] * 6
    costs.learn(_timed_step([Mode.NONE] * 6, [0.040, 0.041, 0.039, 0.040, 0.042, 0.038], sizes))
    costs.learn(_timed_step([Mode.NONE, Mode.OFFLOAD] * 3, [0.040, 0.049, 0.039, 0.048, 0.042, 0.046], sizes))
    options = costs.options(2, 1000, (Mode.NONE, Mode.OFFLOAD))
    offload = [row[1].seconds for row in options]
    assert offload == sorted(offload) and len(set(offload)) == 6  # equal but for where: earlier is cheaper
    everything = sum(row[0].saved for row in options)
    result = plan(options, capacity=everything - 1.5 * (options[0][0].saved - options[0][1].saved))
    k = result.modes.count(Mode.OFFLOAD)
    assert result.feasible and 0 < k < 6 and result.modes == (Mode.OFFLOAD,) * k + (Mode.NONE,) * (6 - k)


def test_a_backwards_own_weight_gradients_are_not_scaled_with_the_tokens():
    """A block's backward allocates its weights' gradients whatever the shape: learned as a
    transient, they would be predicted to grow with the tokens."""
    own = 3000
    costs = CostModel(["Layer"], load_policy("balanced"), cuda=False, weight_grad_bytes=[own])

    def step(extent):  # the backward's transient: its weights' gradients and 2 bytes a token element
        s = _timed_step([Mode.NONE], [0.03], [extent], batch=1, extent=extent)
        b = s.blocks[0]
        return replace(s, blocks=[replace(b, bwd_top=b.bwd_start + own + 2 * extent)])

    costs.learn(step(1000))
    costs.learn(step(2000))
    assert costs.direct[0][Mode.NONE]["backward_transient"].predict(1, 1000) == pytest.approx(2000)  # learned less them
    # within the derivation's measured margin, which a carried figure keeps on what it adds
    assert costs.figures(0, Mode.NONE, 1, 8000).backward_transient == pytest.approx(own + 2 * 8000, rel=0.05)
    # resident from the step before, the backward allocates them all the same (and adds them into
    # the resident ones): a step that accumulates peaks as high in the block's backward
    costs.expect_gradients(True)
    assert costs.figures(0, Mode.NONE, 1, 8000).backward_transient == pytest.approx(own + 2 * 8000, rel=0.05)
    costs.learn(replace(step(4000), grads_resident=True))  # learned less them, as the others were
    assert costs.direct[0][Mode.NONE]["backward_transient"].predict(1, 4000) == pytest.approx(8000)


def test_a_pack_hooks_bytes_do_not_teach_the_activations():
    """A pack hook sees every saved view apart, more bytes than the storages a recompute or NONE
    holds: the activations are learned from those two only. Until one of them shows them, what the
    block packed stands for them (erring high), and the first reading replaces it, not mixed in."""
    costs = CostModel(["Layer"], load_policy("balanced"), cuda=False)
    s = _timed_step([Mode.OFFLOAD], [0.03], [1000])
    costs.learn(replace(s, blocks=[replace(s.blocks[0], packed=9000)]))
    costs.learn(replace(s, batch=4, blocks=[replace(s.blocks[0], packed=18000)]))
    assert not costs.latent[0]["activations"].settled
    assert costs.latents(0, 2, 1000).activations == pytest.approx(9000)
    costs.learn(_timed_step([Mode.NONE], [0.03], [1000]))
    assert costs.latent[0]["activations"].settled and len(costs.latent[0]["activations"].points) == 1
    assert costs.latent[0]["activations"].predict(2, 1000) == pytest.approx(4000 - 1000)
    costs.learn(replace(s, blocks=[replace(s.blocks[0], packed=9000)]))  # read since: packed bytes no more
    assert costs.latent[0]["activations"].predict(2, 1000) == pytest.approx(4000 - 1000)


def _linear_step(modes, extent, *, constant=0):
    """A step at `extent` (batch 1) whose blocks' bytes grow linearly with it: input `extent`,
    activations 3 x `extent` (what a checkpoint recomputes), a forward transient of 2 x `extent`;
    a checkpoint's backward holds them again and `constant` bytes besides (what of its weights'
    gradients are allocated at its peak), NONE's the `constant` alone."""
    from adaptmem.control.samples import BlockSample, StepSample

    blocks, at = [], 0
    for i, mode in enumerate(modes):
        held = extent if mode & Mode.CHECKPOINT else 4 * extent
        blocks.append(
            BlockSample(
                index=i,
                mode=mode,
                input_bytes=extent,
                start=at,
                end=at + held,
                fwd_top=at + 2 * extent,
                held=held,
                output_bytes=extent,
                bwd_start=at + held,
                bwd_top=at + held + (3 * extent if mode & Mode.CHECKPOINT else 0) + constant,
                fwd_seconds=0.01,
                bwd_seconds=0.02,
                recompute_bytes=3 * extent if mode & Mode.CHECKPOINT else None,
            )
        )
        at += held
    return StepSample(batch=1, extent=extent, blocks=blocks, completed=True, seconds=0.03)


def test_a_figure_seen_at_one_length_grows_as_its_alike_blocks_showed_not_by_the_prior():
    """Block 1 ran CHECKPOINT at one length, block 0 (alike) at three that show its forward
    transient linear: block 1's is carried as block 0's grows, not by the assumed quadratic share
    (which grew a 128-token reading 5.4-fold past linear at 2389 tokens)."""
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False)
    costs.learn(_linear_step([Mode.CHECKPOINT] * 2, 1000))
    for extent in (2000, 4000):
        costs.learn(_linear_step([Mode.CHECKPOINT, Mode.NONE], extent))
    far = 32000
    assert costs.figures(1, Mode.CHECKPOINT, 1, far).forward_transient == pytest.approx(2 * far, rel=0.05)
    alone = CostModel(["Layer"], load_policy("balanced"), cuda=False)  # nothing alike: the prior's share
    alone.learn(_linear_step([Mode.CHECKPOINT], 1000))
    assert alone.figures(0, Mode.CHECKPOINT, 1, far).forward_transient > 4 * 2 * far


def test_a_figure_seen_at_two_lengths_grows_as_an_alike_block_seen_at_more_showed():
    """Two lengths leave a part that shows only past some size read as a square: block 0's backward
    temporaries, seen at 2 x 320 and 2 x 1,728 tokens, were extrapolated to 401 MiB at 2 x 13,120, where
    block 1, alike and seen at four lengths, read about 102 (and an offload's backward, carried by
    them, grew with the tokens alone). Block 0's is carried from its own reading as block 1's grows."""
    mib = 2**20
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False)
    temporaries = {320: 1.4, 1728: 12.5, 2432: 18.0, 4096: 31.1}
    for seq, y in temporaries.items():
        for i in (0, 1):
            costs.latent[i]["input_bytes"].add(2, seq, 2 * seq * 1024.0)
            if i == 1 or seq in (320, 1728):
                costs.latent[i]["backward_temp"].add(2, seq, y * mib)
    alike = costs.latents(1, 2, 13120).backward_temp
    assert 95 * mib < alike < 110 * mib
    assert costs.latents(0, 2, 13120).backward_temp == pytest.approx(alike, rel=0.05)
    assert costs.latents(0, 2, 1728).backward_temp == 12.5 * mib  # a length seen is what was seen
    alone = CostModel(["Layer"], load_policy("balanced"), cuda=False)  # nothing alike: its own fit
    for seq in (320, 1728):
        alone.latent[0]["backward_temp"].add(2, seq, temporaries[seq] * mib)
    assert alone.latents(0, 2, 13120).backward_temp > 300 * mib


def test_a_modes_forward_carried_from_one_length_grows_at_least_as_the_plain_forwards_transient():
    """SELECTIVE's forward, read at one length alone, carried by its guess (the plain transient plus
    what it keeps, linear) grew slower than the attention's scores it holds at its peak, a square: a
    GptOss's was predicted at 172 MiB at 2 x 1,296 tokens, where a plain forward's transient was 189."""
    costs = CostModel(["Layer"], load_policy("balanced"), cuda=False)
    square = lambda s: 1000.0 * 2 * s + 50.0 * 2 * s * s
    for seq in (256, 512, 768):
        costs.latent[0]["forward_transient"].add(2, seq, square(seq))
        costs.latent[0]["activations"].add(2, seq, 4000.0 * 2 * seq)
        costs.latent[0]["input_bytes"].add(2, seq, 256.0 * 2 * seq)
    fits = {q: Fit() for q in ("held", "forward_transient", "backward_transient")} | {"seconds": Fit(span=4)}
    fits["held"].add(2, 768, 2000.0 * 2 * 768)
    fits["forward_transient"].add(2, 768, square(768))
    costs.direct[0][Mode.SELECTIVE] = fits
    carried = costs.figures(0, Mode.SELECTIVE, 2, 1296).forward_transient
    assert carried >= square(1296) * 0.999


def test_a_checkpoints_constant_backward_part_is_carried_as_a_constant_not_scaled():
    """A checkpoint's backward at its peak holds part of its weights' gradients: a constant. Carried
    from a short length to a long one, it stays a constant; scaled with the recompute, it made a
    backward predicted at half its bytes."""
    own, constant = 4000, 2000
    costs = CostModel(["Layer"], load_policy("balanced"), cuda=False, weight_grad_bytes=[own])
    for extent in (1000, 2000):  # NONE shows the activations at two lengths
        costs.learn(_linear_step([Mode.NONE], extent, constant=own))
    costs.learn(_linear_step([Mode.CHECKPOINT], 1000, constant=constant))
    far, truth = 16000, 3 * 16000 + constant
    backward_transient = costs.figures(
        0, Mode.CHECKPOINT, 1, far
    ).backward_transient  # with the measured margin on what is added
    assert truth <= backward_transient <= 1.1 * truth


def test_only_a_step_that_offloads_a_cold_block_is_measured_for_its_warm_reading():
    """After a measured step holding a block's first offload, a step whose plan does not offload
    that block is not measured for it (it would not read it); the next one that does is."""
    from adaptmem.control.plans import PlanRecord
    from adaptmem.control.schedule import MeasureSchedule

    policy = load_policy("balanced")
    costs = CostModel(["Layer"] * 2, policy, cuda=False)
    schedule = MeasureSchedule(policy, costs)
    for extent in (1000, 2000, 1000):
        costs.learn(_timed_step([Mode.NONE] * 2, [0.040] * 2, [extent] * 2, extent=extent))
    record = lambda modes, extent: PlanRecord(modes, (2, extent, False), extent, 0, None, "test", seen=extent)
    assert not schedule.worth(record((Mode.NONE,) * 2, 1500))  # two sizes measured: a third is predicted
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.NONE], [0.300, 0.040], [1000] * 2))  # a first offload: cold
    assert costs.cold == {(0, Mode.OFFLOAD)}
    assert not schedule.worth(record((Mode.NONE, Mode.OFFLOAD), 1200))  # block 1's first offload: light
    assert schedule.worth(record((Mode.OFFLOAD, Mode.NONE), 1300))  # block 0's warm reading
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.NONE], [0.046, 0.040], [1000] * 2))
    assert costs.cold == set() and (1, Mode.OFFLOAD) in costs.offloaded  # block 1 ran it, unmeasured
    costs.offloaded.discard((1, Mode.OFFLOAD))
    costs.learn(_timed_step([Mode.OFFLOAD, Mode.OFFLOAD], [0.046, 0.300], [1000] * 2))  # block 1 cold
    assert costs.cold == {(1, Mode.OFFLOAD)}
    assert not schedule.worth(record((Mode.OFFLOAD,) * 2, 1400))  # block 0, alike, has a warm reading


def test_gradients_resident_from_the_step_before_are_not_taken_as_allocated_within_it():
    """The later blocks' weight gradients count as a constant part of what a block's backward
    starts with only when the step allocates them; accumulating, they were there before it."""
    model = tiny(dim=64, n_layers=3, vocab_size=128)
    batch = tiny_batch(model, batch=2, seq=16)
    with adaptmem.manage(model, budget=64 * 2**20, device=SimulatedDevice(capacity_bytes=256 * 2**20)) as mem:
        mem.run_step(lambda: model(**batch).loss.backward())
        layer = sum(w.numel() * w.element_size() for w in mem.handles[-1].module.parameters())
        assert mem._controller.costs.grad_constant(0) == 2 * layer
        mem.run_step(lambda: model(**batch).loss.backward())  # accumulates: no zero_grad between
        assert mem.last_step["measured"] and mem._controller.costs.grad_constant(0) == 0


def test_a_step_that_failed_before_the_backward_does_not_teach_the_head():
    """A step that ran out of memory in a block's forward (or in the head) read the head's peak only
    in part, from the last block it finished: learned, the head's bytes at that shape fell to what
    little was allocated before the failure, and the retry's plan counted on it."""
    costs = CostModel(["Layer"] * 2, load_policy("balanced"), cuda=False)
    whole = _linear_step([Mode.NONE] * 2, 1000)
    costs.learn(replace(whole, head_top=whole.blocks[-1].end + 5000))
    assert costs.head_bytes(1, 1000) == pytest.approx(5000)
    failed = replace(whole, completed=False, blocks=[replace(b, bwd_start=None, bwd_top=None) for b in whole.blocks])
    costs.learn(replace(failed, head_top=failed.blocks[-1].end + 100))  # a part of the head, then the error
    assert costs.head_bytes(1, 1000) == pytest.approx(5000)
    costs.learn(replace(whole, head_top=whole.blocks[-1].end + 6000))  # a whole step learns it again
    assert costs.head_bytes(1, 1000) > 5000


def test_a_cost_model_put_back_predicts_from_what_it_learns_next_not_from_what_it_knew_before():
    """Each block's latents are kept per shape until the model learns or is put back. A batch given up
    puts it back (`restore`) to as many steps learned as before the batch, and the next step it learns
    is another: its predictions are that step's, as a model that never saw the batch given up makes them."""
    model = tiny(dim=128, n_layers=4, vocab_size=256)
    harness = Harness(model, lambda s: tiny_batch(model, batch=4, seq=s))
    harness.run([Mode.NONE] * 4, 64)
    given_up, next_one = (harness.run([Mode.NONE] * 4, seq, learn=False) for seq in (128, 320))
    per_token = given_up.extent // 128

    def figures(costs):
        return [costs.figures(i, mode, 4, 192 * per_token) for i in range(4) for mode in (Mode.NONE, Mode.CHECKPOINT)]

    costs, before = harness.costs, harness.costs.snapshot()

    def anew(*samples):
        """The figures of a cost model that never asked for any: at `before`, then taught `samples`."""
        other = CostModel(costs.classes, costs.policy, cuda=False)
        other.restore(before)
        for sample in samples:
            other.learn(sample)
        return figures(other)

    figures(costs)  # kept, at the steps learned before the batch
    costs.learn(given_up)
    taught_by_given_up = figures(costs)
    assert taught_by_given_up == anew(given_up)  # what a step teaches is predicted from at once
    costs.restore(before)
    assert figures(costs) == anew()  # the next plan, made before the next step is learned
    costs.learn(next_one)
    assert figures(costs) == anew(next_one) != taught_by_given_up


def test_the_offloads_a_light_step_ran_are_known_again_after_a_batch_given_up_is_put_back():
    """`ran` adds a plan's offloads once while the same plan runs; a put-back (`restore`) forgets the
    ones added since, and the same plan run again adds them back."""
    costs = CostModel(["Layer"] * 3, load_policy("balanced"), cuda=False)
    before = costs.snapshot()
    plan = (Mode.NONE, Mode.OFFLOAD, Mode.CHECKPOINT | Mode.OFFLOAD)
    costs.ran(plan)
    costs.ran(plan)
    assert costs.offloaded == {(1, Mode.OFFLOAD), (2, Mode.CHECKPOINT | Mode.OFFLOAD)}
    costs.restore(before)
    assert costs.offloaded == set()
    costs.ran(plan)
    assert costs.offloaded == {(1, Mode.OFFLOAD), (2, Mode.CHECKPOINT | Mode.OFFLOAD)}
