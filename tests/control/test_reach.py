"""How long can I go? `longest_sequence` and `largest_batch`, after calibration."""

import json

import pytest
import torch
from helpers import TickingProbe, hf_batch, llama

import adaptmem
from adaptmem.control.reach import position_limit
from adaptmem.testing import SimulatedDevice

MiB = 2**20


def _calibrated(model, make_batch, lengths, capacity, **kw):
    """A manager that has run a few AdamW steps at `lengths` on a stand-in of `capacity` bytes."""
    dev = SimulatedDevice(capacity)
    dev.track(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mem = adaptmem.manage(model, device=dev, **kw)
    with dev:
        for seq in lengths:
            mem.run_step(lambda: model(**make_batch(seq)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
    return mem, dev, opt


def test_the_longest_sequence_is_where_the_tightest_plan_stops_fitting():
    model = llama(layers=3, hidden=64, dropout=0.0)
    mem, _, _ = _calibrated(model, lambda s: hf_batch(1, s), [64, 128, 64, 128], 48 * MiB)
    with mem:
        reach = mem.longest_sequence()
        assert reach.batch == 1 and reach.length > 128
        assert reach.start_bytes <= reach.peak_bytes <= reach.limit_bytes
        assert reach.extrapolated and reach.measured_length == 128
        assert len(reach.plan) == 3 and reach.head is not None  # the head is a row of the plan
        # the boundary: one token more fits no plan, so not one sample of it fits
        assert mem.largest_batch(reach.length).batch == 1
        none = mem.largest_batch(reach.length + 1)
        assert none.batch == 0 and none.plan == ()
        # said as such, not as a batch of 0 under an empty plan
        assert str(none).startswith(f"nothing fits: not even one sample of {reach.length + 1:,} tokens")
        # less room, shorter; half the length, at least twice the batch
        assert mem.longest_sequence(limit=reach.limit_bytes - 4 * MiB).length < reach.length
        assert mem.largest_batch(reach.length // 2).batch >= 2
        assert mem.longest_sequence(2).length < reach.length
        assert "tokens" in str(reach) and "extrapolated" in str(reach)
        # samples no longer than those measured, but more tokens in the batch than a step had
        wide = mem.largest_batch(64)
        assert wide.batch * 64 > 128 and wide.extrapolated and wide.measured_tokens == 128
        assert "at most 128 tokens a sample, 128 a batch" in str(wide)


def test_a_kept_head_reaches_less_far_than_one_chunked_when_needed():
    """The head's rows are part of the search: a policy that never chunks it stops where the
    logits stop fitting."""
    lengths, make = [64, 128, 64, 128], lambda s: hf_batch(1, s, vocab=8192)
    mem, _, _ = _calibrated(llama(layers=3, hidden=64, dropout=0.0, vocab=8192), make, lengths, 64 * MiB)
    kept_policy = adaptmem.load_policy().model_copy(update={"head": "kept"})
    kept, _, _ = _calibrated(
        llama(layers=3, hidden=64, dropout=0.0, vocab=8192), make, lengths, 64 * MiB, policy=kept_policy
    )
    with mem, kept:
        chunked, whole = mem.longest_sequence(), kept.longest_sequence()
        assert whole.head == "KEPT" and chunked.head.startswith("CHUNKED")
        assert chunked.length > 2 * whole.length


def test_a_length_that_trained_is_answered_however_the_figures_predict_it():
    """A step that ran to its end within the limit, measured block by block or only its peak read, is
    evidence the figures do not overrule: asked with that peak as the limit, where the figures predict
    the step's own plan over it, the answer is the length that trained, its plan and its peak, read."""
    model = llama(layers=4, hidden=128)
    dev = SimulatedDevice(60 * MiB)
    dev.track(model)
    only_none = adaptmem.load_policy().model_copy(update={"modes": ("NONE",), "head": "kept"})  # one plan
    with dev, adaptmem.manage(model, budget=50 * MiB, device=TickingProbe(dev), policy=only_none) as mem:
        for n in (
            64,
            170,
            96,
            170,
            100,
            200,
        ):  # the last at a new length, within a quarter past 170: only its peak read
            ids = torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(n))
            mem.run_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
            model.zero_grad(set_to_none=True)
        step = mem.last_step
        assert step["measured"] == "peak" and step["predicted_peak_bytes"] > step["observed_peak_bytes"]
        reach = mem.longest_sequence(batch=2, limit=step["observed_peak_bytes"])
        assert reach.length >= 200 and reach.trained and not reach.extrapolated  # (197 before)
        if reach.length == 200:
            assert reach.peak_bytes == step["observed_peak_bytes"] and set(reach.plan) == {adaptmem.Mode.NONE}
            assert "a step this large trained at a peak of" in str(reach)
        assert mem.longest_sequence(batch=3, limit=step["observed_peak_bytes"]).length < 200  # not for more samples
        # a batch of 210 given up afterwards rules out lengths from 90% of it on that did not train since,
        # not one that trained within the limit before it (the answer read 188); nor 210 itself
        from adaptmem.control.reach import GivenUp

        mem._controller.given_up.append(GivenUp(batch=2, length=210, room=None))
        near = mem.longest_sequence(batch=2, limit=step["observed_peak_bytes"])
        assert 200 <= near.length < 210 and near.trained, near


def test_the_predicted_length_trains():
    """A step at the predicted longest length, continuing the run, does not run out of memory
    (a Llama, whose attention holds nothing quadratic: extrapolated linearly, 4x past the lengths run)."""
    model = llama(layers=3, hidden=64, dropout=0.0, vocab=8192)
    make = lambda s: hf_batch(1, s, vocab=8192)
    mem, dev, opt = _calibrated(model, make, [64, 128, 64, 128], 48 * MiB)
    with mem, dev:
        reach = mem.longest_sequence()
        assert reach.length > 4 * 128
        for _ in range(2):
            mem.run_step(lambda: model(**make(reach.length)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert mem.summary()["ooms"] == 0
        assert mem.last_step["observed_peak_bytes"] <= dev.capacity_bytes


def test_a_loop_that_zeroes_gradients_inside_its_step_is_answered_for_the_steps_it_runs():
    """Lightning's closure zeroes the gradients between forward and backward: every step after the
    first starts with the last one's. Only those steps are asked (the first, with no gradients and
    no optimizer state yet, does not come again, and its figures from one length, scaled with the
    tokens, stopped the answer at 208 tokens where 2 x 826 trained), and the gradients allocated
    now are not counted twice. Steps at the length predicted train."""
    model = llama(layers=3, hidden=64, dropout=0.0, vocab=8192)
    make = lambda s: hf_batch(1, s, vocab=8192)
    dev = SimulatedDevice(48 * MiB)
    dev.track(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def closure(seq):
        loss = model(**make(seq)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()

    with dev, adaptmem.manage(model, device=dev) as mem:
        for seq in (64, 128, 64, 128, 96, 128):
            mem.run_step(closure, seq)
            opt.step()
        assert [resident for resident, _ in mem._controller.reacher(None).starts] == [True]
        reach = mem.longest_sequence()
        assert reach.length > 4 * 128
        for _ in range(2):
            mem.run_step(closure, reach.length)
            opt.step()
        assert mem.summary()["ooms"] == 0
        assert mem.last_step["observed_peak_bytes"] <= dev.capacity_bytes


def _accumulating(capacity=96 * MiB, vocab=8192):
    """A Llama (4 layers, its embedding most of its weights) on a stand-in, a manager, AdamW, and a
    step of two micro-batches of 4 (`step(seq)`, or of `batch=`); the step's peaks go to `peaks`."""
    model = llama(layers=4, hidden=64, dropout=0.0, vocab=vocab)
    dev = SimulatedDevice(capacity)
    dev.track(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mem = adaptmem.manage(model, device=dev)
    peaks = []

    def step(seq, micro=2, batch=4):
        for _ in range(micro):
            mem.run_step(lambda: model(**hf_batch(batch, seq, vocab=vocab)).loss.backward())
            peaks.append(mem.last_step["observed_peak_bytes"])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, dev, opt, mem, step, peaks


def test_the_predicted_length_trains_when_the_steps_accumulate_gradients():
    """Accumulating two micro-batches a step, the answer holds for both: the first allocates the
    weights' gradients in its backward, the second starts with them. Steps run at the length
    predicted, continuing the run, without running out of memory. (Both failed before: a
    micro-batch's own gradients taken as none when resident taught the blocks' transients two
    ways, and the length predicted ran out of memory in the first micro-batch's backward; a plan
    predicted unfit was kept after the step taught a finer chunk of the head that fits, and the
    next step ran out of memory.)"""
    _, dev, _, mem, step, peaks = _accumulating()
    with dev, mem:
        for seq in (64, 128, 64, 128):
            step(seq)
        reach = mem.longest_sequence(4)
        assert reach.length > 4 * 128 and reach.start_bytes <= reach.peak_bytes <= reach.limit_bytes
        peaks.clear()
        for _ in range(3):
            step(reach.length)
        assert mem.summary()["ooms"] == 0
        assert len(peaks) == 6 and max(peaks) <= dev.capacity_bytes


def test_the_largest_batch_counts_what_runs_before_the_first_block():
    """Far past the batch the run has measured, what runs before the first block (the embeddings'
    output, the position tables, the mask: all growing with the batch) is counted, learned from the
    steps measured, where a step's start holds none of it. Left out, a batch predicted to fit ran
    out of memory in its second micro-batch's backward and was given up. A little under the answer,
    the steps train (an error in the second micro-batch's backward, 20 times past the batch
    measured, is retried)."""
    _, dev, _, mem, step, peaks = _accumulating()
    with dev, mem:
        for seq in (64, 128, 64, 128):
            step(seq)
        reach, lengths = mem.largest_batch(128), mem._controller.lengths
        before = lengths.before.predict(reach.batch, 128 * lengths.width)
        assert reach.batch > 4 and before == pytest.approx(reach.batch / 4 * lengths.before.predict(4, 128 * 64))
        assert reach.start_bytes == lengths.start_resident + int(before)
        peaks.clear()
        for _ in range(2):
            step(128, batch=int(0.95 * reach.batch))  # a little under it, as the README advises
        assert len(peaks) == 4 and max(peaks) <= dev.capacity_bytes
        assert mem.summary()["ooms"] == mem.summary()["ooms_recovered"]


def test_a_run_that_accumulates_is_answered_for_the_micro_batch_that_needs_more():
    """Each state a step starts in has its start (the optimizer's state in both, the gradients in
    the second micro-batch's, learned from light steps too), and the answer is the shorter of the
    two, whichever state the last step planned."""
    model, dev, _, mem, step, _ = _accumulating()
    with dev, mem:
        for seq in (64, 128, 64, 128):
            step(seq)
        step(64, micro=1)  # the last step planned allocates the gradients (and the optimizer drops them)
        lengths, grads = mem._controller.lengths, sum(p.numel() * p.element_size() for p in model.parameters())
        assert lengths.start_resident == lengths.start + grads
        both = mem.longest_sequence(4)
        alone = {}
        for state in mem._controller.reacher(None).starts:
            reacher = mem._controller.reacher(None)
            reacher.starts = [state]
            alone[state[0]] = reacher.longest(4)
        assert alone[True].length < alone[False].length  # here, the second micro-batch needs more
        before = int(lengths.before.predict(4, both.length * lengths.width))  # the embeddings' output, ...
        assert both.length == alone[True].length and both.start_bytes == lengths.start_resident + before > 0


def test_asked_between_micro_batches_the_answer_is_the_one_after_the_step():
    """Between two micro-batches the gradients are allocated; a step that starts without them
    (the next step's first micro-batch) is not predicted to start with them too."""
    model, dev, opt, mem, step, _ = _accumulating()
    with dev, mem:
        for seq in (64, 128, 64, 128):
            step(seq)
        mem.run_step(lambda: model(**hf_batch(4, 64, vocab=8192)).loss.backward())  # one micro-batch
        assert all(p.grad is not None for p in model.parameters())
        between, starts = mem.longest_sequence(4), mem._controller.reacher(None).starts
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = mem.longest_sequence(4)
        assert starts == mem._controller.reacher(None).starts  # (both states' starts, each without the other's)
        assert (between.length, between.start_bytes) == (after.length, after.start_bytes)


def test_asking_before_a_step_or_with_bad_figures_says_what_to_do():
    model = llama(layers=2, hidden=64, dropout=0.0)
    dev = SimulatedDevice(64 * MiB)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev) as mem:
        with pytest.raises(RuntimeError, match="run a training step"):
            mem.longest_sequence()
        mem.run_step(lambda: model(**hf_batch(1, 64)).loss.backward())
        with pytest.raises(ValueError, match="batch must be a positive int"):
            mem.longest_sequence(0)
        with pytest.raises(ValueError, match="length must be a positive int"):
            mem.largest_batch(-5)


def test_an_input_without_a_sequence_dimension_has_no_length():
    from torch import nn

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x))

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(*[Stage() for _ in range(3)]))
    dev = SimulatedDevice(256 * MiB)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev) as mem:
        mem.run_step(lambda: model(torch.randn(2, 3, 16, 16)).sum().backward())
        with pytest.raises(RuntimeError, match="no sequence dimension"):
            mem.longest_sequence()


def test_the_log_ends_with_the_prediction_and_the_report_shows_it(tmp_path):
    model = llama(layers=3, hidden=64, dropout=0.0)
    path = tmp_path / "run.jsonl"
    mem, _, _ = _calibrated(model, lambda s: hf_batch(1, s), [64, 128], 48 * MiB, log=str(path))
    expected = mem.longest_sequence()
    mem.close()
    end = [json.loads(line) for line in path.read_text().splitlines()][-1]
    assert end["type"] == "end" and end["reach"]["length"] == expected.length
    from adaptmem.report import figures, rows

    row = rows(figures([json.loads(line) for line in path.read_text().splitlines()])[0])
    assert row["longest sequence (predicted)"].startswith(f"{expected.length:,} tokens x batch 1")


def test_the_figures_survive_a_resume():
    model = llama(layers=3, hidden=64, dropout=0.0)
    mem, _, _ = _calibrated(model, lambda s: hf_batch(1, s), [64, 128], 48 * MiB)
    state, expected = mem.state_dict(), mem.longest_sequence().length
    mem.close()
    dev = SimulatedDevice(48 * MiB)
    with adaptmem.manage(llama(layers=3, hidden=64, dropout=0.0), device=dev) as again:
        again.load_state_dict(state)
        assert again.longest_sequence().length == expected


def test_memory_given_back_since_a_saved_run_is_not_counted_once_steps_run_again():
    """A saved run's steps started above 16 MiB held beside them (an earlier Trainer's optimizer
    state, dropped between two fits): the resumed run answers as the saved one until its own steps
    start, then from what they start from (it stayed at the saved run's largest start: an answer
    13% shorter than a length that had just trained at 95% of the limit)."""
    model = llama(layers=3, hidden=64, dropout=0.0)
    dev = SimulatedDevice(64 * MiB)
    dev.track(model)
    make = lambda s: hf_batch(1, s)
    with dev:
        held = torch.empty(16 * MiB, dtype=torch.uint8)
        with adaptmem.manage(model, device=dev) as mem:
            for seq in (64, 128, 64, 128):
                mem.run_step(lambda: model(**make(seq)).loss.backward())
                model.zero_grad(set_to_none=True)
            state, before = mem.state_dict(), mem.longest_sequence()
        del held
        with adaptmem.MemoryManager(model, device=dev, state=state) as again:
            assert again.longest_sequence().length == before.length  # no step here yet: the saved run's
            for seq in (64, 128):
                again.run_step(lambda: model(**make(seq)).loss.backward())
                model.zero_grad(set_to_none=True)
            after = again.longest_sequence()
    assert after.start_bytes <= before.start_bytes - 15 * MiB
    assert after.length > before.length


def test_an_answer_past_the_models_positions_says_so():
    """A CodeGen (positions in a table of 2,048) was answered 2,256 tokens at batch 1, and a step of
    3,000 raised the model's own IndexError. An answer past the config's `max_position_embeddings`
    (GPT-2's `n_positions` answers to it) says so; one within it, or for a model whose config names
    none, does not."""
    from helpers import gpt2

    model = gpt2(layers=2, hidden=64, dropout=0.0)
    with SimulatedDevice(2**30) as dev, adaptmem.manage(model, device=dev) as mem:
        for seq in (64, 128):
            mem.run_step(lambda seq=seq: model(**hf_batch(1, seq)).loss.backward())
        far = mem.longest_sequence(1)
        near = mem.longest_sequence(1, limit=dev.allocated_bytes + 8 * 2**20)
    assert far.length > 1024 and far.positions == 1024
    assert "past the model's max_position_embeddings (1,024)" in str(far)
    assert near.length < 1024 and near.positions == 0 and "max_position_embeddings" not in str(near)
    assert position_limit(torch.nn.Linear(2, 2)) == 0 and position_limit(torch.nn.Module()) == 0


def test_a_model_run_at_one_length_is_asked_its_batch_at_that_length(caplog):
    """A CLIP (image and text towers) on images of one size: every step runs its first block (the
    vision tower's) at the patches of one image, 17 tokens, so `largest_batch(16)`, the text's length,
    answers for 16 patches; it says so, once. A batch given up names the largest batch at that
    length, where it named the longest sequence ("at batch 520: 35 tokens")."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=1, eos_token_id=2),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4),
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).train()

    def batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "input_ids": torch.randint(3, 256, (n, 16), generator=g),
            "pixel_values": torch.randn(n, 3, 32, 32, generator=g),
        }

    dev = SimulatedDevice(40 * MiB)
    dev.track(model)
    with caplog.at_level("WARNING", logger="adaptmem"), dev, adaptmem.manage(model, device=dev, budget="90%") as mem:
        for i, n in enumerate((16, 32, 24, 48)):
            mem.run_step(lambda: model(**batch(n, i), return_loss=True).loss.backward())
        assert mem.last_step["seq"] == 17  # 16 patches and the class token
        fits = mem.largest_batch(17).batch
        assert not any("largest_batch(" in r.getMessage() for r in caplog.records)
        mem.largest_batch(16)
        mem.largest_batch(12)
        said = [r.getMessage() for r in caplog.records if "largest_batch(" in r.getMessage()]
        assert len(said) == 1 and "every step so far ran it at 17" in said[0] and "largest_batch(17)" in said[0]
        with pytest.raises(adaptmem.StepOutOfMemoryError) as refused:
            mem.run_step(lambda: model(**batch(2 * fits, 9), return_loss=True).loss.backward())
    assert f"The largest batch predicted to fit at 17 tokens a sample: {fits:,}." in str(refused.value)
    assert "longest sequence predicted" not in str(refused.value)
