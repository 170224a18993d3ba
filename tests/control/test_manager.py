"""The adaptive loop, end to end on the CPU stand-in: budgets kept, OOMs survived exactly."""

import copy
import threading

import pytest
import torch
from helpers import TickingProbe, hf_batch, llama, tiny, tiny_batch

import adaptmem
from adaptmem import Mode, StepOutOfMemoryError, read_log
from adaptmem.config.policy import load_policy
from adaptmem.modes import LADDER
from adaptmem.testing import SimulatedDevice, measure_peak

MiB = 2**20


def models():
    return {
        "tiny": (lambda: tiny(dim=128, n_layers=6, vocab_size=512), lambda m, seq=256: tiny_batch(m, batch=4, seq=seq)),
        "hf-llama": (lambda: llama(layers=6, hidden=256), lambda m, seq=512: hf_batch(batch=2, seq=seq)),
    }


def uniform_peak(make, make_batch, mode):
    """Peak of a training step with every block in `mode` (after the optimizer state exists)."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_peak(model, lambda: make_batch(model), mode=mode, optimizer=opt, steps=2)


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llama", marks=pytest.mark.slow)])
def test_peak_stays_within_budget_after_the_first_step(name):
    make, make_batch = models()[name]
    low = uniform_peak(make, make_batch, Mode.CHECKPOINT)
    high = uniform_peak(make, make_batch, Mode.NONE)
    for fraction in (0.3, 0.7):
        budget = int(low + fraction * (high - low))
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        truth = SimulatedDevice()  # measures independently of the manager's own device
        device = SimulatedDevice(capacity_bytes=2 * high)
        truth.track(model)
        device.track(model)
        peaks = []
        with truth, device, adaptmem.manage(model, budget=budget, device=device) as mem:
            for _ in range(8):
                truth.reset_peak()
                with mem.step():
                    model(**make_batch(model)).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                peaks.append(truth.peak_bytes)
            summary = mem.summary()
        assert max(peaks[1:]) <= budget, (fraction, [p / budget for p in peaks])
        assert summary["steps"] == 8 and summary["ooms"] == 0
        assert summary["prediction_error_last"] is not None and abs(summary["prediction_error_last"]) < 0.05


def test_first_step_fits_when_every_block_checkpointed_fits():
    make, make_batch = models()["tiny"]
    model = make()
    capacity = int(measure_peak(model, lambda: make_batch(model), mode=Mode.CHECKPOINT) * 1.02)
    tight = SimulatedDevice(capacity_bytes=capacity)
    tight.track(model)
    with tight, adaptmem.manage(model, budget="100%", device=tight) as mem:
        with mem.step():  # an OOM here would fail the test
            model(**make_batch(model)).loss.backward()
        assert set(mem.plan.values()) == {Mode.CHECKPOINT}


def ladder_rank(plan_counts):
    labels = [m.label for m in LADDER]
    return sum(labels.index(label) * n for label, n in plan_counts.items())


@pytest.mark.parametrize(("name", "short"), [pytest.param("tiny", 128, marks=pytest.mark.slow), ("hf-llama", 64)])
def test_varying_lengths_survive_and_the_plan_relaxes_after_the_spike(name, short):
    make, make_batch = models()[name]
    lengths = (short, 4 * short, short, 8 * short)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a device on which the spike (4 x short) needs managing and 8 x short still fits under the tightest plan
    none_spike = measure_peak(model, lambda: make_batch(model, lengths[1]), mode=Mode.NONE)
    tight_longest = min(
        measure_peak(model, lambda: make_batch(model, lengths[3]), mode=m) for m in (Mode.OFFLOAD, Mode.CHECKPOINT)
    )
    capacity = max(int(0.8 * none_spike), int(1.35 * tight_longest))
    assert 0.9 * capacity < none_spike, "the spike's step must need managing for this test to mean anything"
    dev = SimulatedDevice(capacity_bytes=capacity)
    dev.track(model)

    def train(batch):
        model(**batch).loss.backward()

    with dev, adaptmem.manage(model, budget="90%", device=dev) as mem:
        for seq in lengths:
            mem.run_step(train, make_batch(model, seq))  # an unrecovered OOM would raise here
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps = mem.events.of_type("step")
        summary = mem.summary()
    assert [s["seq"] for s in steps] == list(lengths)
    assert summary["steps"] == 4 and summary["ooms"] == summary["ooms_recovered"]
    assert ladder_rank(steps[1]["plan_counts"]) > 0  # the spike was managed
    assert ladder_rank(steps[2]["plan_counts"]) < ladder_rank(steps[1]["plan_counts"])  # and let go after it
    assert ladder_rank(steps[3]["plan_counts"]) > ladder_rank(steps[2]["plan_counts"])
    assert all(s["observed_peak_bytes"] <= capacity for s in steps)


def clean_grads(model, batches):
    """Gradients of a clean run of the batches on a plain copy, from the current RNG state."""
    ref = copy.deepcopy(model)
    adaptmem.restore(ref)
    ref.zero_grad(set_to_none=True)
    rng = torch.get_rng_state()
    for batch in batches:
        ref(**batch).loss.backward()
    torch.set_rng_state(rng)
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def test_an_oom_in_the_loss_heads_backward_is_recorded_as_the_loss_heads():
    """The forward returned and the loss's backward ran out before any block's backward began (the
    logits' gradient): the attempt's phase is the loss head's, not the forward's."""
    model = llama(layers=2, hidden=64, vocab=4096)
    batch = hf_batch(2, 128, 4096)
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    policy = load_policy().model_copy(update={"head": "kept"})
    attempts = []

    def squeezed_after_forward():
        attempts.append(1)
        dev.set_capacity(2**31)
        loss = model(**batch).loss
        if len(attempts) == 1:  # a step measured block by block: no room for the logits' gradient
            dev.set_capacity(dev.allocated_bytes + MiB)
        loss.backward()

    with dev, adaptmem.manage(model, device=dev, policy=policy) as mem:
        mem.run_step(lambda: model(**batch).loss.backward())
        model.zero_grad(set_to_none=True)
        mem.run_step(squeezed_after_forward)
        model.zero_grad(set_to_none=True)
    oom = mem.events.of_type("oom")[-1]
    assert oom["phase"] == "the loss head" and len(attempts) == 2


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llama", marks=pytest.mark.slow)])
def test_injected_ooms_are_recovered_with_exact_gradients(name):
    make, make_batch = models()[name]
    model = make()
    batches = [make_batch(model) for _ in range(3)]
    policy = load_policy().model_copy(update={"sample_interval_s": 30.0})  # the OOM must come first

    def train(batch):
        model(**batch).loss.backward()

    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dev, adaptmem.manage(model, budget=2**31, device=dev, policy=policy) as mem:
        for _ in range(3):
            mem.run_step(train, batches[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert set(mem.plan.values()) == {Mode.NONE}
        # one step: the device shrinks under the plan
        expected = clean_grads(model, [batches[1]])
        dev.set_capacity(dev.allocated_bytes + (40 if name == "tiny" else 120) * MiB)
        mem.run_step(train, batches[1])
        assert mem.summary()["ooms_recovered"] >= 1
        assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
        # accumulation over micro-batches: the second runs out of memory in the middle of its
        # backward, after the head and the last blocks have added into the existing gradients
        opt.zero_grad(set_to_none=True)
        dev.set_capacity(2**31)
        expected = clean_grads(model, [batches[0], batches[2]])
        mem.run_step(train, batches[0])
        before = mem.summary()["ooms_recovered"]
        blocks = mem.handles
        attempts = []

        def squeeze_in_backward(module, args, output):
            out = output if isinstance(output, torch.Tensor) else output[0]
            out.register_hook(lambda grad: dev.set_capacity(dev.allocated_bytes + MiB))

        def train_squeezed(batch):
            attempts.append(1)
            dev.set_capacity(2**31)
            hook = blocks[3].module.register_forward_hook(squeeze_in_backward) if len(attempts) == 1 else None
            try:
                model(**batch).loss.backward()
            finally:
                if hook is not None:
                    hook.remove()

        mem.run_step(train_squeezed, batches[2])
        assert len(attempts) >= 2 and mem.summary()["ooms_recovered"] > before
        assert mem.events.of_type("oom")[-1]["phase"] == "backward"
        if mem.last_step["head"] in (None, "KEPT"):  # lossless modes only: bit for bit
            assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())
        else:  # the squeezed budget had the retry chunk the loss head too: the order of summation changes
            assert all(torch.allclose(p.grad, expected[n], rtol=1e-5, atol=1e-7) for n, p in model.named_parameters())


@pytest.mark.parametrize("policy", ["balanced", "max-savings"])
def test_a_batch_failing_from_its_first_step_names_each_plan_with_its_head_and_advises_only_what_helps(policy):
    """The first step's calibration plan has no prediction and is said to have none (not "0 B"); an
    attempt names its loss head where it had one, so two attempts of the same blocks read apart; and
    compression is advised only to a policy that does not allow it already, where no attempt kept
    every block's saved tensors off the device (an offload holds less than compression)."""
    model = tiny()
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=2**31, device=dev, head="head", policy=policy) as mem:
        hook = model.blocks[1].register_forward_pre_hook(lambda m, a: dev.set_capacity(dev.allocated_bytes + MiB))
        with pytest.raises(StepOutOfMemoryError) as err:
            mem.run_step(lambda: model(**tiny_batch(model)).loss.backward())
        hook.remove()
    attempts, lines = err.value.attempts, str(err.value).splitlines()
    assert attempts[0]["predicted_peak_bytes"] == 0
    # (given up after its retries, or refused where the next retry's plan is predicted over the device)
    (first,) = [x for x in lines if x.startswith("  attempt 1:")]
    assert first.startswith("  attempt 1: 4 x CHECKPOINT; head KEPT; not predicted (calibration) "), first
    for i, a in enumerate(attempts[1:], 2):
        (line,) = [x for x in lines if x.startswith(f"  attempt {i}:")]
        assert f"; head {a['head']}; predicted peak " in line and a["head"] is not None, line
    # (balanced: its retries ran every block offloaded, which holds less than compression would)
    assert "allow more modes" not in lines[-1], lines[-1]


