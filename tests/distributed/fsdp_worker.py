"""One rank of the two-process FSDP2 tests: `python fsdp_worker.py RANK WORLD PORT OUT JOB`.

JOB "held": the model is built, sharded and trained for two AdamW steps inside a
SimulatedDevice; after forward, after backward and after the optimizer's step it
writes the stand-in's count beside the bytes torch holds, found without it: the
storages of every tensor Python can reach plus every tensor autograd saved.

JOB "loop": a model whose blocks run in a loop, FSDP2 alone and then managed (`loop`).

JOB "exact": 10 AdamW steps (dropout on) of FSDP2 without adaptmem, then of FSDP2
with every block in each lossless mode, `instrument` called before `fully_shard`
and after; then managed runs whose budget needs a mixed plan (`MANAGED`). Writes each
run's losses, last full gradients and final weights, and the managed runs' plans.
"""

import contextlib
import gc
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed import fsdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root: stress

from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import LOSSLESS_MODES
from adaptmem.config.policy import load_policy
from adaptmem.control.sharded import ShardedSteps, fsdp_modules
from adaptmem.testing import SimulatedDevice

STEPS = 10


def shard(model, reshard=True):
    for block in model.blocks:
        fsdp.fully_shard(block, reshard_after_forward=reshard)
    fsdp.fully_shard(model, reshard_after_forward=reshard)
    return model


