"""Vision models built of stages: the automatic blocks are the layers inside the stages (the
granularity whose checkpointing saves more), and `measure_peak` keeps blocks chosen by hand."""

from __future__ import annotations

import pytest
import torch
from helpers import quiet_transformers

import adaptmem
from adaptmem import Mode
from adaptmem.testing import measure_peak
from adaptmem.wrapping import find_blocks, get_instrumentation


def resnet():
    quiet_transformers()
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return ResNetForImageClassification(
        ResNetConfig(
            embedding_size=16,
            hidden_sizes=[32, 64, 128, 256],
            depths=[3, 4, 6, 3],
            layer_type="bottleneck",
            num_labels=4,
        )
    )


def swin():
    quiet_transformers()
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    return SwinForImageClassification(
        SwinConfig(
            image_size=64, patch_size=4, embed_dim=16, depths=[2, 4], num_heads=[1, 2], window_size=4, num_labels=4
        )
    )


def pictures(px: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.randn(4, 3, px, px, generator=gen), "labels": torch.tensor([0, 1, 2, 3])}


@pytest.mark.parametrize(
    "make,px,stages,layers",
    [(resnet, 96, r"resnet\.encoder\.stages\.\d+", 16), (swin, 64, r"swin\.encoder\.layers\.\d+", 6)],
)
def test_the_automatic_blocks_of_a_staged_model_are_its_layers_and_save_more(make, px, stages, layers):
    model = make()
    auto = find_blocks(model)
    assert len(auto) == layers
    assert len(find_blocks(model, stages)) < layers
    batch = lambda: pictures(px)
    none = measure_peak(model, batch)
    per_layer = measure_peak(model, batch, mode=Mode.CHECKPOINT)
    adaptmem.instrument(model, blocks=stages)
    per_stage = measure_peak(model, batch, mode=Mode.CHECKPOINT)
    adaptmem.restore(model)
    assert per_layer < per_stage < none, (per_layer / none, per_stage / none)


def test_a_transformers_alike_layers_stay_the_blocks():
    """Layers alike in shape are the layers themselves, even with an expert list inside each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    assert [name for name, _ in find_blocks(model)] == [f"model.layers.{i}" for i in range(3)]


def test_measure_peak_keeps_the_blocks_a_model_was_instrumented_with():
    model = resnet()
    handles = adaptmem.instrument(model, blocks=r"resnet\.encoder\.stages\.\d+")
    assert len(handles) == 4
    peak = measure_peak(model, lambda: pictures(64), mode=Mode.CHECKPOINT)
    assert peak > 0
    assert [h.name for h in get_instrumentation(model).handles] == [h.name for h in handles]
    assert all(h.mode is Mode.NONE for h in handles)  # its own modes back
    adaptmem.restore(model)