def test_the_advice_after_every_retry_failed_names_only_what_could_help():
    """Compression is advised only to a policy without it, where no attempt kept every block's saved
    tensors off the device; where every attempt ran out in the loss head, the tokens a batch are."""
    from adaptmem.control.retry import BEFORE_BLOCKS, oom_report

    def attempts(phase, *plans):
        common = {"message": "out of memory", "head": "KEPT", "predicted_peak_bytes": MiB, "budget_bytes": 2 * MiB}
        return [{**common, "phase": phase, "plan_counts": p, "headroom": 0.9} for p in plans]

    checkpointed = attempts("forward", {"CHECKPOINT": 4}, {"CHECKPOINT": 2, "SELECTIVE": 2})
    offloaded = attempts("backward", {"CHECKPOINT": 4}, {"OFFLOAD": 2, "CHECKPOINT+OFFLOAD": 2})
    head = attempts("the loss head", {"CHECKPOINT": 4}, {"OFFLOAD": 4})
    assert "allow more modes (policy 'max-savings' adds compression)" in oom_report(checkpointed, 3)
    assert "allow more modes" not in oom_report(checkpointed, 3, compression_allowed=True)
    assert "allow more modes" not in oom_report(offloaded, 3)
    last = oom_report(head, 3).splitlines()[-1]
    assert last.startswith("Every attempt ran out in the loss head or the loss"), last
    assert "lower the tokens a batch" in last, last
    # the errors came from the device: a larger budget would only have the plans aim higher
    for report in (oom_report(checkpointed, 3), oom_report(head, 3), oom_report(attempts(BEFORE_BLOCKS, {}), 3)):
        advice = report.splitlines()[-1]
        assert "make room on the device" in advice and "budget" not in advice, advice


