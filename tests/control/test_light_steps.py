"""What a steady step costs the controller, with nothing it decides changed: a light step's blocks
other than the first never call it (what the step records, decides and retries is what
it would have been had every block called it), and a moved bias remakes only the plans it may change."""

from __future__ import annotations

import pytest
import torch
from helpers import TickingProbe, budget_between, tiny, tiny_batch

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.control.recorder import StepRecorder
from adaptmem.testing import SimulatedDevice


class _Once:
    """A forward hook on one submodule that does `act` the first time it is armed and runs."""

    def __init__(self, module: torch.nn.Module, act) -> None:
        self.armed, self.act = False, act
        module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            self.act()


def _calls_in_step(mem, step) -> int:
    """Run `step` through `mem.run_step`; how many times the blocks called the controller's `block_start`."""
    ctl = mem._controller
    start, counted = ctl.block_start, [0]

    def counting(*args):
        counted[0] += 1
        return start(*args)

    ctl.block_start = counting
    try:
        mem.run_step(step)
    finally:
        del ctl.block_start
    return counted[0]


def _run(quiet: bool, monkeypatch) -> tuple[list[dict], list[int]]:
    """A managed run whose plans mix NONE and OFFLOAD, with an out-of-memory error raised
    inside block 3 in one steady step and the budget raised inside block 2 in another: every step's
    records, and the controller calls each step's blocks made."""
    if not quiet:
        monkeypatch.setattr(StepRecorder, "_go_quiet", lambda self, first: False)
    make = lambda: tiny(dim=128, n_layers=6, vocab_size=512)
    model = make()
    budget, _ = budget_between(make, tiny_batch(model, 4, 128), 0.5)
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    policy = load_policy("balanced").model_copy(
        update={"modes": ("NONE", "OFFLOAD"), "measure_every": 4, "sample_interval_s": 30.0}
    )
    oom = _Once(model.blocks[3].mlp, lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("injected")))
    moved = _Once(model.blocks[2].mlp, lambda: mem.set_budget(2 * budget))
    calls, records = [], []
    with dev, adaptmem.manage(model, budget=budget, device=TickingProbe(dev), policy=policy, head=None) as mem:
        for step, seq in enumerate([128] * 14 + [96] * 6 + [128] * 6 + [64] * 8):
            oom.armed, moved.armed = step == 12, step == 22
            if step < 26:
                fn = lambda batch=tiny_batch(model, 4, seq): model(**batch).loss.backward()
            else:  # two forwards, one backward
                fn = lambda a=tiny_batch(model, 4, seq), b=tiny_batch(model, 4, seq): (
                    model(**a).loss + model(**b).loss
                ).backward()
            calls.append(_calls_in_step(mem, fn))
            model.zero_grad(set_to_none=True)
        records = [{k: v for k, v in r.items() if k not in ("time", "run")} for r in mem.events.records]
    return records, calls


def test_light_steps_record_decide_and_retry_as_if_every_block_called(monkeypatch):
    quiet, quiet_calls = _run(True, monkeypatch)
    monkeypatch.undo()
    loud, loud_calls = _run(False, monkeypatch)
    steps = [r for r in quiet if r["type"] == "step"]
    light = [r for r in steps if r["measured"] == "peak"]
    # what the comparison covers: light steps with offloaded blocks, a retried failure, a mid-forward replan
    assert len(light) >= 10 and any(r["host_bytes"] > 0 for r in light)
    assert any(r["type"] == "oom" and r["phase"] == "forward" for r in quiet)
    moved = next(r["step"] for r in quiet if r["type"] == "budget")
    assert next(r for r in steps if r["step"] == moved)["measured"] == "peak"  # set inside a light step
    assert 1 in quiet_calls and 1 not in loud_calls  # the first block only, in light steps
    pairs = steps[-8:]  # and in each forward of light steps with two
    assert all(r["forward_plans"] for r in pairs) and sum(r["measured"] == "peak" for r in pairs) >= 4
    assert [c for c, r in zip(quiet_calls[-8:], pairs) if r["measured"] == "peak"].count(2) >= 4
    assert quiet == loud, _first_difference(quiet, loud)


def _first_difference(quiet: list[dict], loud: list[dict]) -> str:
    """The first record the two runs wrote apart, and the keys they differ in."""
    for i, (a, b) in enumerate(zip(quiet, loud)):
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            return f"record {i} ({a.get('type')}, step {a.get('step')}): {[(k, a.get(k), b.get(k)) for k in keys]}"
    return f"{len(quiet)} records against {len(loud)}"


