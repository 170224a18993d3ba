"""adaptmem says nothing the user has no use for: no Lightning warning per figure when the
Trainer has no logger, and no KV-cache notice for the cache a Hugging Face model builds
from its config's default (`use_cache=True`); a cache the caller filled still gets it."""

import logging
import warnings

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")
import lightning.pytorch as pl
from helpers import lightning_trainer, quiet_transformers
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import adaptmem
from adaptmem import Mode
from adaptmem.integrations.lightning import AdaptMemCallback
from adaptmem.strategies.call import BlockCall
from adaptmem.strategies.recompute import without_cache
from adaptmem.testing import SimulatedDevice

CACHE_NOTICE = "KV cache is not written in training"


class LitStack(pl.LightningModule):
    """Six linear + tanh blocks in a ModuleList, trained on a fixed target."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6)
        )

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for block in self.blocks:
            x = block(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lightning_fit_without_a_logger_gets_no_warning_from_adaptmems_figures():
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 16)), batch_size=4)
    dev = SimulatedDevice(capacity_bytes=2**31)
    callback = AdaptMemCallback(budget="1GiB", device=dev)
    trainer = lightning_trainer(max_steps=4, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught, dev:
        warnings.simplefilter("always")
        trainer.fit(LitStack(), data)
    assert callback.manager.summary()["steps"] == 4  # managed all along
    ours = [str(w.message) for w in caught if "adaptmem" in str(w.message)]
    assert ours == []


def neox() -> GPTNeoXForCausalLM:
    """A GPT-NeoX from a default-valued config (`use_cache=True`): each training call builds a
    cache and hands it to every layer, with `use_cache=True`, though the caller asked for none."""
    quiet_transformers()
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    assert config.use_cache  # the default, left as it is
    return GPTNeoXForCausalLM(config)


def test_a_model_whose_config_defaults_to_a_cache_trains_recomputing_without_a_cache_notice(caplog):
    model = neox()
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.isfinite(loss)
    assert [r.getMessage() for r in caplog.records if "cache" in r.getMessage()] == []


def test_the_notice_is_kept_for_a_cache_the_caller_filled_and_not_for_one_the_model_built():
    """The signal, block by block: a cache holding tokens at the block's own slot was passed by
    the caller (a prompt's keys, say; dropping it changes what the block attends to), while
    the one a model builds for itself is empty at a block's slot until that block runs."""
    from transformers import DynamicCache

    model = neox()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        filled = model(input_ids=ids[:, :16], use_cache=True).cache  # a prompt's keys and values
    layer = model.gpt_neox.layers[1]
    hidden = torch.randn(2, 16, 64)
    said = {}
    for name, cache in (("built", DynamicCache(config=model.config)), ("filled", filled)):
        said[name] = []
        call = BlockCall(
            module=layer,
            forward=layer.forward,
            args=(hidden,),
            kwargs={"cache": cache, "use_cache": True},
            mode=Mode.CHECKPOINT,
            warn_once=lambda key, message, said=said[name]: said.append(message),
        )
        _, kwargs = without_cache(call)
        assert kwargs["cache"] is None and kwargs["use_cache"] is False  # dropped either way
    assert said["built"] == []
    assert len(said["filled"]) == 1 and CACHE_NOTICE in said["filled"][0] and "GPTNeoXLayer" in said["filled"][0]
