"""The loss head, chunked: the same loss and gradients as the model's own code, within a stated bound.

Chunking changes only the order of summation, so fp32 results agree to a relative
error of 1e-5 (the README states it); a KEPT head is the model's own code, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adaptmem
from adaptmem import HeadMode, LogitsNotMaterializedError
from adaptmem.strategies.head import ChunkedLogits
from adaptmem.testing import SimulatedDevice
from tests.helpers import quiet_transformers

BOUND = 1e-5  # fp32: max relative error of the loss, every gradient, and the weights after 20 AdamW steps


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def hf_model(kind: str, **extra):
    quiet_transformers()
    import transformers

    torch.manual_seed(0)
    small = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=False,
    )
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", small),
        "mistral": ("MistralConfig", "MistralForCausalLM", small),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", small),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**small, "head_dim": 16, "final_logit_softcapping": 30.0}),
        "granite": ("GraniteConfig", "GraniteForCausalLM", {**small, "logits_scaling": 4.0}),
        "cohere": ("CohereConfig", "CohereForCausalLM", {**small, "logit_scale": 0.0625}),
        "gpt2": (
            "GPT2Config",
            "GPT2LMHeadModel",
            dict(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=256, use_cache=False),
        ),
        "gpt_neox": (
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            dict(
                vocab_size=384,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=256,
                use_cache=False,
            ),
        ),
        "bart": (
            "BartConfig",
            "BartForConditionalGeneration",
            dict(
                vocab_size=384,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_position_embeddings=1024,
                use_cache=False,
            ),
        ),
        "t5": (
            "T5Config",
            "T5ForConditionalGeneration",
            dict(
                vocab_size=384,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                pad_token_id=0,
                decoder_start_token_id=0,
                use_cache=False,
            ),
        ),
    }
    config_name, model_name, kwargs = configs[kind]
    config = getattr(transformers, config_name)(**{**kwargs, **extra})
    model = getattr(transformers, model_name)(config)
    if kind == "bart":  # its logits' bias is a buffer of zeros until fine-tuned: values make it count
        model.final_logits_bias.normal_(generator=torch.Generator().manual_seed(3))
    return model


def labels_for(batch: int = 2, seq: int = 40, vocab: int = 384, seed: int = 1) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt not trained on
    return {"input_ids": ids, "labels": labels}


def one_step(model, batch, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = model(**batch, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def chunked(model, chunk: int = 16):
    adaptmem.instrument(model)
    head = adaptmem.get_head(model)
    head.mode, head.chunk_tokens = HeadMode.CHUNKED, chunk
    return head


@pytest.mark.parametrize(
    "kind", ["llama", "mistral", "qwen2", "gemma2", "granite", "cohere", "gpt2", "gpt_neox", "bart", "t5"]
)
def test_a_chunked_head_gives_the_loss_and_gradients_of_the_model_within_the_bound(kind):
    """BART adds a bias per vocabulary entry to its logits (`final_logits_bias`, a buffer): a sum with
    the logits replayed on each chunk; T5 scales the hidden states before its head."""
    model = hf_model(kind)
    reference = copy.deepcopy(model)
    head = chunked(model)
    batch = labels_for()
    loss, grads = one_step(model, batch)
    loss_ref, grads_ref = one_step(reference, batch)
    assert head.chunked_calls == 1 and head.last_chunks == 5  # 80 tokens in chunks of 16: found with no user code
    assert relative(loss, loss_ref) <= BOUND
    assert grads.keys() == grads_ref.keys()
    # a key projection's bias has no gradient but rounding's (softmax ignores a shift of every score
    # of a query): BART's are 1e-12, eleven orders under its largest; such gradients are only bounded
    top = max(g.abs().max().item() for g in grads_ref.values())
    zero = {n for n, g in grads_ref.items() if g.abs().max().item() <= 1e-9 * top}
    assert all(grads[n].abs().max().item() <= 1e-8 * top for n in zero)
    worst = max(relative(grads[n], grads_ref[n]) for n in grads if n not in zero)
    assert worst <= BOUND, worst


def test_the_weights_after_20_adamw_steps_agree_within_the_bound_and_kept_is_bit_exact():
    """At a fine-tuning learning rate. Adam's first step moves each weight by lr x the sign of its
    gradient, so a gradient element within rounding of zero may move the other way: 2 x lr apart,
    whatever the chunking (at lr 1e-3 that is 2.5e-4 of this model's largest weight)."""
    models = {name: hf_model("llama") for name in ("plain", "kept", "chunked")}
    adaptmem.instrument(models["kept"])  # found, left KEPT: the model's own code
    chunked(models["chunked"], chunk=24)
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    for step in range(20):
        batch = labels_for(seq=32 + step, seed=step)
        for name, model in models.items():
            one_step(model, batch)
            optims[name].step()
    plain = dict(models["plain"].named_parameters())
    for name, p in models["kept"].named_parameters():
        assert torch.equal(p, plain[name]), name
    worst = max(relative(p.detach(), plain[n].detach()) for n, p in models["chunked"].named_parameters())
    assert worst <= BOUND, worst
    for name in ("kept", "chunked"):  # the optimizer's state too
        for p, q in zip(models[name].parameters(), models["plain"].parameters()):
            state, ref = optims[name].state[p], optims["plain"].state[q]
            assert relative(state["exp_avg_sq"], ref["exp_avg_sq"]) <= (0 if name == "kept" else 1e-4)


def test_tied_embeddings_gradient_accumulation_scaling_and_ignored_labels():
    model = hf_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    chunked(model, chunk=8)
    batch = labels_for(seq=24)
    items = torch.tensor(29)  # num_items_in_batch, as the Trainer passes under accumulation: a sum / n
    loss, grads = one_step(model, batch, num_items_in_batch=items)
    loss_ref, grads_ref = one_step(reference, batch, num_items_in_batch=items)
    assert relative(loss, loss_ref) <= BOUND
    assert max(relative(grads[n], grads_ref[n]) for n in grads) <= BOUND


def test_bf16_autocast_agrees_to_bf16_precision():
    model = hf_model("llama")
    reference = copy.deepcopy(model)
    chunked(model, chunk=16)
    batch = labels_for()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = one_step(model, batch)
        loss_ref, grads_ref = one_step(reference, batch)
    assert relative(loss, loss_ref) <= 1e-2
    assert max(relative(grads[n], grads_ref[n]) for n in grads) <= 3e-2


def test_a_cast_of_logits_the_loss_consumed_is_as_unmade_as_they_are():
    """A model given `labels=` takes its loss inside forward, and the logits it returns are consumed;
    `.float()` of them (Accelerate's mixed precision casts every output so) gives logits of the new
    dtype that are still not made, and reading those names the fix."""
    model = hf_model("llama")
    chunked(model, chunk=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**labels_for())
    assert isinstance(out.logits, ChunkedLogits) and out.logits.dtype == torch.bfloat16
    cast = out.logits.float()
    assert isinstance(cast, ChunkedLogits) and cast.dtype == torch.float32 and cast.shape == out.logits.shape
    assert cast.to(torch.float16).dtype == torch.float16 and (cast * 2).shape == cast.shape
    with pytest.raises(LogitsNotMaterializedError, match="head=None"):
        cast.argmax(-1)
    with pytest.raises(LogitsNotMaterializedError, match="consumed by the loss already"):
        cast[..., :-1, :]
    out.loss.backward()
    assert model.lm_head.weight.grad is not None


class NanoGPT(nn.Module):
    """nanoGPT's head and loss, as it writes them."""

    def __init__(self, vocab: int = 200, dim: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(2))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def test_a_model_of_ones_own_takes_one_line_and_its_logits_answer_clearly():
    torch.manual_seed(0)
    model = NanoGPT()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 200, (3, 20))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -1
    with (
        SimulatedDevice(2**30) as dev,
        adaptmem.manage(model, head="lm_head", policy="long-context", device=dev) as mem,
    ):
        with mem.step():
            logits, loss = model(idx, targets)
            loss.backward()
        assert mem.head.mode is HeadMode.CHUNKED and mem.last_step["head"].startswith("CHUNKED")
        with pytest.raises(LogitsNotMaterializedError, match="head=None"):
            logits.argmax(-1)
        assert isinstance(logits, ChunkedLogits) and logits.shape == (3, 20, 200)
        model.eval()
        with torch.no_grad():  # generation: the head runs as it is
            last, _ = model(idx)
        assert not isinstance(last, ChunkedLogits) and last.shape == (3, 1, 200)
    _, loss_ref = reference(idx, targets)  # not managed: the whole logits
    loss_ref.backward()
    assert relative(loss.detach(), loss_ref.detach()) <= BOUND
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert relative(p.grad, q.grad) <= BOUND, n