def test_retries_are_bounded_and_report_every_plan_tried():
    make, make_batch = models()["tiny"]
    model = make()
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=2**31, device=dev) as mem:
        mem.run_step(lambda: model(**make_batch(model)).loss.backward())

        def squeeze_at_block_1(module, args):
            dev.set_capacity(dev.allocated_bytes + MiB)  # from here on nothing fits

        hook = model.blocks[1].register_forward_pre_hook(squeeze_at_block_1)
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        with pytest.raises(StepOutOfMemoryError) as err:
            mem.run_step(lambda: model(**make_batch(model)).loss.backward())
        hook.remove()
        dev.set_capacity(dev.allocated_bytes + MiB // 4)  # now even the embedding fails
        with pytest.raises(StepOutOfMemoryError) as before_blocks:
            mem.run_step(lambda: model(**make_batch(model)).loss.backward())
    attempts = err.value.attempts
    assert 1 <= len(attempts) <= mem.policy.max_retries + 1
    plans = [tuple(sorted(a["plan_counts"].items())) for a in attempts]
    assert all(plans) and len(set(plans)) == len(plans), "a plan that failed was tried again"
    # each retry is predicted lower than every plan that failed before it: the retries retreat
    peaks = [a["predicted_peak_bytes"] for a in attempts]
    assert all(later < min(peaks[:i]) for i, later in enumerate(peaks[1:], 1)), peaks
    # no mode saves memory before the blocks: a second attempt that finds no more room gives the batch
    # up, and the error lists both (it listed the last alone, the batch taken as new at each attempt)
    assert [a["phase"] for a in before_blocks.value.attempts] == ["before the first managed block"] * 2
    advice = str(before_blocks.value)  # and no mode is advised
    assert "ran out of memory 2 time(s)" in advice and "ran out before the first managed block ran" in advice
    assert "attempt 2: " in advice and "out of memory before the first managed block: " in advice, advice
    assert "allow more modes" not in advice and " in before " not in advice and "calibration" not in advice
    text = str(err.value)
    assert f"attempt {len(attempts)}:" in text and "lower the batch size" in text.lower()
    if len(attempts) <= mem.policy.max_retries:  # given up before the retries ran out: it says why
        why = ("no plan was predicted lower", "the plan a retry would run is predicted over the device")
        assert any(w in text for w in why) and "floor" in text
    assert isinstance(err.value, torch.OutOfMemoryError)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())  # as before the step


