"""The manager's lifecycle, as frameworks drive it: build, begin/end steps, close; and what it leaves behind."""

import gc
import logging
import threading
import weakref
from collections import Counter

import pytest
import torch
from helpers import tiny, tiny_batch

import adaptmem
from adaptmem import MemoryManager, Mode, PolicyError, read_log
from adaptmem.control.events import EventLog
from adaptmem.control.sampler import Sampler
from adaptmem.testing import SimulatedDevice, measure_peak

MiB = 2**20


def device():
    return SimulatedDevice(capacity_bytes=2**31)


def train(model, seq=32):
    model(**tiny_batch(model, seq=seq)).loss.backward()
    model.zero_grad(set_to_none=True)


def untouched(model, keys):
    return (
        adaptmem.get_handles(model) == []
        and "_adaptmem_instrumentation" not in model.__dict__
        and all("forward" not in m.__dict__ for m in model.modules())
        and list(model.state_dict()) == keys
    )


def test_built_without_with_and_closed_twice_records_one_end(tmp_path):
    model = tiny()
    path = tmp_path / "run.jsonl"
    mem = MemoryManager(model, budget="1GiB", device=device(), log=str(path))
    with mem.step():
        train(model)
    mem.close()
    mem.close()
    assert [r["type"] for r in read_log(path)].count("end") == 1
    assert adaptmem.get_handles(model) == [] and not mem.sampler.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        mem.begin_step()
    with pytest.raises(RuntimeError, match="closed"):  # it was taken, and changed nothing
        mem.set_budget("512MiB")
    with MemoryManager(model, budget="1GiB", device=device()) as again:  # itself a context manager
        with again.step():
            train(model)
    assert again.summary()["steps"] == 1 and adaptmem.get_handles(model) == []


