"""The planner weighs the loss head like any block: kept while it fits, chunked where the budget needs it."""

from __future__ import annotations

import pytest
import torch
from helpers import TickingProbe

import adaptmem
from adaptmem import HeadMode, Mode
from adaptmem.control.headcosts import KEPT, HeadChoice, HeadCosts
from adaptmem.testing import SimulatedDevice
from tests.strategies.test_head import hf_model

MiB = 2**20


def run(lengths, policy="balanced", budget=96 * MiB, **manage):
    model = hf_model("llama", vocab_size=8000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    records = []
    with (
        SimulatedDevice(capacity_bytes=budget) as dev,
        adaptmem.manage(model, policy=policy, device=dev, budget=budget, **manage) as mem,
    ):
        for i, seq in enumerate(lengths):
            ids = torch.randint(0, 8000, (1, seq), generator=torch.Generator().manual_seed(i))

            def step():
                model(input_ids=ids, labels=ids).loss.backward()

            mem.run_step(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(mem.last_step)
        summary = mem.summary()
    return records, summary


def test_balanced_keeps_the_head_while_it_fits_and_chunks_it_where_the_budget_needs_it():
    # at 2048 tokens one logits tensor is 62.5 MiB and the kept head holds several: over the budget
    records, summary = run([128, 256, 2048, 128, 2048])
    heads = [r["head"] for r in records]
    assert heads[1] == "KEPT" and heads[3] == "KEPT", heads
    assert heads[2].startswith("CHUNKED:") and heads[4].startswith("CHUNKED:"), heads
    assert summary["ooms"] == 0
    assert all(r["observed_peak_bytes"] <= r["budget_bytes"] for r in records)


def test_long_context_chunks_always_and_kept_never():
    records, _ = run([128, 512], policy="long-context")
    assert all(r["head"].startswith("CHUNKED:") for r in records)
    from adaptmem.config.policy import load_policy

    records, _ = run([128, 256], policy=load_policy("balanced").model_copy(update={"head": "kept"}), budget=512 * MiB)
    assert [r["head"] for r in records] == ["KEPT", "KEPT"]


def test_without_a_head_the_plans_are_as_before():
    records, _ = run([128, 256], head=None, budget=512 * MiB)
    assert all(r["head"] is None for r in records)


def test_the_head_costs_price_memory_by_shape_and_chunks_by_count():
    costs = HeadCosts(vocab=1000, hidden=10, weight_bytes=40_000, cuda=False)
    assert costs.tokens(2, 300 * 10) == 600
    assert costs.chunks(600) == [64, 128, 256, 512, 1024]
    choices = costs.choices(2, 3000, "auto")
    assert choices[0][0] == KEPT and [c.chunk for c, _, _ in choices[1:]] == [1024, 512, 256, 128, 64]
    needs = [need for _, need, _ in choices[1:]]
    seconds = [s for _, _, s in choices[1:]]
    assert needs == sorted(needs, reverse=True) and seconds == sorted(seconds)  # smaller chunks: less memory, more time
    assert choices[0][1] > needs[0]  # kept holds more than one chunk of everything
    assert [c for c, _, _ in costs.choices(2, 3000, "kept")] == [KEPT]
    above = costs.chunk_bytes(128) + 1234.0
    costs.learn(HeadChoice(HeadMode.CHUNKED, 128), 2, 3000, above=above)
    assert costs.chunked_bytes(2, 3000, 128) == pytest.approx(above)  # the step seen, as it was
    assert costs.chunked_bytes(2, 3000, 256) - above == pytest.approx(costs.chunk_bytes(256) - costs.chunk_bytes(128))
    assert HeadChoice.parse("CHUNKED:256") == HeadChoice(HeadMode.CHUNKED, 256) and HeadChoice.parse("KEPT") == KEPT


def test_a_chunks_bytes_are_learned_from_the_chunked_steps():
    """Before a chunked step a chunk is priced at `CHUNK_LOGITS` of its logits; once steps have
    shown it (1.0 in float32) the learned share prices it, and it survives a resume."""
    from adaptmem.control.headcosts import CHUNK_LOGITS, HeadChoice, HeadCosts
    from adaptmem.modes import HeadMode

    vocab, hidden = 1000, 64
    costs = HeadCosts(vocab, hidden, vocab * hidden * 4, cuda=False)
    assert costs.chunk_logits == CHUNK_LOGITS
    for tokens, chunk in ((512, 256), (1024, 512), (1024, 256)):
        extent = tokens * hidden
        beside = costs._fixed(1, extent)  # the weight's gradient and a few hidden-sized tensors
        costs.learn(HeadChoice(HeadMode.CHUNKED, chunk), 1, extent, beside + 1.0 * chunk * vocab * 4)
    assert costs.chunk_logits == pytest.approx(1.0, rel=0.02)
    again = HeadCosts(vocab, hidden, vocab * hidden * 4, cuda=False)
    again.load_state_dict(costs.state_dict())
    assert again.chunked_bytes(1, 4096 * hidden, 1024) == costs.chunked_bytes(1, 4096 * hidden, 1024)
    assert costs.chunked_bytes(1, 4096 * hidden, 1024) == pytest.approx(
        costs._fixed(1, 4096 * hidden) + 1024 * vocab * 4, rel=0.05
    )


@pytest.mark.parametrize("policy", ["balanced", "long-context"])  # the second chunks wherever it can
def test_a_head_whose_loss_is_the_users_own_is_planned_and_recorded_as_it_runs(policy):
    """A Hugging Face model called without `labels=`, its loss taken from the logits by the user: the
    head cannot chunk (it runs as it is), so it is recorded and planned KEPT, and the steps where the
    budget tightens are predicted as they run (planned chunked, one read 49% over its prediction)."""
    model = hf_model("llama", vocab_size=8000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    budget = 112 * MiB
    with (
        SimulatedDevice(capacity_bytes=budget) as dev,
        adaptmem.manage(model, device=TickingProbe(dev), budget=budget, policy=policy) as mem,
    ):
        for i, seq in enumerate([128, 256, 512, 640, 640, 768, 768]):
            ids = torch.randint(0, 8000, (1, seq), generator=torch.Generator().manual_seed(i))

            def step():
                logits = model(input_ids=ids).logits
                torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

            mem.run_step(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps, plans, state = mem.events.of_type("step"), mem.events.of_type("plan"), mem.state_dict()
    assert [r["head"] for r in steps] == ["KEPT"] * 7
    assert all(r["head"] == "KEPT" for r in plans if r["step"] > 1), [(r["step"], r["head"]) for r in plans]
    assert all(r["observed_peak_bytes"] <= r["budget_bytes"] for r in steps)
    assert steps[-1]["plan"] != ["NONE", "NONE"]  # the budget shaped the blocks' plan
    assert all(abs(r["prediction_error"]) < 0.05 for r in steps[-2:])
    # a manager resumed from its state knows it too: its first step, at a length not planned for
    # before, whose head the plans would chunk, is planned kept and predicted as it runs
    ids = torch.randint(0, 8000, (1, 800), generator=torch.Generator().manual_seed(7))
    with (
        SimulatedDevice(capacity_bytes=budget) as dev,
        adaptmem.MemoryManager(model, device=TickingProbe(dev), budget=budget, policy=policy, state=state) as mem,
    ):
        mem.run_step(step)
        resumed = mem.last_step
    assert resumed["head"] == "KEPT" and abs(resumed["prediction_error"]) < 0.05


def test_where_no_plan_fits_the_head_runs_in_its_smallest_chunks():
    """Past the longest length predicted, no plan fits: the plan that runs is the tightest, its head
    too. The tightest peak was the blocks' (extrapolated, with margins), and the cheapest head
    under it took chunks of 1,024 tokens: it ran out of memory twice before the retries came down
    to the smallest."""
    from helpers import hf_batch, llama

    vocab = 8192
    model = llama(layers=4, hidden=64, dropout=0.0, vocab=vocab)
    dev = SimulatedDevice(96 * MiB)
    dev.track(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with dev, adaptmem.manage(model, device=dev, budget="80%") as mem:
        for seq in (128, 128, 256, 256):
            mem.run_step(lambda: model(**hf_batch(2, seq, vocab=vocab)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
        length = int(1.4 * mem.longest_sequence(2).length)
        mem.run_step(lambda: model(**hf_batch(2, length, vocab=vocab)).loss.backward())
        smallest = mem._controller.costs.head_costs.chunks(2 * length)[0]
        assert mem.last_step["head"] == f"CHUNKED:{smallest}" and mem.last_step["attempt"] == 0
        assert mem.summary()["ooms"] == 0


def test_a_retry_after_a_chunked_head_failed_keeps_it_chunked_no_larger():
    """A Llava's retries at 2 x 1,482 tokens went from the head in chunks of 64 tokens to the head
    kept (predicted no lower) and then to chunks of 4,096: each looser than the one that failed. After
    a chunked head ran out of memory in a step, a retry's head is chunked, in chunks no larger than
    the smallest that failed; where only a kept head failed, the planner's choice stands."""
    from helpers import hf_batch, llama

    model = llama(layers=2, hidden=64, dropout=0.0, vocab=4096)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev, budget="1GiB") as mem:
        for _ in range(3):
            mem.run_step(lambda: model(**hf_batch(2, 64, vocab=4096)).loss.backward())
            model.zero_grad(set_to_none=True)
        plans = mem._controller.plans
        plans.ran_at.clear()
        key, shape = plans.bucket(2, 64 * 64), (2, 64 * 64)
        blocks = (Mode.OFFLOAD,) * 2
        plans.start_attempt(1)
        plans.failure(blocks, HeadChoice(HeadMode.CHUNKED, 128), shape, foreseen=True)
        plans.failure(blocks, KEPT, shape, foreseen=True)  # then the kept head failed too
        chunk = HeadChoice(HeadMode.CHUNKED, 128)
        assert plans._tighter_head(KEPT) == chunk and plans._tighter_head(HeadChoice(HeadMode.CHUNKED, 4096)) == chunk
        assert plans._tighter_head(HeadChoice(HeadMode.CHUNKED, 64)) == HeadChoice(HeadMode.CHUNKED, 64)
        retry = plans.make(key, 0, mem.budget, fixed={}, reason="retry", extent=shape[1])
        assert retry.head is not None and retry.head.mode is HeadMode.CHUNKED and retry.head.chunk <= 128
        plans.succeeded()
        plans.start_attempt(1)
        plans.failure(blocks, KEPT, shape, foreseen=True)
        assert plans._tighter_head(KEPT) == KEPT  # only a kept head failed: the planner's choice
        plans.succeeded()


def fused_head(model):
    """`model`'s forward with its loss made from the head's weight outside the head module, as TRL's
    fused LM head makes it: the backbone, then the projection by `lm_head.weight`."""
    import types

    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state[:, :-1]
        logits = hidden @ self.lm_head.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)
    return model


def test_a_loss_made_from_the_heads_weight_elsewhere_is_planned_kept_and_warned_of(caplog):
    """A model given `labels=` whose head module is never called (TRL's fused LM head): the plans
    keep the head from the first step on, even where they would chunk it (long-context chunks
    wherever it can), the steps are predicted as they run, one warning names it, and training is
    bit for bit the unmanaged run's."""
    from helpers import assert_same_state, hf_batch, llama, training_state

    def train(managed: bool):
        model = fused_head(llama(layers=2, hidden=64, dropout=0.0, vocab=4096))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dev = SimulatedDevice(2**31)
        dev.track(model)
        with dev, adaptmem.manage(model, device=dev, policy="long-context") if managed else nullcontext() as mem:
            for seq in (64, 128, 256, 256):
                batch = hf_batch(2, seq, vocab=4096)
                (mem.run_step if managed else lambda f: f())(lambda: model(**batch).loss.backward())
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps, plans = (mem.events.of_type("step"), mem.events.of_type("plan")) if managed else ([], [])
        return training_state(model, opt), steps, plans

    from contextlib import nullcontext

    with caplog.at_level("WARNING", logger="adaptmem"):
        managed, steps, plans = train(True)
    assert [r["head"] for r in steps] == ["KEPT"] * 4
    assert all(r["head"] == "KEPT" for r in plans if r["step"] > 1), [(r["step"], r["head"]) for r in plans]
    assert abs(steps[-1]["prediction_error"]) < 0.05
    warned = [r.getMessage() for r in caplog.records if "was never called" in r.getMessage()]
    assert len(warned) == 1 and "LlamaForCausalLM" in warned[0] and "lm_head" in warned[0], warned
    assert_same_state(managed, train(False)[0])


def test_retries_of_a_loss_made_elsewhere_that_ran_out_do_not_chunk_the_head():
    """The first step runs out of memory in a loss made from the head's weight outside the head
    module: chunking the head saves nothing there, so no retry is planned chunked (TRL's fused head
    on a Phi-3 had its retries predicted at 75 MiB with the head in chunks of 64 tokens, and each
    ran out over 410 MiB; here four attempts ran, the last three chunked and predicted at 13 to 62
    MiB against 84 MiB, and each ran out in the loss head). The plan a retry would run, the head
    kept, is predicted over the device, and the batch is given up after its first attempt."""
    from helpers import hf_batch, llama

    model = fused_head(llama(layers=2, hidden=64, dropout=0.0, vocab=8192))
    batch = hf_batch(2, 1024, vocab=8192)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev, budget="100%") as mem:
        # the blocks fit; the logits (64 MiB) and their log-softmax do not
        dev.set_capacity(dev.allocated_bytes + 80 * MiB)
        with pytest.raises(adaptmem.StepOutOfMemoryError) as raised:
            mem.run_step(lambda: model(**batch).loss.backward())
    attempts = raised.value.attempts
    assert all(a["phase"] == "the loss head" and a["head"] == "KEPT" for a in attempts), attempts
    assert "head KEPT; predicted peak now" in str(raised.value)  # the kept head, priced as it ran


def _reading_the_logits_from_the_third_step(capacity: int):
    """A Llama trained at 2 x 256 then 2 x 512 tokens, under a budget that chunks the head at 512;
    from the third step on, the step also takes the argmax of the logits, which the chunked head
    cannot replay. Returns each step's outcome ("KEPT", "CHUNKED:n", or the error) and the manager's
    answer for batch 2 after the last."""
    from helpers import llama

    vocab = 8000
    model = llama(layers=2, hidden=64, dropout=0.0, vocab=vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    outcomes = []
    with SimulatedDevice(capacity) as dev, adaptmem.manage(model, device=dev, budget="80%") as mem:
        for i, seq in enumerate((256, 512, 512, 512, 512)):
            ids = torch.randint(0, vocab, (2, seq), generator=generator)

            def step(i=i, ids=ids):
                out = model(input_ids=ids, labels=ids)
                if i >= 2:
                    out.logits.argmax(-1)
                out.loss.backward()

            try:
                mem.run_step(step)
                outcomes.append(mem.last_step["head"])
            except RuntimeError as error:
                outcomes.append(error)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return outcomes, mem.longest_sequence(2)


def test_once_a_step_reads_the_logits_no_plan_that_chunked_the_head_runs_again(caplog):
    """A CodeGen whose loop began to read its logits' argmax after a step had trained its length with
    the head chunked raised `LogitsNotMaterializedError` at that step and at every step after it: no
    plan was predicted to fit with the head kept, and the plan that had run that length, its head
    chunked, was run again as the evidence. Now a plan that ran is taken only with a head that can
    run so: the head is kept and the steps train. Where the kept head cannot fit, the batch is given
    up saying why the head is kept, and the answer of how long fits counts no length that trained
    with the head chunked."""
    with caplog.at_level("WARNING", logger="adaptmem"):
        outcomes, _ = _reading_the_logits_from_the_third_step(130 * MiB)
    assert outcomes[1].startswith("CHUNKED:")
    assert outcomes[2:] == ["KEPT"] * 3
    assert sum("beyond what a chunk replays" in r.getMessage() for r in caplog.records) == 1

    outcomes, reach = _reading_the_logits_from_the_third_step(60 * MiB)
    assert outcomes[1].startswith("CHUNKED:")
    for error in outcomes[2:]:
        assert isinstance(error, adaptmem.StepOutOfMemoryError), error
        assert "The loss head is kept whole for the rest of this run" in str(error)
        assert "TensorBase.argmax" in str(error)
    assert reach.head == "KEPT" and reach.length < 512

    # run, out of memory in the head, then given up: no plan frees what the kept head lacked there
    outcomes, _ = _reading_the_logits_from_the_third_step(90 * MiB)
    assert isinstance(outcomes[2], adaptmem.StepOutOfMemoryError)
    assert outcomes[2].attempts[-1]["phase"] == "the loss head" and len(outcomes[2].attempts) <= 2
    assert "it ran out of memory in the loss head" in str(outcomes[2])
    assert "The loss head is kept whole for the rest of this run" in str(outcomes[2])


def test_a_batch_that_ran_out_in_its_kept_head_is_given_up_when_no_plan_frees_what_the_head_lacked():
    """An attempt that runs out of memory in the loss head says what its allocation lacked there; a
    retry with the same head must hold that much less while the head runs, which no block's mode
    does when the blocks hold little: the batch is given up after its first attempt, and the error
    says why (an OLMoE's batch past its longest, its head kept, ran three plans that each ran out in
    the head, short of the same 17 MiB, and again when the batch came back; it now runs none)."""
    from helpers import hf_batch, llama

    model = llama(layers=2, hidden=64, dropout=0.0, vocab=8192)
    dev = SimulatedDevice(2**31)
    dev.track(model)
    policy = adaptmem.load_policy().model_copy(update={"head": "kept"})
    with dev, adaptmem.manage(model, device=dev, policy=policy, budget="100%") as mem:
        for seq in (64, 128, 128):
            batch = hf_batch(2, seq, vocab=8192)
            mem.run_step(lambda batch=batch: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
        # the blocks fit at 2 x 1,024 tokens; the logits (64 MiB) and their log-softmax do not
        dev.set_capacity(dev.allocated_bytes + 110 * MiB)
        batch = hf_batch(2, 1024, vocab=8192)
        with pytest.raises(adaptmem.StepOutOfMemoryError) as raised:
            mem.run_step(lambda: model(**batch).loss.backward())
        (attempt,) = raised.value.attempts
        assert attempt["phase"] == "the loss head" and attempt["head"] == "KEPT"
        said = "it ran out of memory in the loss head or the loss, after every block's forward, "
        assert said in str(raised.value)
        assert "MiB short, and no plan with that head holds that much less" in str(raised.value)
        # when it comes back with no more room, it is given up before it runs
        with pytest.raises(adaptmem.StepOutOfMemoryError) as raised:
            mem.run_step(lambda: model(**batch).loss.backward())
        assert raised.value.attempts == [] and "2 x 1,024 tokens was given up earlier" in str(raised.value)
