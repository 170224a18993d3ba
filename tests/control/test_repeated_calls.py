"""Blocks a model calls more than once in one forward (shared layers): each call becomes a block of
its own, with its own mode, and a second forward is still told from a loop."""

import copy
import logging

import pytest
import torch
from helpers import albert, assert_same_state, training_state
from torch import nn

import adaptmem
from adaptmem import Mode
from adaptmem.testing import SimulatedDevice
from stress.loop_turns import RecurrentDepth, loss_of

transformers = pytest.importorskip("transformers")


class Outer(nn.Module):
    """What a LightningModule is to the model it calls: managed, its own forward never called."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def blocks_of(model: RecurrentDepth) -> list[nn.Module]:
    return [*model.prelude, *model.core, model.coda]


def ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


CALLS = ["prelude.0", "prelude.1", "core.0", "core.1", "core.0#2", "core.1#2", "core.0#3", "core.1#3", "coda"]


def test_each_call_of_a_block_run_in_a_loop_becomes_a_block_of_its_own(caplog):
    """The model inside a module whose forward is never called (as under Lightning): its core's
    calls become blocks in the order they ran, and training is exact."""
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    outer = Outer(net)
    lengths = (16, 48, 32, 64, 24)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(outer, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            for i, seq in enumerate(lengths):
                mem.run_step(lambda: loss_of(net, ids(2, seq, i)).backward())
            names = [h.name.removeprefix("net.") for h in mem.handles]
            assert [h.index for h in mem.handles] == list(range(9))
            steps = mem.events.of_type("step")
            blocks = mem.events.of_type("blocks")
    assert names == CALLS
    assert [len(s["plan"]) for s in steps] == [5, 9, 9, 9, 9]
    assert [b["step"] for b in blocks] == [1] and [n.removeprefix("net.") for n in blocks[0]["blocks"]] == CALLS
    said = [r.getMessage() for r in caplog.records]
    assert sum("calls a block more than once in each forward" in m for m in said) == 1
    assert "net.core.0 3 times, net.core.1 3 times" in next(m for m in said if "more than once" in m)
    assert not any("second forward" in m for m in said)
    assert all(s["forward_plans"] is None for s in steps)
    for i, seq in enumerate(lengths):
        loss_of(plain, ids(2, seq, i)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))
    # closed, the model is as it was
    assert all("forward" not in m.__dict__ for m in blocks_of(net))


def test_each_call_runs_in_its_own_mode_exactly():
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    adaptmem.instrument(net, blocks_of(net))
    handles = adaptmem.wrapping.repeat_calls(net, [0, 1, 2, 3, 2, 3, 2, 3, 4])
    modes = [Mode.NONE, Mode.CHECKPOINT, Mode.OFFLOAD, Mode.SELECTIVE, Mode.CHECKPOINT | Mode.OFFLOAD]
    modes = modes + [Mode.NONE, Mode.CHECKPOINT, Mode.OFFLOAD, Mode.CHECKPOINT]
    for handle, mode in zip(handles, modes):
        handle.mode = mode
    for seed in (1, 2):
        loss_of(net, ids(2, 16, seed)).backward()
        loss_of(plain, ids(2, 16, seed)).backward()
    assert [h.calls for h in handles] == [2] * 9
    assert [h.recomputes > 0 for h in handles] == [bool(m & (Mode.CHECKPOINT | Mode.SELECTIVE)) for m in modes]
    assert [h.host_bytes > 0 for h in handles] == [m is Mode.OFFLOAD for m in modes]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters()))
    adaptmem.restore(net)


def test_a_second_forward_of_a_model_with_a_loop_is_still_one(caplog):
    """Two forwards before one backward are told from a loop (the model's own forward ran again)
    and run as one step of two forwards; two micro-batches in one step are two steps, each running
    every call once; all exact."""
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            mem.run_step(lambda: loss_of(net, ids(2, 16, 0)).backward())
            for a, b in ((1, 2), (3, 4)):
                mem.run_step(lambda: (loss_of(net, ids(2, 16, a)) + loss_of(net, ids(2, 16, b))).backward())
            record = mem.last_step
            assert len(mem.handles) == 9
            calls = [h.calls for h in mem.handles]
            with mem.step(label="window"):  # two micro-batches: each runs every call once
                for seed in (5, 6):
                    loss_of(net, ids(2, 16, seed)).backward()
            assert [h.calls - c for h, c in zip(mem.handles, calls)] == [2] * 9
            window = [s for s in mem.events.of_type("step") if s["label"] == "window"]
    assert len(record["forward_plans"]) == 2 and all(len(p) == 9 for p in record["forward_plans"])
    assert sum("second forward before its backward" in r.getMessage() for r in caplog.records) == 1
    assert len(window) == 2 and all(s["forward_plans"] is None for s in window)
    loss_of(plain, ids(2, 16, 0)).backward()
    for a, b in ((1, 2), (3, 4)):
        (loss_of(plain, ids(2, 16, a)) + loss_of(plain, ids(2, 16, b))).backward()
    for seed in (5, 6):
        loss_of(plain, ids(2, 16, seed)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))


def test_micro_batches_in_the_first_step_are_micro_batches_while_the_loop_is_found(caplog):
    """The loop is found in the first micro-batch, whose step is read for its peak: the forward after
    its backward is a second micro-batch all the same, not a second forward (it was: one step of
    three forwards, and a warning of a contrastive loss)."""
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            with mem.step(label="window"):
                for seed in (1, 2, 3):
                    loss_of(net, ids(2, 16, seed)).backward()
            steps = mem.events.of_type("step")
            calls = [h.calls for h in mem.handles]
    assert [(s["label"], len(s["plan"]), s["forward_plans"]) for s in steps] == [
        ("window", 5, None),
        ("window", 9, None),
        ("window", 9, None),
    ]
    assert calls == [3, 3, 5, 5, 2, 2, 2, 2, 3]  # the first micro-batch's three calls on the module's first
    assert not any("second forward" in r.getMessage() for r in caplog.records)
    for seed in (1, 2, 3):
        loss_of(plain, ids(2, 16, seed)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))


def test_a_resumed_run_takes_the_saved_runs_blocks_per_call(caplog):
    torch.manual_seed(0)
    net = RecurrentDepth()
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            for i, seq in enumerate((16, 32, 24)):
                mem.run_step(lambda: loss_of(net, ids(2, seq, i)).backward())
            state = mem.state_dict()
        again = copy.deepcopy(net)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="adaptmem"):
            with adaptmem.MemoryManager(again, blocks=blocks_of(again), budget="1GiB", device=dev, state=state) as mem:
                assert [h.name for h in mem.handles] == CALLS  # before any step
                mem.run_step(lambda: loss_of(again, ids(2, 32, 5)).backward())
                record = mem.last_step
                plans = mem.events.of_type("plan")
        with adaptmem.manage(again, blocks=blocks_of(again)[:4], budget="1GiB", device=dev) as mem:
            with pytest.raises(ValueError, match="resume with the same model and block selection"):
                mem.load_state_dict(state)
    assert len(record["plan"]) == 9 and record["prediction_error"] is not None  # planned from what it learned
    assert all(p["reason"] != "calibrate" for p in plans)
    assert not any("more than once" in r.getMessage() for r in caplog.records)


def test_a_model_instrumented_before_managing_gets_its_blocks_back_as_they_were():
    torch.manual_seed(0)
    net = RecurrentDepth()
    handles = adaptmem.instrument(net, blocks_of(net), mode=Mode.CHECKPOINT)
    with SimulatedDevice(capacity_bytes=2**30) as dev, adaptmem.manage(net, budget="1GiB", device=dev) as mem:
        mem.run_step(lambda: loss_of(net, ids(2, 16, 0)).backward())
        assert len(mem.handles) == 9
    after = adaptmem.get_handles(net)
    assert after == handles and [h.mode for h in after] == [Mode.CHECKPOINT] * 5
    calls = [h.calls for h in after]
    loss_of(net, ids(2, 16, 1)).backward()  # one handle a module again: the core's counts its three calls
    assert [h.calls - c for h, c in zip(after, calls)] == [1, 1, 3, 3, 1]
    adaptmem.restore(net)
    assert all("forward" not in m.__dict__ for m in blocks_of(net))


def test_repeat_calls_keeps_a_block_not_called_in_its_place_and_refuses_an_unknown_one():
    net = RecurrentDepth()
    adaptmem.instrument(net, blocks_of(net))
    handles = adaptmem.wrapping.repeat_calls(net, [0, 1, 2, 3, 2, 3])  # the coda not called
    assert [h.name for h in handles] == ["prelude.0", "prelude.1", "core.0", "core.1", "core.0#2", "core.1#2", "coda"]
    with pytest.raises(ValueError, match="blocks are 0 to 4"):
        adaptmem.wrapping.repeat_calls(net, [0, 5])
    assert [h.name for h in adaptmem.wrapping.repeat_calls(net, None)] == CALLS[:4] + ["coda"]


def test_albert_shares_one_layer_and_each_of_its_calls_is_planned(caplog):
    """ALBERT runs its one layer `num_hidden_layers` times. Read as six forwards, its batches were
    priced six times over and a 2 x 512 batch was refused (predicted at 67.50 MiB against a
    36 MiB budget) where it trains at 18 to 26 MiB."""
    model = albert(layers=6, hidden=128, vocab=1000)
    plain = copy.deepcopy(model)
    lengths = (64, 256, 128, 512, 96, 384, 448, 200)

    def batch(i, seq):
        tokens = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens}

    policy = adaptmem.load_policy().model_copy(update={"head": "kept"})
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), SimulatedDevice(capacity_bytes=40 * 2**20) as dev:
        dev.track(model)
        with adaptmem.manage(model, blocks="AlbertLayer", budget="90%", device=dev, policy=policy) as mem:
            for i, seq in enumerate(lengths):
                mem.run_step(lambda: model(**batch(i, seq)).loss.backward())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            steps = mem.events.of_type("step")
            assert len(mem.handles) == 6 and mem.ooms == 0
    assert [s["seq"] for s in steps] == list(lengths)  # none refused
    assert all(s["observed_peak_bytes"] <= s["budget_bytes"] for s in steps)
    errors = [abs(s["prediction_error"]) for s in steps[4:]]
    assert sum(errors) / len(errors) < 0.15
    assert not any("second forward" in r.getMessage() for r in caplog.records)
    reference = torch.optim.AdamW(plain.parameters(), 1e-3)
    for i, seq in enumerate(lengths):
        plain(**batch(i, seq)).loss.backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
    assert_same_state(training_state(model, optimizer), training_state(plain, reference))


@pytest.mark.parametrize("compiled", ["blocks", "model"])
def test_a_loop_under_torch_compile_takes_its_calls_handles_and_stays_exact(compiled):
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    run = torch.compile(net, backend="aot_eager") if compiled == "model" else net
    # on the host: under the stand-in's dispatch mode, compiled code runs uncompiled
    with adaptmem.manage(run, blocks=blocks_of(net), budget="1GiB") as mem:
        if compiled == "blocks":
            adaptmem.compile_blocks(net, backend="aot_eager")
        for i in range(3):
            mem.run_step(
                lambda: torch.nn.functional.cross_entropy(
                    run(ids(2, 16, i)).flatten(0, 1), ids(2, 16, i).flatten()
                ).backward()
            )
        assert [h.name for h in mem.handles] == CALLS
    for i in range(3):
        loss_of(plain, ids(2, 16, i)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))


def core_calls(turns: int) -> list[str]:
    """The handles' names of a RecurrentDepth whose core ran `turns` times."""
    core = [f"core.{j}" + (f"#{t + 1}" if t else "") for t in range(turns) for j in range(2)]
    return ["prelude.0", "prelude.1", *core, "coda"]


def test_a_loop_run_longer_makes_its_added_turns_blocks_of_their_own(caplog):
    """A recurrent-depth model that draws its loop's count per batch: a forward with more turns than
    any before is neither a second forward (its calls count from each call of the module that runs
    the loop) nor planned as fewer blocks; its added turns become blocks at its end. Fewer turns leave
    the last blocks unrun. A second forward still starts from the first call. All exact."""
    torch.manual_seed(0)
    net = RecurrentDepth()
    plain = copy.deepcopy(net)
    outer = Outer(net)  # the model's own forward runs the loop; the managed module's never runs
    turns = (3, 4, 2, 4, 5, 1, 3)
    with caplog.at_level(logging.WARNING, logger="adaptmem"), SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(outer, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            for i, k in enumerate(turns):
                net.loops = k
                mem.run_step(lambda: loss_of(net, ids(2, 16 + 8 * i, i)).backward())
            net.loops = 4  # two forwards before one backward, the second with a turn fewer
            mem.run_step(
                lambda: (
                    loss_of(net, ids(2, 16, 10)) + (setattr(net, "loops", 3) or loss_of(net, ids(2, 16, 11)))
                ).backward()
            )
            two = mem.last_step
            names = [h.name.removeprefix("net.") for h in mem.handles]
            blocks = [(b["step"], len(b["blocks"])) for b in mem.events.of_type("blocks")]
            steps = mem.events.of_type("step")
            assert mem.ooms == 0 and mem.state_dict()["loop_owners"] == [["net", [2, 3]]]
    assert names == core_calls(5)
    assert blocks == [(1, 9), (2, 11), (5, 13)]
    assert [len(s["plan"]) for s in steps] == [5, 9, 11, 11, 11, 13, 13, 13]
    assert len(two["forward_plans"]) == 2
    said = [r.getMessage() for r in caplog.records]
    assert sum("more times than any before" in m for m in said) == 1
    assert "core.0 4 times, net.core.1 4 times" in next(m for m in said if "more times than any before" in m)
    assert sum("second forward" in m for m in said) == 1  # the step that ran two
    for i, k in enumerate(turns):
        plain.loops = k
        loss_of(plain, ids(2, 16 + 8 * i, i)).backward()
    plain.loops = 4
    (loss_of(plain, ids(2, 16, 10)) + (setattr(plain, "loops", 3) or loss_of(plain, ids(2, 16, 11)))).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), plain.parameters()))
    assert all("forward" not in m.__dict__ for m in blocks_of(net))
    assert not outer.net._forward_pre_hooks  # the count's hook is gone with the manager


