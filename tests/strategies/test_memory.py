"""What each mode saves, measured on the stand-in: HF Llama at sequence 256."""

import pytest
import torch
from helpers import hf_batch, llama

import adaptmem
from adaptmem import CompressOptions, Mode
from adaptmem.testing import SimulatedDevice

# bound on the step's peak device bytes, as a fraction of every block NONE
BOUNDS = {
    Mode.CHECKPOINT: 0.35,
    Mode.OFFLOAD: 0.35,
    Mode.COMPRESS: 0.45,
    Mode.CHECKPOINT | Mode.OFFLOAD: 0.35,
    Mode.COMPRESS | Mode.OFFLOAD: 0.35,
    Mode.SELECTIVE: 0.40,
}


@pytest.fixture(scope="module")
def peaks():
    model = llama(layers=8, hidden=256)
    batch = hf_batch(batch=2, seq=256)
    handles = adaptmem.instrument(model, compress=CompressOptions(codec="int8"))
    result = {}
    for mode in [Mode.NONE, *BOUNDS]:
        for h in handles:
            h.mode = mode
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with SimulatedDevice() as dev:
            model(**batch).loss.backward()
        result[mode] = (dev.peak_bytes, dev.host_peak_bytes)
    return result


@pytest.mark.parametrize("mode", list(BOUNDS), ids=lambda m: m.label)
def test_peak_is_within_bound_of_none(peaks, mode):
    none, _ = peaks[Mode.NONE]
    peak, _ = peaks[mode]
    assert peak <= BOUNDS[mode] * none, f"{mode.label}: {peak / none:.1%} of NONE"


def test_offload_moves_bytes_to_the_host_and_the_rest_do_not(peaks):
    none, _ = peaks[Mode.NONE]
    assert peaks[Mode.OFFLOAD][1] > 0.5 * none
    assert peaks[Mode.COMPRESS | Mode.OFFLOAD][1] < 0.4 * peaks[Mode.OFFLOAD][1]
    assert 0 < peaks[Mode.CHECKPOINT | Mode.OFFLOAD][1] < 0.05 * none
    for mode in (Mode.NONE, Mode.SELECTIVE, Mode.CHECKPOINT, Mode.COMPRESS):
        assert peaks[mode][1] == 0


def held_after_forward(model, batch, modes) -> dict:
    """Device bytes held between forward and backward, with every block in each of `modes`."""
    handles = adaptmem.instrument(model)
    held = {}
    for mode in modes:
        for h in handles:
            h.mode = mode
        with SimulatedDevice() as dev:
            loss = model(**batch).loss
            held[mode] = dev.allocated_bytes
            loss.backward()
    return held


def test_checkpoint_with_offloaded_input_frees_the_block_inputs():
    model = llama(layers=6, hidden=128)
    batch = hf_batch(batch=2, seq=256)
    held = held_after_forward(model, batch, (Mode.CHECKPOINT, Mode.CHECKPOINT | Mode.OFFLOAD))
    inputs = 6 * 2 * 256 * 128 * 4  # one hidden-state tensor per block, float32
    assert held[Mode.CHECKPOINT] - held[Mode.CHECKPOINT | Mode.OFFLOAD] >= inputs * 0.99


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_selective_keeps_the_linear_outputs_and_no_attention_scores(attention, every_layer_held):
    """As Megatron's selective recomputation: the attention core (seq x seq scores, softmax,
    dropout) is recomputed, the weight layers' outputs kept (every one, whatever its width, here).
    Held after forward, per block, is then far below one block's scores, and well above nothing
    (the linear outputs)."""
    layers, batch, seq, hidden = 4, 1, 1024, 64
    model = llama(layers=layers, hidden=hidden)
    model.config._attn_implementation = attention
    data = hf_batch(batch=batch, seq=seq)
    held = held_after_forward(model, data, (Mode.CHECKPOINT, Mode.SELECTIVE))
    heads = model.config.num_attention_heads
    scores = batch * heads * seq * seq * 4  # one block's attention probabilities, float32
    linear_outputs = batch * seq * (hidden + 2 * int(hidden * 2.6875)) * 4  # q, gate and up projections at least
    per_block = (held[Mode.SELECTIVE] - held[Mode.CHECKPOINT]) / layers
    assert linear_outputs <= per_block < scores / 2, (per_block, scores)