def test_other_exceptions_pass_through_untouched():
    make, make_batch = models()["tiny"]
    model = make()
    boom = KeyError("mine")

    def fails():
        model(**make_batch(model)).loss.backward()
        raise boom

    with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        with pytest.raises(KeyError) as err:
            mem.run_step(fails)
        assert err.value is boom
        assert mem.summary()["ooms"] == 0
        assert all(p.grad is not None for p in model.blocks.parameters())


def test_without_snapshots_an_inexact_retry_is_an_error():
    make, make_batch = models()["tiny"]
    model = make()
    policy = load_policy().model_copy(update={"accumulation_snapshot": "off", "sample_interval_s": 30.0})
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)

    def squeeze_in_backward(module, args, output):
        output.register_hook(lambda grad: dev.set_capacity(dev.allocated_bytes + MiB))

    with dev, adaptmem.manage(model, budget=2**31, device=dev, policy=policy) as mem:
        mem.run_step(lambda: model(**make_batch(model)).loss.backward())  # micro-batch 1
        hook = model.blocks[3].register_forward_hook(squeeze_in_backward)
        with pytest.raises(adaptmem.InexactRetryError, match="cannot be retried exactly"):
            mem.run_step(lambda: model(**make_batch(model)).loss.backward())  # micro-batch 2
        hook.remove()


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llama", marks=pytest.mark.slow)])
def test_the_daemon_tightens_blocks_not_yet_run_when_others_take_memory(name):
    make, make_batch = models()[name]
    model = make()
    batch = make_batch(model)
    unmanaged = measure_peak(model, lambda: batch)
    dev = SimulatedDevice(capacity_bytes=int(unmanaged * 2.8))  # room for every block NONE
    dev.track(model)
    seen = {}
    with dev, adaptmem.manage(model, budget="90%", device=dev) as mem:
        for _ in range(3):
            with mem.step():
                model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        before = [h.mode for h in mem.handles]
        assert before == [Mode.NONE] * 6

        def squeeze(module, args):  # another process takes memory while block 2 is about to run
            dev.occupy(int(unmanaged * 1.9))
            mem.sampler.wait_ticks(1)  # a whole tick after the squeeze, however loaded the machine
            seen["modes"] = [h.mode for h in mem.handles]

        hook = mem.handles[2].module.register_forward_pre_hook(squeeze)
        with mem.step():
            model(**batch).loss.backward()
        hook.remove()
        step = mem.events.of_type("step")[-1]
        pressure = mem.events.of_type("pressure")
    assert mem.pressure_events == 1
    assert seen["modes"][:2] == [Mode.NONE, Mode.NONE]  # already ran: untouched
    assert any(m is not Mode.NONE for m in seen["modes"][2:])  # not yet run: tighter
    assert pressure[0]["budget_bytes"] < pressure[0]["budget_bytes_before"]
    assert step["observed_peak_bytes"] <= pressure[0]["budget_bytes"]


def test_a_failing_sampler_tick_is_logged_and_sampling_goes_on(caplog):
    make, make_batch = models()["tiny"]
    model = make()
    dev = SimulatedDevice(capacity_bytes=2**31)
    policy = load_policy().model_copy(update={"sample_interval_s": 0.01})
    with adaptmem.manage(model, budget="1GiB", device=dev, policy=policy) as mem:
        calls = {"n": 0}
        real = mem.probe.external

        def flaky():
            calls["n"] += 1
            if calls["n"] % 2:
                raise RuntimeError("driver hiccup")
            return real()

        mem.probe.external = flaky
        sampler = mem.sampler
        assert sampler.wait_ticks(5)
        assert sampler.errors >= 2 and sampler.ticks >= 5 and sampler.is_alive()
    assert not sampler.is_alive()
    assert "background sampler error" in caplog.text