def test_a_resumed_run_counts_its_loop_from_the_saved_runs_owner(caplog):
    torch.manual_seed(0)
    net = RecurrentDepth()
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            for i in range(2):
                mem.run_step(lambda: loss_of(net, ids(2, 16, i)).backward())
            state = mem.state_dict()
        again = copy.deepcopy(net)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="adaptmem"):
            with adaptmem.MemoryManager(again, blocks=blocks_of(again), budget="1GiB", device=dev, state=state) as mem:
                again.loops = 4
                mem.run_step(lambda: loss_of(again, ids(2, 16, 5)).backward())
                names = [h.name for h in mem.handles]
    assert state["loop_owners"] == [["", [2, 3]]]
    assert names == core_calls(4)
    assert not any("second forward" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("calls", "longer", "expected"),
    [
        ([0, 1, 2, 3, 2, 3, 2, 3, 4], {2: 4, 3: 4}, [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4]),
        ([0, 1, 2, 3, 2, 3, 2, 3, 4], {2: 5, 3: 5}, [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 4]),
        ([0, 0, 0], {0: 5}, [0] * 5),
        ([0, 1] * 3, {0: 4, 1: 4}, [0, 1] * 4),
        ([0, 1, 2, 3, 2, 3, 2, 3, 4], {2: 4}, None),  # one block of the turn ran again, not the turn
        ([0, 1, 2, 3, 2, 3, 2, 3, 4], {2: 4, 3: 5}, None),
        ([0, 1, 2, 1, 2, 3], {0: 2}, None),  # a block called once is no loop
    ],
)
def test_the_calls_of_a_loop_run_longer(calls, longer, expected):
    from adaptmem.control.loops import longer_calls

    assert longer_calls(calls, longer) == expected


