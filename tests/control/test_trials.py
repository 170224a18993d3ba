"""A mode no block has been measured in is tried once on one block, so its cost is measured, not guessed."""

from dataclasses import replace

import torch
from helpers import budget_between, hf_batch, llama

import adaptmem
from adaptmem import Mode
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice

# calibration at the longest, then shorter ones the budget still shapes, one of them twice
LENGTHS = [512, 256, 384, 256, 512]


def _trained(try_modes: bool, fraction: float = 0.5, then: tuple[int, ...] = (), link: float | None = 5e6):
    """A manager after AdamW steps at `LENGTHS` on a stand-in whose link is slow (`link`): the planner picks
    OFFLOAD for no step on its own, by its guessed time or by its measured one. With `then`, steps
    at those lengths after the question, and the answer after them (else the first answer twice)."""
    torch.manual_seed(0)
    make = lambda: llama(layers=4, hidden=64, dropout=0.0)
    model = make()
    budget, worst = budget_between(make, hf_batch(2, max(LENGTHS)), fraction)
    dev = SimulatedDevice(2 * worst, link_bytes_per_s=link)
    dev.track(model)
    update = {"modes": ("NONE", "CHECKPOINT", "OFFLOAD"), "try_modes": try_modes}
    policy = load_policy("balanced").model_copy(update=update)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mem = adaptmem.manage(model, device=dev, budget=budget, policy=policy, head=None)

    def train(lengths) -> None:
        for seq in lengths:
            mem.run_step(lambda: model(**hf_batch(2, seq)).loss.backward())
            opt.step()
            opt.zero_grad(set_to_none=True)

    with dev:
        train(LENGTHS)
        reach = after = mem.longest_sequence(2)
        if then:
            train(then)
            after = mem.longest_sequence(2)
    return mem, reach, after


def test_a_mode_no_block_ran_is_tried_on_one_block_once_measured_and_counted_in_the_reach():
    mem, reach, _ = _trained(True)
    trials = [p for p in mem.events.of_type("plan") if "trial" in p["reason"]]
    assert len(trials) == 1 and trials[0]["reason"].endswith("trial OFFLOAD"), trials
    assert list(trials[0]["plan"].values()).count("OFFLOAD") == 1
    steps = mem.events.of_type("step")
    tried = [s for s in steps if "OFFLOAD" in s["plan"]]
    assert len(tried) == 1 and tried[0]["step"] == trials[0]["step"], [s["plan"] for s in steps]
    assert tried[0]["measured"] == "blocks"
    block = tried[0]["plan"].index("OFFLOAD")
    assert Mode.OFFLOAD in mem._controller.costs.direct[block]
    # the step after the trial has its plan made from what the trial showed
    after = [p for p in mem.events.of_type("plan") if p["step"] == tried[0]["step"] + 1]
    assert after and "trial" not in after[0]["reason"]

    # without trials no step offloads, OFFLOAD's backward stays the guess (all its tensors back at
    # once), and the longest sequence is predicted under checkpointing alone
    guessed, short, _ = _trained(False)
    assert not any("OFFLOAD" in s["plan"] for s in guessed.events.of_type("step"))
    assert Mode.OFFLOAD in reach.plan and Mode.OFFLOAD not in short.plan
    assert reach.length > 1.3 * short.length, (reach, short)


def test_no_mode_is_tried_where_the_plan_has_every_block_in_its_fastest_mode_until_a_reach_is_asked():
    """With room for every block in NONE no mode is tried, until "how long can I go?" is asked: its answer
    names the modes it counted by a guess, and the next step tries one on a block (even with every block
    in its fastest mode), so that the answer asked after it counts what it showed, and no longer names it."""
    # a budget past the unmanaged peak (every block NONE), a link that copies at once
    mem, reach, after = _trained(True, fraction=1.5, then=(512, 256), link=None)
    asked = len(LENGTHS)
    assert all(set(s["plan"]) == {"NONE"} for s in mem.events.of_type("step")[1:asked])
    assert not any("trial" in p["reason"] for p in mem.events.of_type("plan") if p["step"] <= asked)
    assert reach.untried == ("OFFLOAD",) and reach.trying and Mode.OFFLOAD not in reach.plan
    said = "OFFLOAD not measured on this model's blocks yet: counted by a guess"
    assert said in str(reach)
    tried = [s for s in mem.events.of_type("step") if "OFFLOAD" in s["plan"]]
    assert len(tried) == 1 and tried[0]["measured"] == "blocks", [s["plan"] for s in mem.events.of_type("step")]
    assert after.untried == () and "not run on this model" not in str(after)
    assert after.length > reach.length, (reach, after)
    off = _trained(False, fraction=1.5)[1]  # trials off: named, and said so
    assert off.untried == ("OFFLOAD",) and "try_modes is off" in str(off)


