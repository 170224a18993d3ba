"""The stand-in's host link: offloaded copies take time as on PCIe, their device bytes stay
counted while in flight, and the planner weighs the link's speed."""

import pytest
import torch
from helpers import assert_same, budget_between, step, tiny, tiny_batch

import adaptmem
from adaptmem import Mode
from adaptmem.config.policy import load_policy
from adaptmem.devices.link import SimulatedLink
from adaptmem.testing import SimulatedDevice

MiB = 2**20


class Clock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(round(seconds, 9))
        self.now += seconds


def _on_link_time(bytes_per_s: float) -> SimulatedDevice:
    """A stand-in whose link runs on a clock that only its waits move: a copy is in flight until
    compute waits for it (or for room in the window), however long compute takes on a busy machine."""
    dev = SimulatedDevice(link_bytes_per_s=bytes_per_s)
    clock = Clock()
    dev.link.clock, dev.link.sleep = clock, clock.sleep  # as a benchmark puts its own clock on the link
    return dev


def test_copies_queue_in_order_and_hold_their_device_bytes_until_they_arrive():
    clock = Clock()
    link = SimulatedLink(1 * MiB, latency_s=0.5, clock=clock, sleep=clock.sleep)  # 1 MiB/s
    a, b = torch.empty(MiB, dtype=torch.uint8), torch.empty(2 * MiB, dtype=torch.uint8)
    assert link.send(a) == pytest.approx(1.5) and link.send(b) == pytest.approx(4.0)  # queued behind a
    assert link.in_flight_bytes == 3 * MiB
    clock.now = 2.0
    link.poll()
    assert link.in_flight_bytes == 2 * MiB  # a arrived, b still travelling
    back = link.fetch(MiB, after=4.0)  # starts once b's copy is on the host... the other way
    assert back == pytest.approx(5.5)
    link.wait(back)
    assert clock.slept == [3.5] and link.in_flight_bytes == 0 and link.waited_s == pytest.approx(3.5)
    with pytest.raises(ValueError, match="link_bytes_per_s must be positive"):
        SimulatedLink(0)


def test_views_of_one_storage_move_their_own_elements_and_count_the_storage_once_in_flight():
    """q, k and v split from one projection travel as three views of one storage: each copy moves
    its own elements, and the device bytes in flight are the storage's, until its last view is over.
    Counted per view, the link moved the whole storage three times, and the bytes in flight read
    three times what the device holds, so a block's `held` read negative."""
    clock = Clock()
    link = SimulatedLink(1 * MiB, clock=clock, sleep=clock.sleep)
    qkv = torch.empty(3 * MiB, dtype=torch.uint8)
    q, k, v = qkv.split(MiB)
    assert [link.send(t) for t in (q, k, v)] == pytest.approx([1.0, 2.0, 3.0])  # a MiB each, not 3
    assert link.in_flight_bytes == link.peak_in_flight_bytes == 3 * MiB
    clock.now = 2.5
    link.poll()
    assert link.in_flight_bytes == 3 * MiB  # v still travelling keeps the storage
    window = SimulatedLink(1 * MiB, clock=clock, sleep=clock.sleep)
    window.send(q, limit=3 * MiB)
    window.send(k, limit=3 * MiB)  # its storage is in flight already: no wait
    assert clock.slept == [] and window.window_waits == 0
    clock.now = 10.0
    link.poll()
    assert link.in_flight_bytes == 0


def test_offload_over_a_link_is_exact_and_counts_copies_in_flight():
    model = tiny(dim=128)
    batch = tiny_batch(model, batch=4, seq=128)
    expected = step(model, batch)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)
    peaks = {}
    for name, speed in (("instant", None), ("slow", 200 * MiB)):
        dev = SimulatedDevice() if speed is None else _on_link_time(speed)
        dev.track(model)
        with dev:
            assert_same(step(model, batch), expected)
        peaks[name] = dev.peak_bytes
        if dev.link is not None:
            assert dev.link.waited_s > 0  # backward waited for copies to come back
            assert dev.link.peak_in_flight_bytes > 0
    assert peaks["slow"] > peaks["instant"]  # copies in flight kept their device bytes


