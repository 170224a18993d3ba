"""FSDP2 (`fully_shard`) on the CPU with gloo: adaptmem's wrappers sit inside the sharded
blocks, keep their names, and every lossless mode gives the gradients of unmanaged FSDP."""

import pytest
import torch
import torch.distributed as dist
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES
from adaptmem.testing import SimulatedDevice

fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded():
    model = tiny()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    return model


def full_grads(model):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }


def test_every_lossless_mode_inside_fully_shard_is_exact(group):
    batch = tiny_batch(tiny())
    reference = sharded()
    torch.manual_seed(1)
    reference(**batch).loss.backward()
    expected = full_grads(reference)
    for mode in LOSSLESS_MODES:
        model = sharded()
        handles = adaptmem.instrument(model, mode=mode)
        assert [h.name for h in handles] == [f"blocks.{i}" for i in range(4)]
        torch.manual_seed(1)
        model(**batch).loss.backward()
        got = full_grads(model)
        assert all(torch.equal(got[n], expected[n]) for n in expected), mode.label


def test_a_managed_fully_sharded_model_trains(group):
    model = sharded()
    with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
        for seq in (32, 48, 32):
            mem.run_step(lambda s=seq: model(**tiny_batch(model, seq=s)).loss.backward())
            model.zero_grad(set_to_none=True)
        assert mem.summary()["steps"] == 3
    assert adaptmem.get_handles(model) == []


def test_blocks_are_found_as_users_name_them_before_and_after_fully_shard(group):
    """`fully_shard` swaps each block's class for an FSDP subclass (`FSDPBlock`): a class name,
    "auto", a regex over module paths, a tuple of names and the class itself select the same
    blocks as before it, and the error for a name that is absent lists the names as written."""
    from adaptmem.wrapping.selection import class_name, find_blocks

    before = tiny()
    block_class = type(before.blocks[0])
    selections = ["auto", block_class.__name__, r"blocks\.\d+", (block_class.__name__,), block_class]
    expected = {str(s): [n for n, _ in find_blocks(before, s)] for s in selections}
    after = sharded()
    assert type(after.blocks[0]).__name__ == f"FSDP{block_class.__name__}"
    assert class_name(after.blocks[0]) == block_class.__name__
    for selection in selections:
        assert [n for n, _ in find_blocks(after, selection)] == expected[str(selection)], selection
    assert expected["auto"] == [f"blocks.{i}" for i in range(4)]
    with pytest.raises(ValueError) as err:
        find_blocks(after, ("NoSuchLayer",))
    assert block_class.__name__ in str(err.value) and f"FSDP{block_class.__name__}" not in str(err.value)
    wrapped = f"FSDP{block_class.__name__}"  # the name type(block).__name__ prints: the same blocks
    assert [n for n, _ in find_blocks(after, wrapped)] == expected["auto"]
    assert [n for n, _ in find_blocks(after, (wrapped,))] == expected["auto"]
    handles = adaptmem.instrument(after, blocks=block_class.__name__)
    assert [h.name for h in handles] == expected["auto"]