class Adjusted(NanoGPT):
    """nanoGPT with its logits shifted before the loss: less a log-prior per vocabulary entry (a
    buffer, as logit adjustment keeps it), plus a number."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("log_prior", torch.randn(200, generator=torch.Generator().manual_seed(2)))

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x)
        logits = 0.5 + (self.lm_head(self.ln_f(x)) - self.log_prior)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_logits_shifted_by_a_vector_over_the_vocabulary_are_replayed_on_each_chunk():
    torch.manual_seed(0)
    model = Adjusted()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 200, (3, 20))
    targets = idx.roll(-1, 1)
    adaptmem.instrument(model, head="lm_head")
    head = adaptmem.get_head(model)
    head.mode, head.chunk_tokens = HeadMode.CHUNKED, 16
    loss = model(idx, targets)
    loss.backward()
    loss_ref = reference(idx, targets)
    loss_ref.backward()
    assert head.chunked_calls == 1
    assert relative(loss.detach(), loss_ref.detach()) <= BOUND
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert relative(p.grad, q.grad) <= BOUND, n


@pytest.mark.parametrize("kind", ["llama", "granite", "bart"])
def test_a_chunked_head_never_makes_the_whole_logits(kind):
    """At 1024 tokens and a vocabulary of 8000, one logits tensor is 31 MiB: the chunked step's
    whole peak stays well under it, while the kept step holds several. Granite's logits are scaled
    (`logits / logits_scaling`), BART's shifted by a bias per vocabulary entry: both run in place on
    the chunk's one buffer, where through autograd a Granite's chunk held about four of them."""
    model = hf_model(kind, vocab_size=8000)
    batch = labels_for(batch=1, seq=1024, vocab=8000)
    one_step(model, batch)  # gradients allocated, as after the first step
    logits_bytes = 1024 * 8000 * 4
    peaks = {}
    for mode in (HeadMode.KEPT, HeadMode.CHUNKED):
        adaptmem.instrument(model)
        head = adaptmem.get_head(model)
        head.mode, head.chunk_tokens = mode, 128
        with SimulatedDevice() as dev:
            base = dev.allocated_bytes
            one_step(model, batch)
            peaks[mode] = dev.peak_bytes - base
        adaptmem.restore(model)
    assert peaks[HeadMode.KEPT] > 2 * logits_bytes
    # the chunk's one buffer (4 MB) beside the step's own bytes: 16.3 MB on both; through autograd,
    # Granite's chunks made it 28.6 MB. BART's encoder and decoder both run the 1024 tokens: 26.6 MB,
    # through autograd 38.8 MB
    assert peaks[HeadMode.CHUNKED] < (0.85 if kind == "bart" else 0.6) * logits_bytes, peaks


def test_a_soft_capped_chunk_holds_one_buffer_more_than_a_plain_one():
    """Gemma 2's logits are soft-capped (`tanh(logits / c) * c`): in float32 the cap runs in place on
    the chunk's buffer, with the tanh's output kept beside it for its gradient, one more buffer of
    the chunk's size (16.4 MB over the uncapped model's peak here). Through autograd it held four
    more (65.5 MB over), and one chunk as large as the batch peaked over the whole logits kept."""
    chunk_bytes = 128 * 32000 * 4  # a vocabulary of 32,000: the head, not the attention, sets the peak
    batch = labels_for(batch=1, seq=512, vocab=32000)
    peaks = {}
    for cap in (None, 30.0):
        model = hf_model("gemma2", vocab_size=32000, final_logit_softcapping=cap)
        one_step(model, batch)  # gradients allocated, as after the first step
        adaptmem.instrument(model)
        head = adaptmem.get_head(model)
        head.mode, head.chunk_tokens = HeadMode.CHUNKED, 128
        with SimulatedDevice() as dev:
            base = dev.allocated_bytes
            one_step(model, batch)
            peaks[cap] = dev.peak_bytes - base
    assert peaks[30.0] - peaks[None] <= 1.1 * chunk_bytes, (peaks, chunk_bytes)


def test_without_labels_or_outside_training_the_head_runs_as_it_is():
    model = hf_model("llama")
    head = chunked(model)
    ids = labels_for()["input_ids"]
    out = model(input_ids=ids)  # no labels: a loss of the user's own, or generation
    assert not isinstance(out.logits, ChunkedLogits) and head.chunked_calls == 0
    out.logits.log_softmax(-1).mean().backward()
    model.eval()
    assert not isinstance(model(input_ids=ids, labels=ids).logits, ChunkedLogits)


def test_bad_input_is_named_and_changes_nothing():
    model = hf_model("llama")
    with pytest.raises(ValueError, match="no submodule of that name.*lm_head"):
        adaptmem.instrument(model, head="output")
    with pytest.raises(ValueError, match="is a LlamaRMSNorm, not an nn.Linear"):
        adaptmem.instrument(model, head="model.norm")
    with pytest.raises(ValueError, match=r"policy's `head`.*update=\{'head': 'kept'\}"):  # a policy value, not a name
        adaptmem.instrument(model, head="kept")
    with pytest.raises(ValueError, match="is an Embedding, not"):
        adaptmem.instrument(model, head="model.embed_tokens")
    assert adaptmem.get_handles(model) == [] and "forward" not in model.lm_head.__dict__
    chunked(model)
    batch = labels_for()
    with pytest.raises(ValueError, match="labels hold 30 targets"):
        logits = model(input_ids=batch["input_ids"]).logits  # unarmed: a real tensor
        F.cross_entropy(
            ChunkedLogits.of(torch.randn(2, 40, 64), model.lm_head.weight, None, 8).view(-1, 384),
            torch.zeros(30, dtype=torch.long),
        )
    assert logits.shape == (2, 40, 384)
    adaptmem.restore(model)
    assert "forward" not in model.lm_head.__dict__ and not model._forward_pre_hooks


def test_a_chunk_of_ones_own_larger_than_the_batch_warns_with_the_fix_and_the_planners_never(caplog):
    model = hf_model("llama")
    reference = copy.deepcopy(model)
    head = chunked(model, chunk=4096)  # 80 tokens a batch
    batch = labels_for()
    with caplog.at_level("WARNING", logger="adaptmem"):
        loss, grads = one_step(model, batch)
    warned = [r.getMessage() for r in caplog.records if "chunk_tokens=4096" in r.getMessage()]
    assert len(warned) == 1 and "80 tokens" in warned[0] and "head.chunk_tokens = 64" in warned[0]
    loss_ref, grads_ref = one_step(reference, batch)  # still right: one chunk, as large as KEPT's
    assert relative(loss, loss_ref) <= BOUND and max(relative(grads[n], grads_ref[n]) for n in grads) <= BOUND
    caplog.clear()
    head.planned(HeadMode.CHUNKED, 2048)  # the planner's own choice, for a batch it may not have seen
    with caplog.at_level("WARNING", logger="adaptmem"):
        one_step(model, labels_for(seed=2))
    assert not [r for r in caplog.records if "chunk_tokens" in r.getMessage()]
    for bad in (0, -8, 12.5, "64", True):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive number of tokens"):
            head.chunk_tokens = bad
    assert head.chunk_tokens == 2048 and head.mode is HeadMode.CHUNKED  # a bad value changes nothing


def test_a_model_of_ones_own_with_a_vocabulary_sized_projection_is_told_to_name_its_head(caplog):
    """head="auto" finds only a Hugging Face language model's head: where a model of one's own has
    a linear layer with as many outputs as an embedding has rows, a warning names it; head=None
    (no head, said so) and a found head say nothing."""

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(1024, 32)
            self.h = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
            self.lm_head = torch.nn.Linear(32, 1024, bias=False)

    with caplog.at_level("WARNING", logger="adaptmem"):
        adaptmem.instrument(gpt := GPT(), blocks=list(gpt.h))
    (warned,) = [r.getMessage() for r in caplog.records]
    assert "pass head='lm_head'" in warned and "'wte' has rows" in warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="adaptmem"):
        adaptmem.instrument(gpt := GPT(), blocks=list(gpt.h), head=None)
        adaptmem.instrument(gpt := GPT(), blocks=list(gpt.h), head="lm_head")
        adaptmem.instrument(hf_model("llama"))
    assert not caplog.records


class Accuracy(NanoGPT):
    """nanoGPT that also takes its accuracy from the logits in the training step, as a loop of one's
    own may: a use of the logits the chunked head cannot replay."""

    def forward(self, idx, targets):
        logits, loss = super().forward(idx, targets)
        self.accuracy = (logits.argmax(-1) == targets).float().mean()
        return logits, loss


def test_a_step_that_uses_the_chunked_logits_runs_again_with_the_head_kept_for_good(caplog):
    """A step whose code (the model's or the caller's) uses the chunked logits beyond what a chunk
    replays raised `LogitsNotMaterializedError` out of `run_step`; under the default policy that came
    mid-run, at the first step planned chunked (BART's bias did so before it was replayed). Now the
    head is kept from then on, with one warning, and `run_step` runs the step again, its state put
    back: the run equals unmanaged training bit for bit. Under `step()` it raises, and the next step
    keeps the head. A resumed manager keeps it too."""
    torch.manual_seed(0)
    model = Accuracy()
    reference = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    idx = torch.randint(0, 200, (3, 20))
    targets = idx.roll(-1, 1)
    with (
        caplog.at_level("WARNING", logger="adaptmem"),
        SimulatedDevice(2**30) as dev,
        adaptmem.manage(model, head="lm_head", policy="long-context", device=dev) as mem,
    ):
        for _ in range(3):
            mem.run_step(lambda: model(idx, targets)[1].backward())
            assert mem.last_step["head"] == "KEPT"
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = mem.state_dict()
    for _ in range(3):
        reference(idx, targets)[1].backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert torch.equal(model.accuracy, reference.accuracy)
    assert sum("beyond what a chunk replays (TensorBase.argmax" in r.getMessage() for r in caplog.records) == 1
    (kept,) = mem.events.of_type("head_kept")
    assert kept["step"] == 1 and kept["why"].startswith("TensorBase.argmax on the logits")
    with adaptmem.manage(model, head="lm_head", policy="long-context") as resumed:
        resumed.load_state_dict(state)
        assert resumed._controller.plans.head_kept_for is not None

    torch.manual_seed(0)
    model = Accuracy()
    with (
        SimulatedDevice(2**30) as dev,
        adaptmem.manage(model, head="lm_head", policy="long-context", device=dev) as mem,
    ):
        with pytest.raises(LogitsNotMaterializedError, match="argmax"), mem.step():
            model(idx, targets)[1].backward()
        model.zero_grad(set_to_none=True)
        with mem.step():
            model(idx, targets)[1].backward()
        assert mem.last_step["head"] == "KEPT"