def test_a_slow_link_makes_the_planner_offload_less_and_the_budget_holds():
    policy = load_policy().model_copy(update={"modes": ("NONE", "CHECKPOINT", "OFFLOAD")})
    make = lambda: tiny(dim=128, n_layers=4)
    batch = tiny_batch(make(), batch=4, seq=128)
    budget, high = budget_between(make, batch, 0.4)

    def offloaded_blocks(speed):
        model = make()
        dev = SimulatedDevice(capacity_bytes=2 * high, link_bytes_per_s=speed)
        truth = SimulatedDevice()
        dev.track(model)
        truth.track(model)
        peaks, counts = [], []
        with truth, dev, adaptmem.manage(model, policy=policy, budget=budget, device=dev) as mem:
            for _ in range(5):
                truth.reset_peak()
                mem.run_step(lambda: model(**batch).loss.backward())
                model.zero_grad(set_to_none=True)
                dev.link.wait(0.0)  # let copies still in flight land (none are needed any more)
                peaks.append(truth.peak_bytes)
                counts.append(sum(Mode.OFFLOAD.label in m for m in mem.last_step["plan"]))
        return counts[-1], peaks

    fast, fast_peaks = offloaded_blocks(64 * 2**30)
    slow, slow_peaks = offloaded_blocks(16 * MiB)
    assert fast > slow, (fast, slow)
    for peaks in (fast_peaks, slow_peaks):
        assert max(peaks[1:]) <= budget, [round(p / budget, 3) for p in peaks]


def test_a_full_window_makes_the_next_copy_wait_for_the_oldest():
    clock = Clock()
    link = SimulatedLink(1 * MiB, clock=clock, sleep=clock.sleep)
    tensors = [torch.empty(MiB, dtype=torch.uint8) for _ in range(4)]
    for t in tensors[:2]:
        link.send(t, limit=2 * MiB)
    assert link.in_flight_bytes == 2 * MiB and clock.slept == []
    link.send(tensors[2], limit=2 * MiB)  # full: waits until the first copy has arrived (t = 1 s)
    assert clock.slept == [1.0] and link.in_flight_bytes == 2 * MiB and link.window_waits == 1
    assert link.peak_in_flight_bytes == 2 * MiB


def test_the_window_bounds_the_device_bytes_offload_holds_in_flight():
    model = tiny(dim=128, n_layers=4)
    batch = tiny_batch(model, batch=4, seq=128)
    expected = step(model, batch)
    results = {}
    for name, limit in (("unbounded", 2**40), ("bounded", 2 * MiB)):
        adaptmem.restore(model)
        adaptmem.instrument(model, mode=Mode.OFFLOAD, offload=adaptmem.OffloadOptions(max_in_flight_bytes=limit))
        dev = _on_link_time(100 * MiB)
        dev.track(model)
        with dev:
            assert_same(step(model, batch), expected)
        results[name] = (dev.peak_bytes, dev.link.peak_in_flight_bytes, dev.link.window_waits)
    assert results["bounded"][1] <= 2 * MiB < results["unbounded"][1]
    assert results["bounded"][2] > 0 and results["bounded"][0] < results["unbounded"][0]


def test_by_default_a_slow_link_holds_one_block_calls_bytes_in_flight():
    from adaptmem.wrapping import get_instrumentation

    model = tiny(dim=128, n_layers=4)
    batch = tiny_batch(model, batch=4, seq=128)
    expected = step(model, batch)
    adaptmem.instrument(model, mode=Mode.OFFLOAD)  # the default window: one block's worth
    dev = _on_link_time(100 * MiB)
    dev.track(model)
    with dev:
        assert_same(step(model, batch), expected)
    per_call = get_instrumentation(model).runtime.offload.largest_call_bytes
    assert dev.host_peak_bytes >= 4 * per_call > 0  # four blocks' copies went out
    assert dev.link.peak_in_flight_bytes <= per_call and dev.link.window_waits > 0


