"""Blocks are named inside DDP and torch.compile wrappers: `manage(ddp)` and
`manage(ddp.module)` give the same names, and their state loads into the other."""

import torch
import torch.distributed as dist
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem.testing import SimulatedDevice


def test_ddp_and_its_module_give_the_same_names_and_loadable_state(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = tiny()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with adaptmem.manage(ddp, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as mem:
            with mem.step():
                ddp(**tiny_batch(model)).loss.backward()
            names, state = list(mem.plan), mem.state_dict()
            assert adaptmem.get_handles(ddp) == adaptmem.get_handles(model)
        assert names == [f"blocks.{i}" for i in range(4)]
        with adaptmem.manage(model, budget="1GiB", device=SimulatedDevice(capacity_bytes=2**31)) as plain:
            assert list(plain.plan) == names
            plain.load_state_dict(state)  # no "module." prefix to get in the way
        assert all("forward" not in m.__dict__ for m in model.modules())
    finally:
        dist.destroy_process_group()


def test_a_compiled_wrapper_is_looked_through():
    model = tiny()
    compiled = torch.compile(model, backend="aot_eager")
    handles = adaptmem.instrument(compiled)
    assert [h.name for h in handles] == [f"blocks.{i}" for i in range(4)]
    assert adaptmem.get_handles(model) == handles
    adaptmem.restore(compiled)
    assert adaptmem.get_handles(model) == []