def test_exit_restores_the_model_and_stops_the_thread_even_on_error():
    make, make_batch = models()["tiny"]
    model = make()
    with pytest.raises(ZeroDivisionError):
        with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
            with mem.step():
                model(**make_batch(model)).loss.backward()
            1 / 0  # noqa: B018 - the body raises
    assert adaptmem.get_handles(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not mem.sampler.is_alive()
    assert not any(t.name == "adaptmem-sampler" for t in threading.enumerate())


@pytest.mark.parametrize("name", ["tiny", pytest.param("hf-llama", marks=pytest.mark.slow)])
def test_resumed_manager_starts_with_the_same_plan(tmp_path, name):
    make, make_batch = models()[name]
    model = make()
    low = measure_peak(model, lambda: make_batch(model), mode=Mode.CHECKPOINT)
    high = measure_peak(model, lambda: make_batch(model), mode=Mode.NONE)
    budget = int(low + 0.5 * (high - low))  # a plan that mixes modes
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for _ in range(4):
            with mem.step():
                model(**make_batch(model)).loss.backward()
            model.zero_grad(set_to_none=True)
        saved_plan = mem.plan
        state = mem.state_dict()
        with mem.step():  # what the uninterrupted run does next: the resumed one must do the same
            model(**make_batch(model)).loss.backward()
        model.zero_grad(set_to_none=True)
        expected_next = mem.events.of_type("step")[-1]["plan_counts"]
    assert set(saved_plan.values()) != {Mode.CHECKPOINT}  # not the plan a fresh manager starts with
    torch.save(state, tmp_path / "mem.pt")
    resumed = copy.deepcopy(model)
    dev2 = SimulatedDevice(capacity_bytes=2**31)
    dev2.track(resumed)
    with dev2, adaptmem.manage(resumed, budget=budget, device=dev2) as mem2:
        mem2.load_state_dict(torch.load(tmp_path / "mem.pt", weights_only=False))
        assert mem2.plan == saved_plan
        with mem2.step():
            resumed(**make_batch(resumed)).loss.backward()
        first = mem2.events.of_type("step")[0]
        assert first["plan_counts"] == expected_next
        assert first["predicted_peak_bytes"] is not None  # no calibration step: the model was resumed
    with adaptmem.manage(tiny(n_layers=2), budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem3:
        with pytest.raises(ValueError, match="resume with the same model and block selection"):
            mem3.load_state_dict(state)


def _resumable_run(lengths: list[int], budget: int, saved: bytes | None = None) -> tuple[list[dict], bytes]:
    """Steps of a Llama with AdamW at these lengths on the stand-in, timed on a ticking clock (the
    same plans in every run); from `saved` (weights, optimizer, manager) where given. Returns each
    step's record and the state at the end, saved."""
    import io

    from adaptmem.integrations.stand_in import count_loaded

    model = llama(layers=4, hidden=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if saved is not None:
        weights, opt_state, mem_state = torch.load(io.BytesIO(saved), weights_only=False)
        model.load_state_dict(weights)
        opt.load_state_dict(opt_state)
    dev = SimulatedDevice(capacity_bytes=budget + 10 * 2**20)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=budget, device=TickingProbe(dev)) as mem:
        if saved is not None:
            count_loaded(dev, opt)  # what a framework's resume does on the stand-in
            mem.load_state_dict(mem_state)
        for n in lengths:
            ids = torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(n))
            mem.run_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out = io.BytesIO()
        torch.save((model.state_dict(), opt.state_dict(), mem.state_dict()), out)
    return mem.events.of_type("step"), out.getvalue()


def test_a_resumed_run_measures_and_predicts_as_the_run_never_interrupted():
    """A step measured block by block teaches the fits, so which steps are measured is part of the
    saved state: resumed midway, every later step is measured (or only its peak read) as in the run
    never stopped, with the same plan, prediction and peak, byte for byte. (Before, each bucket's
    place in its measuring period was lost: a resumed run predicted up to 12% higher.) The optimizer's
    step counts, kept on the host by PyTorch, are not counted as device memory when loaded either."""
    lengths = [int(n) for n in torch.randint(20, 200, (12,), generator=torch.Generator().manual_seed(3))]
    budget = 24 * 2**20
    whole, _ = _resumable_run(lengths, budget)
    _, saved = _resumable_run(lengths[:5], budget)
    resumed, _ = _resumable_run(lengths[5:], budget, saved)
    keys = ("measured", "plan", "head", "predicted_peak_bytes", "observed_peak_bytes")
    after = [{k: r[k] for k in keys} for r in whole[5:]]
    assert {r["measured"] for r in after} == {"blocks", "peak"}  # both kinds of step are compared
    assert [{k: r[k] for k in keys} for r in resumed] == after


def test_scripted_probe_gives_the_exact_decision_sequence():
    """Peaks as fractions of the budget: calm (relax), in band, a spike well after the
    relaxation (escalate, no cap), calm again (each calm step recovers half the headroom the
    spike took, back to where the run started), in band, calm."""
    from adaptmem.testing import ScriptedProbe

    model = tiny(n_layers=3)
    budget = 100 * MiB
    ratios = [0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9, 0.99, 0.5, 0.5, 0.5, 0.9, 0.5, 0.5]
    probe = ScriptedProbe(2 * budget, [int(r * budget) for r in ratios])
    # the watermarks this sequence is written against (0.9 is in band), whatever the defaults
    policy = load_policy().model_copy(update={"calm_steps": 3, "headroom": 0.92, "low_watermark": 0.9})
    with adaptmem.manage(model, budget=budget, device=probe, policy=policy) as mem:
        for _ in ratios:
            with mem.step():
                model(**tiny_batch(model)).loss.backward()
        decisions = [e["decision"] for e in mem.events.of_type("step")]
    assert decisions == [
        "hold",
        "hold",
        "relax",
        "hold",
        "hold",
        "hold",
        "hold",
        "escalate",
        "recover",
        "recover",
        "recover",
        "hold",
        "recover",
        "hold",
    ]
    assert mem.headroom == pytest.approx(0.92)


def test_scripted_probe_shows_no_flip_flop():
    from adaptmem.testing import ScriptedProbe

    model = tiny(n_layers=3)
    budget = 100 * MiB
    holder = {}
    policy = load_policy().model_copy(update={"calm_steps": 2})
    start = policy.headroom
    # the load is over the high watermark whenever the plan aims above where it started
    probe = ScriptedProbe(2 * budget, lambda step: int((0.99 if holder["mem"].headroom > start else 0.7) * budget))
    with adaptmem.manage(model, budget=budget, device=probe, policy=policy) as mem:
        holder["mem"] = mem
        for _ in range(40):
            with mem.step():
                model(**tiny_batch(model)).loss.backward()
        decisions = [e["decision"] for e in mem.events.of_type("step")]
    # the escalation's headroom recovers, up to the ceiling the undone relaxation set: where it began
    assert decisions[:4] == ["hold", "relax", "escalate", "recover"]
    assert decisions.count("escalate") == 1
    assert decisions[-15:] == ["hold"] * 15


def test_event_log_is_jsonl_with_steps_plans_and_ooms(tmp_path):
    make, make_batch = models()["tiny"]
    model = make()
    path = tmp_path / "run.jsonl"
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    attempts = []

    def squeezed_once():  # the first attempt runs out of memory after block 0, the retry does not
        attempts.append(1)
        dev.set_capacity(2**31)
        hook = None
        if len(attempts) == 1:
            hook = model.blocks[1].register_forward_pre_hook(lambda m, a: dev.set_capacity(dev.allocated_bytes + MiB))
        try:
            model(**make_batch(model)).loss.backward()
        finally:
            if hook is not None:
                hook.remove()

    with dev, adaptmem.manage(model, budget=2**31, device=dev, log=str(path)) as mem:
        for seq in (64, 256):
            mem.run_step(lambda s=seq: model(**make_batch(model, s)).loss.backward())
        mem.run_step(squeezed_once)
        mem.sampler.wait_ticks(1)
        assert path.stat().st_size > 0  # written by the background thread before the end
    records = read_log(path)
    kinds = [r["type"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert {"plan", "step", "oom"} <= set(kinds)
    step = next(r for r in records if r["type"] == "step" and r["step"] == 2)
    for key in (
        "step",
        "tokens",
        "seq",
        "batch",
        "predicted_peak_bytes",
        "observed_peak_bytes",
        "budget_bytes",
        "prediction_error",
        "decision",
        "plan_counts",
        "attempt",
        "time",
    ):
        assert key in step
    plan = next(r for r in records if r["type"] == "plan")
    assert set(plan["plan"]) == {f"blocks.{i}" for i in range(6)} and plan["reason"]
    oom = next(r for r in records if r["type"] == "oom")
    assert oom["phase"] in ("forward", "backward") and "out of memory" in oom["message"]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("every-2", ["NONE", "CHECKPOINT"] * 4),
        # round(sqrt(8)) = 3: every third block
        ("sqrt-n", ["NONE", "NONE", "CHECKPOINT", "NONE", "NONE", "CHECKPOINT", "NONE", "NONE"]),
    ],
)
def test_static_policies(name, expected):
    model = tiny(n_layers=8)
    with adaptmem.manage(model, policy=name, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        for _ in range(2):
            with mem.step():
                model(**tiny_batch(model)).loss.backward()
        assert [m.label for m in mem.plan.values()] == expected
        assert mem.summary()["decisions"] == {"hold": 2}


def test_offload_stays_under_the_host_ceiling():
    make, make_batch = models()["tiny"]
    model = make()
    policy = load_policy().model_copy(update={"modes": ("NONE", "OFFLOAD")})
    low = uniform_peak(make, make_batch, Mode.OFFLOAD)
    dev = SimulatedDevice(capacity_bytes=2**31, host_capacity_bytes=50 * MiB)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=int(low * 1.5), device=dev, policy=policy) as mem:
        for i in range(4):
            if i == 1:  # after the calibration step (every block OFFLOAD: nothing is known yet)
                dev.reset_peak()
            with mem.step():
                model(**make_batch(model)).loss.backward()
            model.zero_grad(set_to_none=True)
        assert dev.host_peak_bytes <= 0.5 * 50 * MiB * 1.05
        assert Mode.NONE in mem.plan.values()


def test_bad_input_is_explained():
    model = tiny()
    dev = SimulatedDevice(capacity_bytes=2**30)
    with pytest.raises(ValueError, match="larger than the device"):
        adaptmem.manage(model, budget="4GiB", device=dev).__enter__()
    assert adaptmem.get_handles(model) == []
    with pytest.raises(ValueError, match="no blocks matched blocks='Nope'"):
        adaptmem.manage(model, blocks="Nope", budget="1GiB", device=dev).__enter__()
    with adaptmem.manage(model, budget="1GiB", device=dev):
        with pytest.raises(RuntimeError, match="already managed"):
            adaptmem.manage(model, budget="1GiB", device=dev).__enter__()


def test_allocator_retries_escalate_even_under_the_watermark():
    """The CUDA allocator retrying (freeing its cache to satisfy a request) is pressure
    before an OOM: the step escalates though its peak is in band."""
    from adaptmem.testing import ScriptedProbe

    model = tiny(n_layers=3)
    budget = 100 * MiB
    probe = ScriptedProbe(2 * budget, [int(0.9 * budget)], retries=[0, 0, 0, 2, 2, 2])
    with adaptmem.manage(model, budget=budget, device=probe) as mem:
        for _ in range(6):
            with mem.step():
                model(**tiny_batch(model)).loss.backward()
        steps = mem.events.of_type("step")
    # no further retries: the steps after are calm, and the headroom recovers
    assert [s["decision"] for s in steps] == ["hold", "hold", "hold", "escalate", "recover", "recover"]
    assert [s["alloc_retries"] for s in steps] == [0, 0, 0, 2, 2, 2]


def _kept_peak(model, batch, mode=None):
    """Peak of a micro-step that finds the weights' gradients of the one before kept."""
    if mode is not None:
        for handle in adaptmem.instrument(model):
            handle.mode = mode
    dev = SimulatedDevice()
    dev.track(model)
    with dev:
        model(**batch).loss.backward()
        dev.reset_peak()
        model(**batch).loss.backward()
    return dev.peak_bytes


def test_an_accumulating_loop_keeps_a_plan_per_kind_of_micro_step_and_measures_only_now_and_then():
    """Two micro-batches per optimizer step: the second starts with the weights' gradients kept.
    Each kind of step is predicted as learned and keeps a plan of its own, so both hold and
    steady steps are light (predicted as the mean of both, they missed by 12% and half were
    measured), and the first micro-step fills the budget too (run on the plan made for the
    second, it peaked at 66% of the budget)."""
    make = lambda: tiny(dim=128, n_layers=4, vocab_size=2048)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [tiny_batch(model, batch=2, seq=64) for _ in range(2)]
    low, high = _kept_peak(make(), batches[0], Mode.CHECKPOINT), _kept_peak(make(), batches[0])
    budget = int(low + 0.5 * (high - low))
    dev = SimulatedDevice(capacity_bytes=4 * high)
    dev.track(model)
    with dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for _ in range(30):  # (the headroom earned may relax the plans as late as micro-step 30)
            for batch in batches:
                with mem.step():
                    (model(**batch).loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps = mem.events.of_type("step")[-16:]  # the last 8 optimizer steps, the plans settled
        first_settled = steps[0]["step"]
        plans = [p for p in mem.events.of_type("plan") if p["step"] >= first_settled]
    assert sum(s["measured"] == "blocks" for s in steps) <= 2  # every measure_every (10) steps
    # switching between the two kinds' plans applies each cached one, and says so: nothing is remade
    # but after a step that taught something (measured block by block, or the decider moved: a relax
    # from earned headroom lands in this window on a loaded machine), once for each kind
    taught = {s["step"] for s in steps if s["measured"] == "blocks" or s["decision"] != "hold"}
    remade = [p["step"] for p in plans if p["reason"] != "cached"]
    assert plans and all({step - 1, step - 2} & taught for step in remade), (remade, taught)
    assert len(remade) <= 2 * len(taught) and len(remade) < len(plans) / 2, (remade, taught)
    assert all(abs(s["prediction_error"]) < mem.policy.replan_tolerance for s in steps)
    first, second = steps[0::2], steps[1::2]
    assert len({tuple(s["plan"]) for s in first}) == 1 and len({tuple(s["plan"]) for s in second}) == 1
    assert all(s["observed_peak_bytes"] <= budget for s in steps)
    assert min(s["observed_peak_bytes"] for s in first) >= 0.75 * budget


def test_a_budget_no_micro_step_fits_is_warned_of_once_not_once_per_kind_of_micro_step(caplog):
    """Accumulating micro-steps keep a plan per gradient state, but a budget under the tightest plan
    is one thing to fix: it is warned of once (once more where the first warning was extrapolated),
    not for each kind of micro-step."""
    make = lambda: tiny(dim=128, n_layers=4, vocab_size=2048)
    model = make()
    batches = [tiny_batch(model, batch=2, seq=64) for _ in range(2)]
    budget = int(0.8 * _kept_peak(make(), batches[0], Mode.CHECKPOINT | Mode.OFFLOAD))
    dev = SimulatedDevice()
    dev.track(model)
    with dev, adaptmem.manage(model, budget=budget, device=dev) as mem, caplog.at_level("WARNING", logger="adaptmem"):
        for _ in range(6):
            for batch in batches:
                with mem.step():
                    (model(**batch).loss / 2).backward()
            model.zero_grad(set_to_none=True)
        assert {key[2] for key in mem._controller.plans.cache} == {False, True}  # a plan for each kind
    warned = [r.getMessage() for r in caplog.records if "no plan is predicted to fit" in r.getMessage()]
    assert len([w for w in warned if "lower the batch or input size" in w]) == 1
    assert warned and all("for batch 2 x up to 64 tokens each" in w for w in warned)  # a token model's size


def test_a_stand_in_never_entered_during_a_step_is_warned_of_once(caplog):
    """A SimulatedDevice counts only while entered: steps run outside it read a flat peak, and
    a user (a Trainer run without `with dev:`) would get plans made on figures of nothing."""
    model = tiny(dim=64, n_layers=3, vocab_size=256)
    batch = tiny_batch(model, batch=2, seq=32)
    for entered in (False, True):
        caplog.clear()
        dev = SimulatedDevice(capacity_bytes=2**30)
        dev.track(model)
        with caplog.at_level("WARNING", logger="adaptmem"), adaptmem.manage(model, budget="50%", device=dev) as mem:
            for _ in range(3):
                if entered:
                    with dev:
                        mem.run_step(lambda: model(**batch).loss.backward())
                else:
                    mem.run_step(lambda: model(**batch).loss.backward())
                model.zero_grad(set_to_none=True)
        warned = [r for r in caplog.records if "was not entered" in r.getMessage()]
        assert len(warned) == (0 if entered else 1)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert (mem.summary()["peak_bytes"] > weights) == entered  # outside it, a step counts nothing new


def test_a_resumed_manager_keeps_its_own_budget_and_a_saved_squeeze():
    """A state saved under a budget the user set (`set_budget`) does not override the budget the
    new manager is given: it ran 9 steps at the old 60% where it was given 90%. A state saved
    while others' memory held the budget under the user's resumes held so (never above the new
    user budget), and is given back once they let go."""
    model = tiny()
    dev = SimulatedDevice(capacity_bytes=256 * MiB)
    dev.track(model)
    policy = load_policy().model_copy(update={"calm_steps": 2})

    def steps(mem, n):
        for _ in range(n):
            mem.run_step(lambda: model(**tiny_batch(model)).loss.backward())
            model.zero_grad(set_to_none=True)

    with dev:
        with adaptmem.manage(model, budget="90%", device=dev, policy=policy) as mem:
            steps(mem, 2)
            mem.set_budget("60%")
            steps(mem, 1)
            assert mem.budget == mem.user_budget == int(0.6 * 256 * MiB)
            own = mem.state_dict()
            dev.occupy(140 * MiB)
            mem.sampler.wait_ticks(2)
            steps(mem, 1)
            squeezed = mem.state_dict()
            assert mem.budget < mem.user_budget
        with adaptmem.MemoryManager(model, budget="90%", device=dev, policy=policy, state=own) as mem2:
            assert mem2.budget == mem2.user_budget == int(0.9 * 256 * MiB)
        with adaptmem.MemoryManager(model, budget="90%", device=dev, policy=policy, state=squeezed) as mem3:
            assert mem3.budget == squeezed["budget"] < mem3.user_budget
            dev.occupy(-140 * MiB)
            mem3.sampler.wait_ticks(2)
            steps(mem3, 4)
            assert mem3.budget == mem3.user_budget
