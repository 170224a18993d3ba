import ast
import re

import pytest
import torch
from helpers import gpt2, llama, tiny
from torch import nn

import adaptmem
from adaptmem.demo.tiny import Block
from adaptmem.wrapping import find_blocks


def names(model, blocks="auto"):
    return [n for n, _ in find_blocks(model, blocks)]


def test_auto_finds_the_tiny_stack():
    assert names(tiny()) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_auto_finds_hf_llama_layers():
    assert names(llama(layers=3)) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_auto_finds_hf_gpt2_h():
    assert names(gpt2(layers=3)) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MoELayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_auto_prefers_the_outer_stack_over_longer_expert_lists():
    assert names(MoE()) == ["layers.0", "layers.1", "layers.2"]


class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.decoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


def test_auto_takes_every_stack_of_the_longest_length():
    assert names(EncDec()) == [f"encoder.{i}" for i in range(3)] + [f"decoder.{i}" for i in range(3)]


def test_auto_takes_the_stacks_that_hold_the_parameters_whatever_their_depth():
    """A vision-language model's vision tower and language model: the stacks of at least half the
    parameters of the largest are taken, so a vision tower deeper than the language model no longer
    leaves the language model (where the memory goes) unmanaged; a smaller tower is left out (its
    length is the image's, one every step, and would key the plans); an encoder beside its decoder
    is taken."""
    from helpers import quiet_transformers
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    quiet_transformers()

    def llava(vision_layers, vision_hidden, text_hidden):
        vision = CLIPVisionConfig(
            hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=vision_layers,
            num_attention_heads=4, image_size=32, patch_size=8,
        )  # fmt: skip
        text = LlamaConfig(
            vocab_size=512, hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=510))

    text = [f"model.language_model.layers.{i}" for i in range(2)]
    assert names(llava(6, 32, 128)) == text  # deeper, but a fifth of the language model's parameters
    assert names(llava(3, 64, 64)) == [f"model.vision_tower.encoder.layers.{i}" for i in range(3)] + text


def test_auto_takes_a_hybrid_stack_of_the_layer_classes_the_model_names():
    """Jamba's `model.layers` mixes attention and Mamba layers: both classes are in the model's
    `_no_split_modules`, the layers Hugging Face never splits, so the stack is its blocks (it was
    refused: "no blocks matched blocks='auto'")."""
    from helpers import quiet_transformers
    from transformers import JambaConfig, JambaForCausalLM

    quiet_transformers()
    config = JambaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, mamba_d_state=8,
    )  # fmt: skip
    model = JambaForCausalLM(config)
    assert names(model) == [f"model.layers.{i}" for i in range(4)]
    assert {type(m).__name__ for _, m in find_blocks(model)} == {"JambaAttentionDecoderLayer", "JambaMambaDecoderLayer"}


def test_class_class_name_and_tuple():
    model = tiny()
    assert names(model, Block) == names(model)
    assert names(model, "Block") == names(model)
    assert names(model, ("Attention", nn.LayerNorm))[:3] == ["blocks.0.norm1", "blocks.0.attn", "blocks.0.norm2"]


def test_regex_matches_whole_name_or_dotted_suffix():
    model = llama(layers=4)
    assert names(model, r"layers\.[02]") == ["model.layers.0", "model.layers.2"]
    assert names(model, r"model\.layers\.3") == ["model.layers.3"]
    assert names(model, r"mlp") == [f"model.layers.{i}.mlp" for i in range(4)]


def test_filter_function_and_module_list():
    model = tiny()
    picked = names(model, lambda m, n: n.endswith(".attn"))
    assert picked == [f"blocks.{i}.attn" for i in range(4)]
    assert names(model, [model.blocks[2], model.blocks[0]]) == ["blocks.0", "blocks.2"]