def test_a_block_run_twice_in_a_light_step_is_seen_and_the_next_step_watches_every_block():
    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(5))
            self.again: int | None = None

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = torch.tanh(layer(x))
                if i == self.again:
                    x = torch.tanh(layer(x))
            return x.square().mean()

    model = Blocks()
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    policy = load_policy("balanced").model_copy(update={"measure_every": 1000, "sample_interval_s": 30.0})
    with dev, adaptmem.manage(model, budget=2**29, device=TickingProbe(dev), policy=policy) as mem:
        x = torch.randn(4, 8, 16)
        seen = []
        for step in range(12):
            model.again = 2 if step == 8 else None
            calls = _calls_in_step(mem, lambda: model(x).backward())
            model.zero_grad(set_to_none=True)
            seen.append((calls, mem.last_step["measured"], mem.last_step["prediction_error"]))
    assert seen[7][:2] == (1, "peak")  # light, and quiet
    assert seen[8][0] == 1 and seen[8][2] is None  # the block run twice: the step taught only its peak
    assert seen[9][0] == 5 and seen[10][0] == 1  # every block watched once, then quiet again


@pytest.mark.parametrize("quiet", [True, False])
def test_a_light_step_leaves_no_list_behind(quiet, monkeypatch):
    """Closing the step stops the blocks listing themselves, also after an error inside it."""
    if not quiet:
        monkeypatch.setattr(StepRecorder, "_go_quiet", lambda self, first: False)
    model = tiny(n_layers=3)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    batch = tiny_batch(model)
    with dev, adaptmem.manage(model, budget=2**29, device=TickingProbe(dev), head=None) as mem:
        for _ in range(8):
            mem.run_step(lambda: model(**batch).loss.backward())
        runtime = mem._runtime
        assert runtime.quiet is None
        with pytest.raises(ValueError, match="inside"):
            with mem.step():
                model(**batch)
                raise ValueError("inside")
        assert runtime.quiet is None


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_light_step_knows_when_its_backward_began(phase):
    """In a light step only the first block calls the recorder: the last one's output still marks
    where backward begins, so an out-of-memory error in the backward of a middle block is recorded
    as the backward's, and one in the last block's forward as the forward's."""
    model = tiny(n_layers=4)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    batch = tiny_batch(model)
    policy = load_policy("balanced").model_copy(update={"measure_every": 1000, "sample_interval_s": 30.0})
    armed = []
    squeeze = lambda: dev.set_capacity(dev.allocated_bytes // 2) if armed else None  # the next allocation fails
    if phase == "forward":  # in the last block's forward
        model.blocks[3].mlp.register_forward_hook(lambda *a: squeeze())
    else:  # in the backward of block 1 of 4, where backward began at block 3
        model.blocks[1].mlp.register_full_backward_hook(lambda *a: squeeze())
    with dev, adaptmem.manage(model, budget=2**29, device=TickingProbe(dev), policy=policy, head=None) as mem:
        for _ in range(8):
            mem.run_step(lambda: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
        assert mem.last_step["measured"] == "peak"
        armed.append(True)
        with pytest.raises(torch.OutOfMemoryError):
            with mem.step():
                model(**batch).loss.backward()
        armed.clear()
        dev.set_capacity(2**30)
    assert mem.events.of_type("oom")[-1]["phase"] == phase


@pytest.mark.parametrize("quiet", [True, False])
@pytest.mark.parametrize("turns", [2, 3, 4])
def test_a_light_step_of_a_loop_run_fewer_times_knows_when_its_backward_began(turns, quiet, monkeypatch):
    """A recurrent-depth model whose loop runs last: a forward of fewer turns ends at an earlier call
    of the core, which still marks where backward begins, so an out-of-memory error in the backward
    of the prelude is recorded as the backward's (it read as the forward's); a backward of a light
    step after such a step is one backward, not two."""
    from stress.loop_turns import RecurrentDepth, loss_of

    if not quiet:
        monkeypatch.setattr(StepRecorder, "_go_quiet", lambda self, first: False)
    torch.manual_seed(0)
    net = RecurrentDepth()
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(net)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    armed = []
    net.prelude[1].register_full_backward_hook(lambda *a: dev.set_capacity(dev.allocated_bytes // 2) if armed else None)
    policy = load_policy("balanced").model_copy(update={"measure_every": 1000, "sample_interval_s": 30.0})
    blocks = [*net.prelude, *net.core]  # the loop runs last
    probe = TickingProbe(dev)
    with dev, adaptmem.manage(net, blocks=blocks, budget=2**29, device=probe, policy=policy, head=None) as mem:
        samples = []
        for step, loops in enumerate((4, 4, 4, 4, 4, 4, 3, 4)):
            if step == 1:  # the recorder of the calls as blocks
                end = mem._controller.recorder.end
                mem._controller.recorder.end = lambda: samples.append(end()) or samples[-1]
            net.loops = loops
            mem.run_step(lambda: loss_of(net, ids).backward())
            net.zero_grad(set_to_none=True)
        with mem.step():  # two backwards
            loss = loss_of(net, ids)
            loss.backward(retain_graph=True)
            loss.backward()
        net.zero_grad(set_to_none=True)
        assert mem.last_step["measured"] == "peak" and len(mem.handles) == 10
        light = [s for s in samples if not s.detailed]
        assert len(light) >= 3 and [s.double_backward for s in light] == [False] * (len(light) - 1) + [True]
        net.loops = turns
        armed.append(True)
        with pytest.raises(torch.OutOfMemoryError):
            with mem.step():
                loss_of(net, ids).backward()
        armed.clear()
        dev.set_capacity(2**30)
    assert mem.events.of_type("oom")[-1]["phase"] == "backward"


def test_a_second_forward_in_a_light_step_is_seen_as_it_starts():
    """The first block, which lists itself in a light step, still calls the controller when it runs
    again: after the backward, the second forward is a second micro-batch (a step of its own); before
    it, the step's second forward, planned for what the first leaves."""
    model = tiny(n_layers=4)
    dev = SimulatedDevice(capacity_bytes=2**30)
    dev.track(model)
    a, b = tiny_batch(model, seq=32), tiny_batch(model, seq=32)
    policy = load_policy("balanced").model_copy(update={"measure_every": 1000, "sample_interval_s": 30.0})
    with dev, adaptmem.manage(model, budget=2**29, device=TickingProbe(dev), policy=policy, head=None) as mem:
        for _ in range(8):
            mem.run_step(lambda: model(**a).loss.backward())
            model.zero_grad(set_to_none=True)
        assert mem.last_step["measured"] == "peak"
        ctl, before = mem._controller, mem.steps
        planned = []
        second = ctl._plan_second_forward
        ctl._plan_second_forward = lambda shape: planned.append(shape) or second(shape)
        with mem.step(label="window"):
            model(**a).loss.backward()
            assert mem._runtime.quiet is not None  # light, and quiet
            model(**b).loss.backward()
        assert mem.steps == before + 2 and not planned
        model.zero_grad(set_to_none=True)
        with mem.step(label="pair"):
            (model(**a).loss + model(**b).loss).backward()
        assert len(planned) == 1
    steps = mem.events.of_type("step")[-3:]
    assert [r["label"] for r in steps] == ["window", "window", "pair"] and steps[0]["measured"] == "peak"


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_a_moved_bias_remakes_only_the_plans_it_may_change(fraction):
    """Far under its budget (every block in its fastest mode) a plan is kept when the predictions'
    bias moves: made again, it is the same plan. One the budget shaped is made again."""
    make = lambda: tiny(dim=128, n_layers=6, vocab_size=512)
    model = make()
    batch = tiny_batch(model, 4, 128)
    budget = 2**30 if fraction is None else budget_between(make, batch, fraction)[0]
    dev = SimulatedDevice(capacity_bytes=2**31)
    dev.track(model)
    policy = load_policy("balanced").model_copy(update={"sample_interval_s": 30.0})
    with dev, adaptmem.manage(model, budget=budget, device=TickingProbe(dev), policy=policy, head=None) as mem:
        ctl = mem._controller
        for _ in range(20):  # until the step's plan is held from one step to the next
            mem.run_step(lambda: model(**batch).loss.backward())
            model.zero_grad(set_to_none=True)
            if mem.steps > 3 and ctl.now.key in ctl.plans.cache:
                break
        key = ctl.now.key
        record = ctl.plans.cache[key]
        assert record.free == (fraction is None)
        assert set(record.modes) == {adaptmem.Mode.NONE} or fraction is not None
        ctl.decider.bias *= 0.85
        ctl.plans.rebiased(ctl.budget)
        assert (key in ctl.plans.cache) == (fraction is None)
        if fraction is None:  # kept: what the planner makes now is that plan
            again = ctl.plans.make(key, record.start, ctl.budget, fixed={}, reason="replan", extent=record.seen)
            assert (again.modes, again.head, again.free) == (record.modes, record.head, True)


def test_a_steps_plan_is_written_from_the_last_one_only_where_every_block_ran_it():
    """The step record's `plan` and `plan_counts`, kept from the step before where every block ran the
    same modes, are what they would be written afresh, as new lists each step; a block that did not run
    is written in the mode it runs in now."""
    from collections import Counter

    from adaptmem.control.blocks import ManagedBlocks
    from adaptmem.modes import Mode
    from adaptmem.wrapping import instrument

    blocks = ManagedBlocks(instrument(tiny(dim=32, n_layers=4, vocab_size=64), head=None), None)
    none, ck, off = Mode.NONE, Mode.CHECKPOINT, Mode.OFFLOAD

    def afresh(ran):
        labels = [ran.get(i, m).label for i, m in enumerate(blocks.running())]
        return labels, dict(Counter(m.label for m in ran.values()))

    for ran in (
        {0: none, 1: ck, 2: ck, 3: off},
        {0: none, 1: ck, 2: ck, 3: off},  # the same plan again
        {0: none, 1: ck, 2: none, 3: off},  # one block changed
        {0: ck, 1: ck},  # two blocks ran
        {0: none, 1: ck, 2: none, 3: off},
    ):
        got = blocks.described(dict(ran))
        assert got == afresh(ran), ran
        got[0].append("written over"), got[1].clear()  # a record changed by its reader changes no other