def test_the_planner_is_told_the_window_where_copies_take_time():
    model = tiny()
    with adaptmem.manage(model, budget=2**29, device=SimulatedDevice(2**30, link_bytes_per_s=100 * MiB)) as mem:
        assert mem._controller.costs.priors.in_flight_cap == float("inf")  # one block's worth: each block's own backlog
    for speed, expected in ((None, 0.0), (100 * MiB, 4 * MiB)):
        model = tiny()
        adaptmem.instrument(model, offload=adaptmem.OffloadOptions(max_in_flight_bytes=4 * MiB))
        dev = SimulatedDevice(capacity_bytes=2**30, link_bytes_per_s=speed)
        with adaptmem.manage(model, budget=2**29, device=dev) as mem:
            assert mem._controller.costs.priors.in_flight_cap == expected


def test_the_manager_times_steps_on_the_links_clock():
    """A benchmark's virtual clock (CPU time plus the link's waits) is the one the manager
    measures with, so what a slow link costs is learned where it is paid."""
    from adaptmem.devices.simulated import SimulatedProbe

    dev = SimulatedDevice(link_bytes_per_s=100 * MiB)
    now = [5.0]
    dev.link.clock, dev.link.sleep = (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))
    probe = SimulatedProbe(dev)
    start = probe.mark()
    dev.link.sleep(0.25)
    assert start == 5.0 and probe.seconds(start, probe.mark()) == 0.25


@pytest.mark.parametrize("after", [Mode.NONE, Mode.SELECTIVE, Mode.CHECKPOINT])
def test_a_block_that_offloads_nothing_starts_the_offloaded_block_before_it_back(after):
    """Plan O, O, X, X: backward reaches block 2 first; the copies of block 1 must start back
    then, while block 2's gradients run, not only once block 1's own backward asks for them."""
    model = tiny(dim=128)
    batch = tiny_batch(model, batch=2, seq=64)
    expected = step(model, batch)
    handles = adaptmem.instrument(model)
    for h, mode in zip(handles, (Mode.OFFLOAD, Mode.OFFLOAD, after, after)):
        h.mode = mode
    events = []
    model.blocks[2].register_full_backward_hook(lambda *_: events.append("block 2 done"))
    dev = SimulatedDevice(link_bytes_per_s=256 * MiB)
    fetch = dev.link.fetch
    dev.link.fetch = lambda nbytes, after=0.0: (events.append("fetch"), fetch(nbytes, after))[1]
    dev.track(model)
    with dev:
        assert_same(step(model, batch), expected)
    assert "fetch" in events and events.index("fetch") < events.index("block 2 done")


def test_an_offloaded_blocks_hooks_are_timed_within_its_step_link_waits_included():
    """What OFFLOAD does that NONE does not happens in its pack and unpack hooks: the copies and
    the waits for the link. On a clock that only the link's waits move, an offloaded block's
    `moved_seconds` add up to every wait of the step; a block in NONE has none."""
    from adaptmem.control.recorder import StepRecorder
    from adaptmem.devices.simulated import SimulatedProbe
    from adaptmem.wrapping import get_instrumentation

    model = tiny(dim=128, n_layers=4)
    handles = adaptmem.instrument(model)
    for h, mode in zip(handles, [Mode.OFFLOAD, Mode.NONE, Mode.OFFLOAD, Mode.NONE]):
        h.mode = mode
    dev = SimulatedDevice(link_bytes_per_s=20 * MiB)
    clock = Clock()
    dev.link.clock, dev.link.sleep = clock, clock.sleep
    dev.track(model)
    recorder = StepRecorder(SimulatedProbe(dev))
    get_instrumentation(model).runtime.observer = recorder
    with dev:
        recorder.begin()
        model(**tiny_batch(model, batch=4, seq=128)).loss.backward()
        sample = recorder.end()
    moved = [b.moved_seconds for b in sample.blocks]
    assert moved[1] is None and moved[3] is None
    assert moved[0] > 0 and moved[2] > 0 and sum(clock.slept) > 0
    assert moved[0] + moved[2] == pytest.approx(sum(clock.slept))
    assert sample.seconds == pytest.approx(sum(clock.slept))  # nothing else took time on this clock