def batches(rank):
    model = tiny()
    return [tiny_batch(model, batch=2, seq=24 + 8 * ((i + rank) % 3)) for i in range(STEPS)]


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model, data, rank, step=None, around=None):
    """STEPS AdamW steps (inside `around`, a context); returns the losses, the last step's
    full gradients and the weights, gathered after it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(7 + rank)
    losses = []
    with around or contextlib.nullcontext():
        for batch in data:
            opt.zero_grad(set_to_none=True)
            loss = _backward(model, batch) if step is None else step(batch)
            losses.append(loss.detach().clone())
            opt.step()
    return {
        "losses": losses,
        "grads": {n: full(p.grad) for n, p in model.named_parameters()},
        "params": {n: full(p) for n, p in model.named_parameters()},
    }


def _backward(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss


# ------------------------------------------------------------------ held
class Saved:
    """Every tensor autograd saves while entered, held weakly."""

    def __init__(self):
        self.refs = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        self.refs.append(weakref.ref(t))
        return t

    def tensors(self):
        return [t for t in (r() for r in self.refs) if t is not None]


def storages(tensors, device="cpu"):
    """{data pointer: bytes} of the storages on `device` holding `tensors`' values (a DTensor's in
    its local shard)."""
    found = {}
    for t in tensors:
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        if t.device.type != device:
            continue
        st = t.untyped_storage()
        if st.nbytes():
            found[st.data_ptr()] = st.nbytes()
    return found


def held_bytes(before, saved):
    """Bytes torch holds in storages made since `before` (a set of data pointers): what
    Python reaches plus what autograd saved."""
    gc.collect()
    reached = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)] + saved.tensors()
    return sum(n for ptr, n in storages(reached).items() if ptr not in before)


def _both_counts(phase, step, dev, before, saved):
    """(phase, step, the stand-in's count, the bytes torch holds), read when both stand still:
    gloo's worker thread lets go of a collective's buffers a moment after the collective returns
    (later on a loaded machine), and a buffer it made, which the stand-in (counting in this
    thread) never saw, or one freed between the two readings, made them differ by its size."""
    for _ in range(100):
        counted = dev.allocated_bytes
        held = held_bytes(before, saved)  # collects first: garbage in cycles is freed before it is read
        time.sleep(0.02)
        if dev.allocated_bytes == counted and held_bytes(before, saved) == held:
            break
    return phase, step, dev.allocated_bytes, held


def held(rank):
    gc.collect()
    keep = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]  # alive, so their pointers stay theirs
    before = set(storages(keep))
    figures = []
    with SimulatedDevice() as dev:
        model = shard(tiny())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i, batch in enumerate(batches(rank)[:2]):
            saved = Saved()
            with saved.hooks:
                loss = model(**batch).loss
            figures.append(_both_counts("forward", i, dev, before, saved))
            loss.backward()
            del loss
            figures.append(_both_counts("backward", i, dev, before, saved))
            opt.step()
            opt.zero_grad(set_to_none=True)
            figures.append(_both_counts("step", i, dev, before, saved))
    return {"figures": figures}


# ------------------------------------------------------------------ exact
def exact(rank):
    data = batches(rank)
    runs = {"plain": train(shard(tiny()), data, rank)}
    for mode in LOSSLESS_MODES:
        first = tiny()
        adaptmem.instrument(first, mode=mode)
        runs[f"{mode.label} before"] = train(shard(first), data, rank)
        after = shard(tiny())
        adaptmem.instrument(after, mode=mode)
        runs[f"{mode.label} after"] = train(after, data, rank)
    for name, reshard, failing in MANAGED:
        model = shard(tiny(), reshard)
        dev = SimulatedDevice(capacity_bytes=(6 if rank == 0 else 5) * 2**20, name=f"rank{rank}")
        if failing:
            model.blocks[2].register_forward_hook(_failing(rank, "device", [], 1, dev))
        policy = load_policy().model_copy(update={"modes": ("NONE", "CHECKPOINT")})  # chosen by memory alone
        mem = adaptmem.manage(model, policy=policy, budget="90%", device=dev)
        records = []

        def step(batch, mem=mem, records=records, model=model):
            loss = mem.run_step(_backward, model, batch)
            records.append({k: mem.last_step[k] for k in RECORDED})
            return loss

        runs[name] = train(model, data, rank, step, around=_both(dev, mem))
        runs[name]["records"] = records
    return runs


@contextlib.contextmanager
def _both(dev, mem):
    with dev, mem:
        yield


#: (name, reshard_after_forward, failing): the third runs out of memory on rank 0 in its second step,
#: where block 2's forward leaves one KiB free, and both ranks retry it
MANAGED = (("managed", True, False), ("managed, kept gathered", False, False), ("managed, retried", True, True))
RECORDED = ("plan", "seq", "observed_peak_bytes", "predicted_peak_bytes", "budget_bytes", "attempt")


# ------------------------------------------------------------------ refused
def refused(rank):
    """Bad input on both ranks, each in a fresh model: a budget below what a rank holds as its step
    starts (its shards, and AdamW's state once the first step made it), ranks started with different
    policies, and blocks that span two FSDP2 units. Returns each error as it reads, per case."""
    errors = {}
    cases = {
        "floor": (shard(tiny()), {"budget": 3 * 2**19}),
        "policy": (shard(tiny()), {"policy": load_policy().model_copy(update={"headroom": 0.9 if rank else 0.94})}),
        "split": (_split(tiny()), {}),
    }
    for case, (model, options) in cases.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dev = SimulatedDevice(capacity_bytes=2**30, name=f"rank{rank}")
        try:
            with dev, adaptmem.manage(model, device=dev, **{"budget": "90%", **options}) as mem:
                for batch in batches(rank)[:3]:
                    mem.run_step(_backward, model, batch)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        except ValueError as err:
            errors[case] = f"{type(err).__name__}: {err}"
    return errors


def _split(model):
    """Each block's attention and MLP sharded apart, then the model: a block spans two FSDP2 units."""
    for block in model.blocks:
        fsdp.fully_shard(block.attn)
        fsdp.fully_shard(block.mlp)
    return fsdp.fully_shard(model)


# ------------------------------------------------------------------ settle
def settle(rank):
    """FSDP2's all-gather, as a managed model runs it, 300 times: how many calls returned with
    gloo's worker still holding a reference to the output's storage (freed late, if FSDP2 freed
    it next). FSDP2's own communication does so in about one call in five on two busy cores."""
    model = shard(tiny())
    steps = ShardedSteps(fsdp_modules(model), check=lambda failed, phase: (failed, phase))
    steps.template = []  # as after a first step: no checks
    gather = fsdp_modules(model)[0]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
    count, late = torch._C._storage_Use_Count, 0
    for _ in range(300):
        out, inp = torch.empty(2 * 20000), torch.ones(20000)
        before = count(out.untyped_storage()._cdata)
        gather(out, inp, dist.group.WORLD)
        late += count(out.untyped_storage()._cdata) > before
    steps.close()
    return {"late": late}


# ------------------------------------------------------------------ retry
def retry(rank):
    """An out-of-memory error on rank 0 only, at step 3: raised in block 2's forward, raised in its
    backward, and (a third run) the stand-in's own, where block 2's forward leaves the device one
    KiB free; then raised in forward and in backward of the first step, before any step succeeded.
    Both ranks retry together and end where FSDP2 without adaptmem ends."""
    data = batches(rank)
    runs = {"plain": train(shard(tiny()), data, rank)}
    for where in ("forward", "backward", "device", "first forward", "first backward"):
        model = shard(tiny())
        fired = []
        dev = SimulatedDevice(capacity_bytes=2**28, name=f"rank{rank}")
        at = 0 if where.startswith("first") else len(data) // 3
        model.blocks[2].register_forward_hook(_failing(rank, where.removeprefix("first "), fired, at, dev))
        mem = adaptmem.manage(model, budget=2**27, device=dev)
        records = []

        def step(batch, mem=mem, records=records):
            loss = mem.run_step(_backward, model, batch)
            records.append({k: mem.last_step[k] for k in RECORDED})
            return loss

        runs[where] = train(model, data, rank, step, around=_both(dev, mem))
        runs[where]["records"] = records
        runs[where]["summary"] = mem.summary()
        runs[where]["fired"] = len(fired)
        runs[where]["comms after close"] = sorted({name for m in fsdp_modules(model) for name in _comms(m)})
    return runs


def _comms(module):
    """The names of the communication classes FSDP2 runs for `module`'s parameter groups."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        yield type(group._all_gather_comm).__name__
        yield type(group._reduce_scatter_comm).__name__


def _failing(rank, where, fired, at, dev):
    """A forward hook making an out-of-memory error once, on rank 0, at step `at`: raised in forward
    or in backward, or the stand-in's own at the next allocation, the device filled up to one KiB by
    a tensor that lives as long as the block's output."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if rank != 0 or fired or len(calls) != at + 1:
            return
        if where == "device":
            fired.append(1)
            output.balloon = torch.empty(dev.free_bytes - 1024, dtype=torch.uint8)
            return
        if where == "forward":
            fired.append(1)
            raise torch.OutOfMemoryError("out of memory in forward on rank 0")

        def fail(grad):
            if not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("out of memory in backward on rank 0")

        output.register_hook(fail)

    return hook


# ------------------------------------------------------------------ loop
def loop(rank):
    """A model that runs two of its blocks three times a forward, each block sharded: 5 AdamW steps
    of FSDP2 alone, then managed on stand-ins of different sizes, tight enough for mixed plans."""
    from control.test_repeated_calls import RecurrentDepth, blocks_of, ids

    data = [ids(4, 48 + 16 * ((i + rank) % 3), seed=10 * i + rank) for i in range(5)]

    def run(managed):
        torch.manual_seed(0)
        model = RecurrentDepth()
        for block in blocks_of(model):
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)

        def step(batch):
            loss = torch.nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
            loss.backward()
            return loss

        if not managed:
            return train(model, data, rank, step), []
        dev = SimulatedDevice(capacity_bytes=int((1.2 if rank == 0 else 1.1) * 2**20), name=f"rank{rank}")
        dev.track(model)
        plans = []
        with dev, adaptmem.manage(model, blocks=blocks_of(model), budget="90%", device=dev) as mem:
            result = train(model, data, rank, lambda batch: mem.run_step(step, batch))
            plans = [r["plan"] for r in mem.events.of_type("step")]
        return result, plans

    (plain, _), (managed, plans) = run(False), run(True)
    return {"plain": plain, "managed": managed, "plans": plans}


def main() -> None:
    rank, world, port, out, job = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    jobs = {"held": held, "exact": exact, "retry": retry, "refused": refused, "settle": settle, "loop": loop}
    result = jobs[job](rank)
    torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