def test_a_list_of_names_is_answered_with_a_regex_that_selects_them():
    model = tiny()
    with pytest.raises(TypeError, match="got str 'blocks.1'") as err:
        find_blocks(model, ["blocks.1", "blocks.2"])
    suggested = ast.literal_eval(str(err.value).split("blocks=")[-1])
    assert names(model, suggested) == [f"blocks.{i}" for i in range(4)]


def test_nothing_matched_lists_what_the_model_has():
    with pytest.raises(ValueError) as err:
        find_blocks(llama(layers=2), "DecoderBlockThatIsNotThere")
    text = str(err.value)
    assert "no blocks matched" in text
    assert "model.layers (2 x LlamaDecoderLayer)" in text
    assert "LlamaDecoderLayer x2" in text


def test_model_without_any_stack_is_explained():
    with pytest.raises(ValueError, match="Its module stacks: none"):
        find_blocks(nn.Linear(3, 3))


def test_nested_selection_is_rejected():
    model = tiny()
    with pytest.raises(ValueError, match="block 'blocks.0' contains block 'blocks.0.attn'"):
        find_blocks(model, [model.blocks[0], model.blocks[0].attn])


def test_a_regex_that_nests_is_answered_with_one_for_a_single_level():
    """A glob-minded `"blocks.*"` matches `blocks` itself and everything under it: the error
    says it is a regex on the whole name and gives one that selects the numbered blocks."""
    model = tiny()
    with pytest.raises(ValueError, match="not a glob") as err:
        find_blocks(model, "blocks.*")
    assert "block 'blocks' contains block 'blocks.0'" in str(err.value)
    suggested = ast.literal_eval(str(err.value).split("e.g. blocks=")[-1].rstrip(")"))
    assert names(model, suggested) == [f"blocks.{i}" for i in range(4)]


def test_a_regex_that_nests_by_a_dotted_suffix_says_so_and_gives_a_filter_that_works():
    """`^[0-3]$` on a Sequential of Sequentials takes `0` by its whole name and `0.0` by its
    suffix `0`: the error says which, and the filter it offers selects the four stages."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(4)])
    with pytest.raises(ValueError, match="any dotted suffix") as err:
        find_blocks(model, r"^[0-3]$")
    text = str(err.value)
    assert "'0.0' ends in '0'" in text and "not a glob" not in text
    suggested = eval("lambda module, name: " + text.split("blocks=lambda module, name: ")[-1][:-1], {"re": re})
    assert names(model, suggested) == ["0", "1", "2", "3"]


def test_foreign_module_and_bad_types():
    model = tiny()
    with pytest.raises(ValueError, match="is not a submodule"):
        find_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        find_blocks(model, int)
    with pytest.raises(ValueError, match="neither a class name in the model nor a valid regex"):
        find_blocks(model, "blocks.(")
    with pytest.raises(ValueError, match=r"block class name\(s\) \['Nope'\] do not occur"):
        find_blocks(model, ("Block", "Nope"))
    with pytest.raises(TypeError, match="blocks must be 'auto'"):
        find_blocks(model, 3.5)


def test_instrument_uses_the_same_selection_rules():
    model = tiny()
    handles = adaptmem.instrument(model, r"blocks\.[13]")
    assert [h.name for h in handles] == ["blocks.1", "blocks.3"]
    assert [h.index for h in handles] == [0, 1]
    assert handles[0].module is model.blocks[1]
    x = torch.randint(0, 128, (1, 8))
    model(x)  # still runs


def test_auto_takes_a_lone_layer_of_the_blocks_class_outside_the_stacks():
    """A recurrent-depth model's coda, one layer of the stacks' class outside them (an attribute of
    its own, or the one layer of a list): it ran unmanaged where `"auto"` left it out, silently."""
    from stress.loop_turns import Layer, RecurrentDepth

    model = RecurrentDepth()
    assert names(model) == ["prelude.0", "prelude.1", "core.0", "core.1", "coda"]
    model.coda = nn.ModuleList([Layer(32)])
    assert names(model) == ["prelude.0", "prelude.1", "core.0", "core.1", "coda.0"]
