"""One rank of the DDP tests: `python ddp_worker.py RANK WORLD PORT OUT MODE`.

MODE "plain": DDP without adaptmem. MODE "managed": DDP under adaptmem.manage, the
ranks given different device capacities, pressure injected on rank 1 only, and an
out-of-memory error injected in backward on rank 0 at step 3. MODE "contrastive": as
"managed", but each step runs two forwards before its backward, and no error is injected.
MODES "loop-plain" and "loop": as "plain" and "managed", on a model that runs two of its
blocks three times in each forward. Writes the final parameters and the step records to OUT.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root: stress

from helpers import tiny, tiny_batch


def main() -> None:
    rank, world, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    looped = mode.startswith("loop")
    if looped:
        from control.test_repeated_calls import RecurrentDepth, blocks_of, ids

        torch.manual_seed(0)
        model = RecurrentDepth()
        batches = [ids(2, 24 + 8 * ((i + rank) % 3), seed=10 * i + rank) for i in range(6)]
    else:
        model = tiny(dim=64, n_layers=4)
        batches = [tiny_batch(model, batch=2, seq=32 + 16 * ((i + rank) % 3)) for i in range(6)]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def train(batch):
        if looped:
            torch.nn.functional.cross_entropy(ddp(batch).flatten(0, 1), batch.flatten()).backward()
        elif mode == "contrastive":  # two forwards, one backward
            (ddp(**batch).loss + ddp(**batches[-1]).loss).backward()
        else:
            ddp(**batch).loss.backward()

    records = []
    if mode in ("plain", "loop-plain"):
        torch.manual_seed(7 + rank)
        for batch in batches:
            train(batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import adaptmem
        from adaptmem.config.policy import load_policy
        from adaptmem.testing import SimulatedDevice

        capacity = (9 if rank == 0 else 7) * 2**20
        dev = SimulatedDevice(capacity_bytes=capacity, name=f"rank{rank}")
        dev.track(model)
        fired = []

        def fail_in_backward(module, args, output):
            if rank == 0 and len(records) == 2 and not fired and mode == "managed":

                def fail(grad):
                    if not fired:
                        fired.append(1)
                        raise torch.OutOfMemoryError("injected out of memory in backward on rank 0")

                output.register_hook(fail)

        if not looped:
            model.blocks[2].register_forward_hook(fail_in_backward)
        policy = load_policy().model_copy(update={"sample_interval_s": 0.01})
        torch.manual_seed(7 + rank)
        selected = blocks_of(model) if looped else "auto"
        with dev, adaptmem.manage(ddp, budget="90%", device=dev, policy=policy, blocks=selected) as mem:
            for i, batch in enumerate(batches):
                if rank == 1 and i == 4:
                    dev.occupy(2 * 2**20)  # another process takes memory on this rank only
                    mem.sampler.wait_ticks(1)
                mem.run_step(train, batch, label={"i": i})
                opt.step()
                opt.zero_grad(set_to_none=True)
                records.append(mem.last_step)
            summary = mem.summary()
        records = [
            {k: r[k] for k in ("plan", "forward_plans", "observed_peak_bytes", "budget_bytes", "attempt", "step")}
            for r in records
        ]
        records.append({"summary": {k: summary[k] for k in ("steps", "ooms", "ooms_recovered", "pressure_events")}})
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "records": records}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
