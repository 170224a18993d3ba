"""Plans and costs key on the whole input: images that grow from batch to batch are
predicted before they run, and the budget holds on every step after the first."""

import pytest
import torch
from helpers import cnn, image_batch, quiet_transformers

import adaptmem
from adaptmem import Mode
from adaptmem.control.samples import shape_of
from adaptmem.testing import SimulatedDevice, measure_peak


@pytest.mark.parametrize(
    "args,kwargs,expected",
    [
        ((torch.zeros(4, 3, 32, 48),), {}, (4, 3 * 32 * 48, 3, 0)),  # images: every dimension
        ((torch.zeros(2, 3, 8, 16, 16),), {}, (2, 3 * 8 * 16 * 16, 3, 0)),  # video
        ((torch.zeros(2, 100, 80),), {}, (2, 8000, 100, 80)),  # audio frames
        ((torch.zeros(2, 128, 64), torch.zeros(2, 1, 128, 128)), {}, (2, 128 * 64, 128, 64)),  # hidden states first
        ((), {"hidden_states": torch.zeros(3, 10, 8)}, (3, 80, 10, 8)),  # keyword arguments too
        ((torch.zeros(10, 8, dtype=torch.long), torch.zeros(50, 16)), {}, (1, 800, 50, 16)),  # 2-D: one sample
        # a stack of sequences (n, B, S, H) beside the position ids (B, S): B sequences of n x H a position
        ((torch.zeros(4, 2, 100, 16),), {"position_ids": torch.zeros(2, 100)}, (2, 4 * 100 * 16, 100, 64)),
        # images beside a tensor that leads with their batch: batch first, whatever else is there
        ((torch.zeros(4, 3, 32, 48), torch.zeros(4, 3), torch.zeros(3, 32)), {}, (4, 3 * 32 * 48, 3, 0)),
    ],
)
def test_the_main_input_is_taken_whole(args, kwargs, expected):
    """(batch, elements per sample, dimension 1, and a sequence's elements per position: 0 where
    the input is not batch x positions x features)."""
    assert tuple(shape_of(args, kwargs)) == expected


def test_growing_images_stay_under_the_budget_from_the_second_step():
    sizes = [16, 24, 32, 40, 48, 56]
    model = cnn(channels=16, stages=4)
    largest = image_batch(batch=8, size=sizes[-1])
    none = measure_peak(model, lambda: largest)
    low = measure_peak(model, lambda: largest, mode=Mode.CHECKPOINT)
    budget = int(low + 0.5 * (none - low))
    assert measure_peak(model, lambda: image_batch(batch=8, size=sizes[2])) < budget  # small ones fit plain
    truth = SimulatedDevice()  # a meter the manager does not read
    dev = SimulatedDevice(capacity_bytes=2 * none)
    truth.track(model)
    dev.track(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    peaks, records = [], []
    with truth, dev, adaptmem.manage(model, budget=budget, device=dev) as mem:
        for size in sizes:
            truth.reset_peak()
            mem.run_step(lambda b=image_batch(batch=8, size=size): model(**b).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)
            peaks.append(truth.peak_bytes)
            records.append(mem.last_step)
        summary = mem.summary()
    assert summary["ooms"] == 0
    assert max(peaks[1:]) <= budget, [round(p / budget, 3) for p in peaks]
    assert [r["sample_elements"] for r in records] == [16 * s * s for s in sizes]
    assert any(c != {"NONE": 4} for c in (r["plan_counts"] for r in records[1:]))  # the large ones needed managing


def test_a_length_never_seen_is_planned_for_with_the_weights_gradients_held_constant():
    """After one step at 128 tokens, the first at 384 is extrapolated from it. The gradients of
    the weights whose backward has run do not grow with the tokens: scaled with them, a small
    model's were predicted at 3x their size, every plan looked over the budget, and the
    cheapest of those overshot it by 12%, where checkpointing every block fitted."""
    from helpers import quiet_transformers

    quiet_transformers()
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=6,
            intermediate_size=512,
            num_attention_heads=4,
            max_position_embeddings=1024,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
        )
    )
    short, long = (torch.randint(0, 1000, (2, n), generator=torch.Generator().manual_seed(n)) for n in (128, 384))
    budget = int(1.1 * measure_peak(model, lambda: {"input_ids": long, "labels": long}, mode=Mode.CHECKPOINT))
    truth, dev = SimulatedDevice(), SimulatedDevice(capacity_bytes=4 * budget)
    truth.track(model)
    dev.track(model)
    with truth, dev, adaptmem.manage(model, budget=budget, device=dev, policy="max-savings") as mem:
        for ids in (short, long):
            truth.reset_peak()
            mem.run_step(lambda ids=ids: model(input_ids=ids, labels=ids).loss.backward())
            model.zero_grad(set_to_none=True)
        assert truth.peak_bytes <= budget, round(truth.peak_bytes / budget, 3)
        assert mem._controller.costs.grad_constant(0) == sum(
            w.numel() * w.element_size() for layer in model.gpt_neox.layers[1:] for w in layer.parameters()
        )


def test_gemma3n_whose_layers_take_a_stack_of_sequences_is_read_and_answered_by_its_tokens():
    """Gemma3n's decoder layers take their alternating-update streams stacked, (n, B, S, H): read
    from dimension 0, every step was logged as batch n x B tokens, and a "how long" question raised
    that the blocks' input has no sequence dimension."""
    quiet_transformers()
    import transformers

    config = transformers.Gemma3nTextConfig(
        vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=64, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=3, laurel_rank=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    with dev, adaptmem.manage(model, budget="50%", device=dev) as mem:
        for length in (96, 160, 128):
            ids = torch.randint(0, 256, (2, length), generator=g)
            mem.run_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
            model.zero_grad(set_to_none=True)
            assert (mem.last_step["batch"], mem.last_step["seq"]) == (2, length)
        answer = mem.longest_sequence(batch=2)
    assert answer.batch == 2 and answer.length > 160
