import logging
import sys
import types

import pytest
import torch

from adaptmem.devices.cuda import _nvml_handle
from adaptmem.devices.host import HostProbe
from adaptmem.devices.probe import MemoryProbe
from adaptmem.devices.select import make_probe
from adaptmem.testing import ScriptedProbe, SimulatedDevice, SimulatedProbe


def test_make_probe_variants(caplog):
    dev = SimulatedDevice(capacity_bytes=1 << 30)
    assert isinstance(make_probe(dev), SimulatedProbe)
    scripted = ScriptedProbe(1 << 30, [1])
    assert make_probe(scripted) is scripted
    assert isinstance(make_probe("cpu"), HostProbe)
    if not torch.cuda.is_available():
        with caplog.at_level(logging.WARNING, logger="adaptmem"):
            assert isinstance(make_probe(None), HostProbe)
        assert "no CUDA device found; managing host memory through psutil" in caplog.text
        with pytest.raises(ValueError, match="no CUDA device is available"):
            make_probe("cuda:0")
    with pytest.raises(ValueError, match="device must be None, 'cuda', 'cuda:N', 'cpu', a SimulatedDevice"):
        make_probe(3.5)


def test_simulated_probe_reads_the_device():
    dev = SimulatedDevice(capacity_bytes=1 << 20, host_capacity_bytes=1 << 22)
    probe = SimulatedProbe(dev)
    assert isinstance(probe, MemoryProbe)
    with dev:
        x = torch.empty(1000, dtype=torch.uint8)
        assert probe.allocated() == 1000 and probe.peak() == 1000
        dev.occupy(5000)
        assert probe.external() == 5000
    assert probe.capacity() == 1 << 20
    assert probe.host_available() == 1 << 22
    with pytest.raises(ValueError, match="has no capacity"):
        SimulatedProbe(SimulatedDevice()).capacity()
    del x


def test_host_probe_reads_rss():
    probe = HostProbe()
    assert probe.capacity() > 0
    rss = probe.allocated()
    assert rss > 0 and probe.peak() >= rss
    assert probe.external() >= 0 and probe.host_available() > 0


def test_host_probe_takes_its_peak_from_one_reading(monkeypatch):
    """take_peak: the peak since the last one with the resident size now, from one reading, and
    the peak starts again from that size (the three readings of peak, reset and allocated in one)."""
    probe = HostProbe()
    sizes = iter([100, 300, 200, 150])
    monkeypatch.setattr(probe, "_rss", lambda: next(sizes))
    probe.reset_peak()  # 100
    assert probe.allocated() == 300
    assert probe.take_peak() == (300, 200)
    assert probe.take_peak() == (200, 150)  # the peak began again at 200, one reading each


def test_host_probe_reads_what_others_use_as_psutil_does_and_without_the_files():
    """The memory available, read from /proc/meminfo kept open, is psutil's `available` (to within
    what the machine's other processes change between the two readings); closed, psutil reads it."""
    import psutil

    probe = HostProbe()
    mine, theirs = probe._available(), psutil.virtual_memory().available
    assert abs(mine - theirs) < 256 * 2**20
    probe.close()
    assert abs(probe._available() - psutil.virtual_memory().available) < 256 * 2**20
    assert probe.external() >= 0


def test_nvml_failure_falls_back_with_one_log_line(monkeypatch, caplog):
    """NVML cannot run here; a stand-in module that fails to initialize shows the fallback."""

    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: (_ for _ in ()).throw(NVMLError("no driver")))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with caplog.at_level(logging.INFO, logger="adaptmem"):
        assert _nvml_handle(0) is None
    assert "NVML unavailable (no driver)" in caplog.text
    assert "total - free - reserved" in caplog.text