def test_a_turn_no_step_has_measured_reads_as_its_modules_other_calls():
    """Turns a longer loop added, then steps with fewer: the last turns' blocks were never measured
    and read 0 bytes, so a step that ran every turn was predicted 18% to 22% under its peak and went
    over the budget (a recurrent-depth GPT drawing its turns per batch: 153 MiB against 144)."""
    torch.manual_seed(0)
    net = RecurrentDepth()
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        with adaptmem.manage(net, blocks=blocks_of(net), budget="1GiB", device=dev) as mem:
            for i, k in enumerate((3, 5, 2, 2, 3)):  # 13 blocks from the second step; turns 4 and 5 run once
                net.loops = k
                mem.run_step(lambda: loss_of(net, ids(2, 32, i)).backward())
            costs, names = mem._controller.costs, [h.name for h in mem.handles]
            unrun = [names.index(n) for n in ("core.0#5", "core.1#5")]
            assert all(not costs.latent[i]["activations"].points for i in unrun)  # never measured
            for i, twin in zip(unrun, (names.index("core.0"), names.index("core.1"))):
                mine, theirs = costs.figures(i, Mode.NONE, 2, 32 * 32), costs.figures(twin, Mode.NONE, 2, 32 * 32)
                assert mine.held >= theirs.held > 0  # derived from its latents, to err high