def test_a_mode_is_tried_where_it_fits_once_and_its_step_measured_block_by_block():
    """Where it is predicted to fit the aim, else not at all; once, even where its step
    taught nothing; the plan made again once the cost model learned; and the step that tries it
    measured block by block where the bucket's schedule would read its peak alone."""
    mem, _, _ = _trained(False)
    ctl = mem._controller
    book = ctl.plans
    book.policy = book.policy.model_copy(update={"try_modes": True})
    key, cached = max(book.cache.items(), key=lambda kv: kv[0][1])  # the longest
    shape, start = (key[0], cached.seen), cached.start
    plan = tuple(Mode.CHECKPOINT for _ in cached.modes)
    swapped = [book.predict(plan[:i] + (Mode.OFFLOAD,) + plan[i + 1 :], *shape, 0) for i in range(len(plan))]
    lowest = min(range(len(plan)), key=lambda i: swapped[i])

    def budget_for(above: float) -> int:  # the smallest budget whose aim reaches `above`
        low, high = 1, 64 * ctl.budget
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if book._aim(start, mid) < above else (low, mid)
        return low

    assert book._trial(plan, None, shape, start, budget_for(swapped[lowest]) - 1, {}) is None
    assert not book.trials  # not tried where it did not fit: still to be tried
    roomy = budget_for(swapped[lowest])
    tried = book._trial(plan, None, shape, start, roomy, {})
    assert tried is not None and tried[0] == plan[:lowest] + (Mode.OFFLOAD,) + plan[lowest + 1 :]
    assert tried[1] is Mode.OFFLOAD and tried[2] == start + swapped[lowest]
    assert book._trial(plan, None, shape, start, roomy, {}) is None  # once
    # a batch given up leaves no trace: a trial made for it and never run is to be made again
    book.trials.clear()
    kept = book.snapshot()
    assert book._trial(plan, None, shape, start, roomy, {}) is not None
    book.restore(kept, costs_changed=False)
    assert book._trial(plan, None, shape, start, roomy, {}) is not None
    # where it fits on every block, on the first of those whose mode is the tightest
    book.trials.clear()
    mixed = (Mode.NONE,) + plan[1:-1] + (Mode.NONE,)
    peaks = [book.predict(mixed[:i] + (Mode.OFFLOAD,) + mixed[i + 1 :], *shape, 0) for i in range(len(plan))]
    anywhere = book._trial(mixed, None, shape, start, budget_for(max(peaks)), {})
    assert anywhere[0] == (Mode.NONE, Mode.OFFLOAD) + mixed[2:], anywhere

    # cached and learned from since, the trial's plan is made again, not run a second time
    ran = replace(cached, modes=tried[0], trial=Mode.OFFLOAD, learned=book.costs.steps_learned - 1)
    book.cache[key] = ran
    assert book.choose(key[0], cached.seen, start, roomy) is not ran

    # a plan that runs a mode on its guess (here a block pinned in it) is measured as a trial is
    book.pin({0: Mode.OFFLOAD})
    pinned = book.make(key, start, roomy, fixed={}, reason="replan", extent=cached.seen)
    assert pinned.modes[0] is Mode.OFFLOAD and pinned.guessed and pinned.trial is None and "trial" not in pinned.reason
    assert ctl.measuring.worth(pinned)
    book.pin({})

    light = [ctl.measuring.worth(cached) for _ in range(3)]
    assert light[1:] == [False, False], light  # its schedule: the peak alone
    assert ctl.measuring.worth(replace(cached, trial=Mode.OFFLOAD))


def test_an_answer_names_the_classes_of_blocks_yet_to_run_a_mode_that_others_ran():
    """Where blocks of one kind ran a mode and blocks of another have not (a BLIP's vision layers
    and its text layers), the answer names the classes yet to run it: "not measured on this model's
    blocks" read wrong to a user who saw the vision layers run it at most steps."""

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Narrow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Linear(32, 32)

        def forward(self, x):
            return x + torch.tanh(self.mix(x))

    class Towers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList([Wide(), Wide(), Narrow(), Narrow()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

    model = Towers()
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    policy = load_policy("balanced").model_copy(update={"try_modes": False})
    N, S = Mode.NONE, Mode.SELECTIVE
    with (
        dev,
        adaptmem.manage(model, blocks=("Wide", "Narrow"), head=None, budget=2**29, device=dev, policy=policy) as mem,
    ):
        for plan in (None, (S, S, N, N), (S, S, N, N)):
            if plan is not None:
                mem._controller.plans.pin(dict(enumerate(plan)))
            mem.run_step(lambda: model(torch.randn(4, 64, 32)).backward())
            model.zero_grad(set_to_none=True)
        mem._controller.plans.pin({})  # every block the planner's to choose again
        answer = mem.longest_sequence(4)
    assert "SELECTIVE" in answer.untried and answer.untried_on == ("Narrow",)
    assert "SELECTIVE and OFFLOAD not measured on its Narrow blocks yet" in str(answer)