def test_nvml_handle_when_present(monkeypatch):
    fake = types.SimpleNamespace(
        NVMLError=Exception, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"handle-{i}"
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert _nvml_handle(3) == "handle-3"


@pytest.mark.parametrize("device", ["tpu", "cuda:x", True])
def test_a_device_adaptmem_cannot_manage_is_named(device):
    with pytest.raises(ValueError, match=f"device={device!r} is not a device adaptmem can manage|device must be None"):
        make_probe(device)


def fake_cuda(monkeypatch, reserved, infos, total=80 << 30, fraction=1.0):
    """torch.cuda's readings, scripted: each call takes the next value. `reserved`: the
    allocator's (bytes reserved now, ever reserved, ever released) at each reading;
    `fraction`: the per-process memory fraction."""
    from adaptmem.devices.cuda import CudaProbe

    reserved, infos = iter(reserved), iter(infos)

    def stats(device=None):
        current, allocated, freed = next(reserved)
        return {"reserved_bytes": {"all": {"current": current, "allocated": allocated, "freed": freed}}}

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (next(infos), total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)
    probe = CudaProbe.__new__(CudaProbe)
    probe.device, probe.name, probe._total = torch.device("cuda", 0), "cuda:0", total
    return probe


GiB = 1 << 30


def test_outside_memory_is_read_from_one_consistent_snapshot(monkeypatch):
    # Others hold 2 GiB. 10 GiB reserved when free memory is read (68 GiB free), a 4 GiB segment
    # released right after: paired with the reserved bytes read then (6), the 68 would show
    # 80 - 68 - 6 = 6 GiB held by others. The reads around it disagree, so the pair is read again.
    ten, six = (10 * GiB, 30 * GiB, 20 * GiB), (6 * GiB, 30 * GiB, 24 * GiB)
    probe = fake_cuda(monkeypatch, reserved=[ten, six, six, six], infos=[68 * GiB, 72 * GiB])
    assert probe.external() == 2 * GiB  # the second pair agrees on both sides


def test_a_segment_taken_and_given_back_around_the_reading_is_not_read_as_others(monkeypatch):
    # Others hold 2 GiB; 10 GiB reserved. Another thread reserves a 4 GiB segment, cudaMemGetInfo
    # sees it (64 GiB free), and the thread gives it back before the second read: the bytes
    # reserved now agree on both sides, 80 - 64 - 10 would show 6 GiB held by others. The bytes
    # ever reserved and released moved, so the pair is read again.
    before, after = (10 * GiB, 30 * GiB, 20 * GiB), (10 * GiB, 34 * GiB, 24 * GiB)
    probe = fake_cuda(monkeypatch, reserved=[before, after, after, after], infos=[64 * GiB, 68 * GiB])
    assert probe.external() == 2 * GiB


def test_a_spike_in_one_reading_does_not_cut_the_budget():
    from helpers import tiny, tiny_batch

    import adaptmem

    class Spiky(ScriptedProbe):
        """One reading of outside memory shows a spike that the next does not confirm."""

        def __init__(self):
            super().__init__(1 << 30, [0])
            self.readings = []

        def external(self):
            value = 900 << 20 if len(self.readings) == 0 else 0
            self.readings.append(value)
            return value

    model = tiny()
    probe = Spiky()
    with adaptmem.manage(model, budget=512 << 20, device=probe) as mem:
        mem.sampler.wait_ticks(2)
        model(**tiny_batch(model)).loss.backward()
        assert mem.budget == 512 << 20 and mem.pressure_events == 0
    assert probe.readings[:2] == [900 << 20, 0]


def test_nvml_is_opened_with_the_index_cuda_visible_devices_maps_to(monkeypatch):
    from adaptmem.devices.cuda import nvml_index

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [nvml_index(0), nvml_index(1)] == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert nvml_index(2) == 2


def test_a_model_on_several_cuda_devices_is_refused_with_what_to_do():
    from adaptmem.devices.select import one_device

    assert one_device(set()) is None
    assert one_device({torch.device("cuda", 1)}) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"spread over cuda:0, cuda:1; .*adaptmem.manage\(stage, device='cuda:N'\)"):
        one_device({torch.device("cuda", 0), torch.device("cuda", 1)})


def test_a_per_process_memory_fraction_is_the_capacity_and_others_take_from_it_past_the_rest(monkeypatch):
    # A process capped by torch.cuda.set_per_process_memory_fraction(0.25) on an 80 GiB device
    # gets out-of-memory past 20 GiB: that is its device, for the budget and for a share of it.
    from adaptmem.config.budget import resolve_budget
    from adaptmem.config.policy import Policy

    assert fake_cuda(monkeypatch, reserved=[], infos=[]).capacity() == 80 * GiB
    nothing = (0, 0, 0)
    probe = fake_cuda(monkeypatch, reserved=[nothing] * 4, infos=[79 * GiB, 10 * GiB], fraction=0.25)
    assert probe.capacity() == 20 * GiB
    assert resolve_budget("50%", Policy(), probe, use_env=False) == 10 * GiB
    with pytest.raises(ValueError, match="larger than the device"):
        resolve_budget("30GiB", Policy(), probe, use_env=False)
    # Others hold 1 GiB (a context): the 60 GiB the fraction leaves out covers it. Then 70 GiB:
    # 10 GiB of this process's 20 are gone.
    assert probe.external() == 0
    assert probe.external() == 10 * GiB


def test_the_fragmentation_hint_follows_the_allocators_retries_not_its_cache(monkeypatch, caplog):
    """Blocks a step's activations freed stay reserved for the next step: no hint for them, however
    large. The hint comes once, the first time the allocator freed its cache to retry an
    allocation between two readings, and not where segments already expand in place."""
    from adaptmem.devices.cuda import CudaProbe

    def probe_over(readings):
        readings = iter(readings)

        def stats(device=None):
            reserved, allocated, retries = next(readings)
            return {
                "reserved_bytes": {"all": {"current": reserved}},
                "allocated_bytes": {"all": {"current": allocated}},
                "num_alloc_retries": retries,
            }

        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
        probe = CudaProbe.__new__(CudaProbe)
        probe.name, probe.device, probe._hinted, probe._retries = "cuda:0", torch.device("cuda", 0), False, None
        return probe

    cache = [(40 * GiB, 10 * GiB, 3)] * 3  # three steps' ends: 30 GiB cached, retries from before it started
    probe = probe_over([*cache, (40 * GiB, 30 * GiB, 5), (40 * GiB, 30 * GiB, 9)])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        for _ in cache:
            assert probe.signals()["fragmented"] == 30 * GiB
        assert not caplog.records
        assert probe.signals()["alloc_retries"] == 5
        probe.signals()
    (hint,) = caplog.records
    assert "retry an allocation (2 times since the last step; 10.00 GiB reserved" in hint.getMessage()
    assert "expandable_segments:True" in hint.getMessage()

    caplog.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    probe = probe_over([(40 * GiB, 30 * GiB, 1), (40 * GiB, 30 * GiB, 4)])
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        probe.signals(), probe.signals()
    assert not caplog.records
