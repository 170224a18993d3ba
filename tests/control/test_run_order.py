"""Blocks that run in another order than they are indexed: plans sum what they hold as they run."""

import torch
from helpers import quiet_transformers

import adaptmem
from adaptmem import Mode
from adaptmem.control.planner import Option, plan, predicted_peak
from adaptmem.testing import SimulatedDevice


def test_a_plan_sums_what_the_blocks_hold_in_the_order_they_run():
    """Block 1 runs first: the peak at block 0's backward holds block 1's saved bytes too, and a
    plan chosen for that order keeps the block that runs last, whose need no earlier bytes add to."""
    MiB = 2**20
    big = [Option(Mode.NONE, 10 * MiB, 12 * MiB, 0.0), Option(Mode.CHECKPOINT, 1 * MiB, 12 * MiB, 1.0)]
    small = [Option(Mode.NONE, 1 * MiB, 2 * MiB, 0.0), Option(Mode.CHECKPOINT, MiB // 2, 2 * MiB, 0.1)]
    chosen = [big[0], small[0]]
    assert predicted_peak(chosen) == 12 * MiB  # indexed order: block 0 first
    assert predicted_peak(chosen, order=[1, 0]) == (1 + 12) * MiB
    assert plan([big, small], 12.6 * MiB).modes == (Mode.NONE, Mode.NONE)
    assert plan([big, small], 12.6 * MiB, order=[1, 0]).modes == (Mode.NONE, Mode.CHECKPOINT)


def test_a_dual_encoder_whose_second_tower_runs_first_is_predicted_as_it_runs():
    """A SigLIP registers its text tower first and runs its vision tower first. Learned in the order
    they run and planned in the order they are indexed, its plans were predicted 23 to 26% over
    their peaks (text layers kept, vision layers offloaded) or 3 to 6% under them (the vision tower's
    last layer kept: over the budget at every third step of a Trainer's run). Planned as they run,
    each plan, once it has run, is predicted within 3% of its peaks, and never under them. Every
    plan is pinned, so what is learned does not follow the machine's timings."""
    quiet_transformers()
    import transformers

    torch.manual_seed(0)
    config = transformers.SiglipConfig(
        text_config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=64,
            patch_size=4,
        ),
    )  # fmt: skip
    model = transformers.SiglipModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    dev = SimulatedDevice(capacity_bytes=28 * 2**20)
    dev.track(model)
    N, O = Mode.NONE, Mode.OFFLOAD
    with dev, adaptmem.manage(model, budget="90%", device=dev) as mem:
        names = [h.name for h in mem.handles]
        text = [i for i, n in enumerate(names) if n.startswith("text_model")]

        def steps(n: int) -> list[dict]:
            records = []
            for _ in range(n):
                pixels, ids = torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 256, (16, 32), generator=g)
                mem.run_step(lambda: model(pixel_values=pixels, input_ids=ids, return_loss=True).loss.backward())
                opt.step()
                opt.zero_grad(set_to_none=True)
                records.append(mem.last_step)
            return records

        # the warm-up pinned too: which plans a free warm-up runs follows the machine's timings, and
        # a step over its prediction leaves a margin on the next predictions for a while
        steps(1)  # every block measured recomputing
        mem._controller.plans.pin(dict(enumerate([O] * 5)))
        steps(2)  # and offloaded
        order = getattr(mem._controller.costs, "order", None)
        misses = {}
        # the text layers kept and the vision layers offloaded, then the reverse but the vision tower's last
        for plan in ([N if i in text else O for i in range(5)], [O, O, O, O, N]):
            mem._controller.plans.pin(dict(enumerate(plan)))
            ran = steps(4)[1:]  # the first measures the plan
            assert all(r["plan"] == [m.label for m in plan] for r in ran)
            misses[tuple(plan)] = [r["predicted_peak_bytes"] / r["observed_peak_bytes"] - 1 for r in ran]
    assert all(-0.005 <= m <= 0.03 for ms in misses.values() for m in ms), misses
    assert names[0].startswith("text_model") and [names[i] for i in order][0].startswith("vision_model")