def test_begin_and_end_step_carry_a_label_and_step_is_built_on_them():
    model = tiny()
    with adaptmem.manage(model, budget="1GiB", device=device()) as mem:
        mem.begin_step(label={"global_step": 7, "micro_batch": 1})
        train(model)
        record = mem.end_step()
        assert record["type"] == "step" and record["label"] == {"global_step": 7, "micro_batch": 1}
        with mem.step(label="second"):
            train(model)
        assert mem.last_step["label"] == "second" and mem.last_step["step"] == 2
        with pytest.raises(RuntimeError, match="without an open step"):
            mem.end_step()
        mem.begin_step()
        with pytest.raises(RuntimeError, match="steps do not nest"):
            mem.begin_step()
        with pytest.raises(RuntimeError, match="Lightning callback runs each training_step"):
            mem.run_step(train, model)  # as inside a step a framework's integration runs already
        oom = mem.end_step(error=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB"))
        assert oom["type"] == "oom" and oom["phase"] == "before the first managed block"
        mem.begin_step()
        assert mem.end_step(error=KeyError("not ours")) is None  # dropped, not counted
        assert mem.summary()["steps"] == 2 and mem.summary()["ooms"] == 1


@pytest.mark.parametrize(
    "case", ["policy", "policy-type", "budget", "blocks", "log", "device", "device-name", "thread"]
)
def test_a_failed_construction_leaves_the_model_as_it_was(tmp_path, monkeypatch, case):
    model = tiny()
    keys = list(model.state_dict())
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    kwargs = {"budget": "1GiB", "device": device()}
    expected = {
        "policy": PolicyError,
        "policy-type": TypeError,
        "budget": ValueError,
        "blocks": ValueError,
        "log": OSError,
        "device": ValueError,
        "device-name": ValueError,
        "thread": RuntimeError,
    }[case]
    if case == "policy":
        kwargs["policy"] = "no-such-preset"
    elif case == "policy-type":
        kwargs["policy"] = 3
    elif case == "device-name":
        kwargs["device"] = "tpu"
    elif case == "budget":
        kwargs["budget"] = "4GiB"
    elif case == "blocks":
        kwargs["blocks"] = "Nope"
    elif case == "log":
        kwargs["log"] = str(not_a_dir / "run.jsonl")
    elif case == "device":
        kwargs["device"] = 3.5
    else:
        monkeypatch.setattr(
            Sampler, "start", lambda self: (_ for _ in ()).throw(RuntimeError("can't start new thread"))
        )
    with pytest.raises(expected) as raised:
        MemoryManager(model, **kwargs)
    assert untouched(model, keys)
    if case == "log":
        assert "cannot write the decision log at" in str(raised.value) and "log=None" in str(raised.value)


def test_a_failed_construction_keeps_a_users_instrumentation(monkeypatch):
    model = tiny()
    handles = adaptmem.instrument(model)
    handles[1].mode = Mode.OFFLOAD
    monkeypatch.setattr(Sampler, "start", lambda self: (_ for _ in ()).throw(RuntimeError("can't start new thread")))
    with pytest.raises(RuntimeError):
        MemoryManager(model, budget="1GiB", device=device())
    assert adaptmem.get_handles(model) == handles and handles[1].mode is Mode.OFFLOAD
    assert handles[0].runtime.observer is None


def test_a_dropped_manager_keeps_nothing_alive_and_its_thread_ends(tmp_path):
    model = tiny()
    path = tmp_path / "run.jsonl"
    mem = MemoryManager(model, budget="1GiB", device=device(), log=str(path))
    with mem.step():
        train(model)
    sampler = mem.sampler
    model_ref, mem_ref = weakref.ref(model), weakref.ref(mem)
    del mem, model
    gc.collect()
    assert mem_ref() is None and model_ref() is None
    sampler.join(timeout=30)
    assert not sampler.is_alive()
    assert [r["type"] for r in read_log(path)][:2] == ["start", "plan"]  # the log was flushed and closed


def test_the_event_log_can_be_read_while_another_thread_writes():
    events = EventLog(None, keep=50_000)
    done = threading.Event()
    errors = []

    def writer():
        for i in range(20_000):
            events.emit("step" if i % 2 else "plan", step=i)
        done.set()

    def reader():
        try:
            while not done.is_set():
                events.of_type("step")
        except RuntimeError as err:  # "deque mutated during iteration" without the lock
            errors.append(err)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(events.of_type("step")) == 10_000


def test_the_log_is_appended_to_and_a_resumed_run_continues_it(tmp_path):
    path = tmp_path / "run.jsonl"
    model = tiny()
    with adaptmem.manage(model, budget="1GiB", device=device(), log=str(path)) as first:
        for _ in range(2):
            with first.step():
                train(model)
        state = first.state_dict()
    run = state["run"]
    before = read_log(path)
    with adaptmem.manage(model, budget="1GiB", device=device(), log=str(path)) as second:
        fresh = second.events.run_id
        second.load_state_dict(state)
        with second.step():
            train(model)
    records = read_log(path)
    assert records[: len(before)] == before  # nothing truncated
    assert fresh != run and records[len(before)]["run"] == fresh  # the new manager's start
    resumed = read_log(path, run=run)
    assert [r["step"] for r in resumed if r["type"] == "step"] == [1, 2, 3]
    assert next(r for r in resumed if r["type"] == "resume")["started_as"] == fresh


def test_an_environment_override_of_an_explicit_argument_says_so_once(monkeypatch, caplog):
    model = tiny()
    monkeypatch.setenv("ADAPTMEM_POLICY", "max-savings")
    monkeypatch.setenv("ADAPTMEM_BUDGET", "512MiB")
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        with adaptmem.manage(model, policy="balanced", budget="1GiB", device=device()) as mem:
            assert mem.policy.name == "max-savings" and mem.budget == 512 * MiB
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("adaptmem: ADAPTMEM_POLICY='max-savings' overrides policy='balanced' given in code") == 1
    assert lines.count("adaptmem: ADAPTMEM_BUDGET='512MiB' overrides budget='1GiB' given in code") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        adaptmem.manage(model, device=device()).close()  # nothing given in code: nothing overridden
    assert "overrides" not in caplog.text


def test_a_users_modes_are_the_starting_plan_and_come_back_on_close():
    model = tiny()
    handles = adaptmem.instrument(model)
    mine = [Mode.OFFLOAD, Mode.NONE, Mode.CHECKPOINT, Mode.NONE]
    for handle, mode in zip(handles, mine):
        handle.mode = mode
    with adaptmem.manage(model, budget="1GiB", device=device()) as mem:
        assert mem.handles == handles
        with mem.step():
            train(model)
        assert mem.last_step["plan_counts"] == dict(Counter(m.label for m in mine))
        with mem.step():
            train(model)
        assert mem.plan != dict(zip([h.name for h in handles], mine))  # the planner took over
    assert adaptmem.get_handles(model) == handles and [h.mode for h in handles] == mine


def test_set_budget_replans_the_blocks_not_yet_run():
    model = tiny(dim=128, n_layers=6, vocab_size=512)
    batch = tiny_batch(model, batch=4, seq=256)
    unmanaged = measure_peak(model, lambda: batch)
    dev = SimulatedDevice(capacity_bytes=int(unmanaged * 3))
    dev.track(model)
    seen = {}
    with dev, adaptmem.manage(model, budget="90%", device=dev) as mem:
        for _ in range(3):
            with mem.step():
                model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        assert set(mem.plan.values()) == {Mode.NONE}
        with pytest.raises(ValueError, match="larger than the device"):
            mem.set_budget("64GiB")

        def shrink(module, args):
            seen["bytes"] = mem.set_budget(int(unmanaged * 0.6))
            seen["modes"] = [h.mode for h in mem.handles]

        hook = mem.handles[2].module.register_forward_pre_hook(shrink)
        with mem.step():
            model(**batch).loss.backward()
        hook.remove()
        replanned = mem.last_step
        event = mem.events.last("budget")
        assert mem.set_budget("50%") == int(0.5 * dev.capacity_bytes)
    assert seen["bytes"] == int(unmanaged * 0.6) and event["budget_bytes"] == seen["bytes"]
    assert seen["modes"][:2] == [Mode.NONE, Mode.NONE]  # already ran
    assert any(m is not Mode.NONE for m in seen["modes"][2:]) and event["replanned_blocks"] > 0
    # the step is predicted as it ran, under the plan changed halfway, not the one it began with
    assert abs(replanned["prediction_error"]) < 0.10, replanned["prediction_error"]


def test_a_manager_whose_steps_are_never_marked_warns_once(caplog):
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        with adaptmem.manage(model, budget="1GiB", device=device()):
            for _ in range(3):
                train(model)
    warnings = [r for r in caplog.records if "outside a marked step" in r.getMessage()]
    assert len(warnings) == 1 and "calibration" in warnings[0].getMessage()


def test_the_users_peak_readings_are_the_users():
    """The manager cuts a step at block boundaries through a peak window of its own:
    the device's `peak_bytes` still measures what the user reset it for."""
    model = tiny(dim=128, n_layers=4)
    truth = SimulatedDevice()
    dev = SimulatedDevice(capacity_bytes=2**31)
    truth.track(model)
    dev.track(model)
    with truth, dev, adaptmem.manage(model, budget="1GiB", device=dev) as mem:
        for _ in range(2):
            truth.reset_peak()
            dev.reset_peak()
            with mem.step():
                model(**tiny_batch(model, batch=4, seq=128)).loss.backward()
            model.zero_grad(set_to_none=True)
            assert dev.peak_bytes == truth.peak_bytes == mem.last_step["observed_peak_bytes"]


def test_a_resumed_run_says_its_own_steps_peak_and_errors_apart_from_the_runs():
    """The counters go on from the saved state (the run's steps, peak and out-of-memory errors), and
    `since_resumed` holds this manager's own: a resumed Trainer read its earlier process's peak, over
    the budget, as if it had run over it itself."""
    from adaptmem.testing import OutOfMemoryInjector

    model = tiny()
    big, small = tiny_batch(model, 4, 64), tiny_batch(model, 1, 16)
    injector = OutOfMemoryInjector(model.blocks)
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        dev.track(model)
        with adaptmem.manage(model, budget="1GiB", device=dev) as first:
            injector.arm(1, "forward")
            for _ in range(2):
                first.run_step(lambda: model(**big).loss.backward())
            state, ran = first.state_dict(), first.summary()
        own = ("steps", "ooms", "ooms_recovered", "steps_over_budget", "peak_bytes")
        assert ran["since_resumed"] == {k: ran[k] for k in own}
        with adaptmem.MemoryManager(model, budget="1GiB", device=dev, state=state) as second:
            second.run_step(lambda: model(**small).loss.backward())
            now = second.summary()
    assert (now["steps"], now["ooms"], now["ooms_recovered"], now["peak_bytes"]) == (3, 1, 1, ran["peak_bytes"])
    assert now["since_resumed"] == {
        "steps": 1,
        "ooms": 0,
        "ooms_recovered": 0,
        "steps_over_budget": 0,
        "peak_bytes": second.last_step["observed_peak_bytes"],
    }
    assert now["since_resumed"]["peak_bytes"] < ran["peak_bytes"]


def test_the_steps_over_the_budget_are_counted_across_a_resume():
    """`steps_over_budget` goes on from the saved state like the other counters (a bert2bert resumed
    after its first step over the budget counted 2 of the run's 3)."""
    model = tiny()
    batch = tiny_batch(model, 4, 64)
    with SimulatedDevice(capacity_bytes=2**30) as dev:
        dev.track(model)
        with adaptmem.manage(model, budget="1GiB", device=dev) as first:
            first.run_step(lambda: model(**batch).loss.backward())
            floor = first._controller.recorder.probe.allocated()
            peak = first.last_step["observed_peak_bytes"]
            for share in (0.97, 0.95, 0.5):  # of the way from the step's start to its peak
                first.set_budget(int(floor + share * (peak - floor)))
                first.run_step(lambda: model(**batch).loss.backward())
            state, ran = first.state_dict(), first.summary()
        with adaptmem.MemoryManager(model, budget="1GiB", device=dev, state=state) as second:
            second.run_step(lambda: model(**batch).loss.backward())
            now = second.summary()
    assert ran["steps_over_budget"] >= 2 and now["steps_over_budget"] == ran["steps_over_budget"]
    assert now["since_resumed"]["steps_over_budget"] == 0


def test_a_step_over_the_budget_is_warned_of_at_the_first_and_at_each_twice_as_far_over(caplog):
    """Said once a run, the warning left a bert2bert's steps 13 and 18 MiB over the budget unsaid
    after a first one 0.8 MiB over: a step more than twice as far over as any said before is said too."""
    from adaptmem.control.notices import Notices

    notices, budget = Notices(), 100 * 2**20
    with caplog.at_level("WARNING", logger="adaptmem"):
        for step, over in enumerate((1.0, 1.5, 2.0, 2.5, 0.5, 6.0, 9.0), 1):  # MiB over the budget
            notices.over_budget(step, budget + int(over * 2**20), budget, 0.9 * budget, "NONE x4", step)
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(" peaked")[0] for m in said] == ["adaptmem: step 1", "adaptmem: step 4", "adaptmem: step 6"]
    assert "The plans after it count what it showed" in said[0]
    assert "further over than any step before it (6 steps over the budget so far)" in said[2]
