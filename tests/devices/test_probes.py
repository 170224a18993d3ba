import logging
import sys
import types

import pytest
import torch

from adaptmem.devices.cuda import _nvml_handle
from adaptmem.devices.host import HostProbe
from adaptmem.devices.probe import MemoryProbe
from adaptmem.devices.select import make_probe
from adaptmem.testing import SimulatedProbe
from adaptmem.testing import ScriptedProbe, SimulatedDevice


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
    fake = types.SimpleNamespace(NVMLError=Exception, nvmlInit=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: f"handle-{i}")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert _nvml_handle(3) == "handle-3"


@pytest.mark.parametrize("device", ["tpu", "cuda:x", True])
def test_a_device_adaptmem_cannot_manage_is_named(device):
    with pytest.raises(ValueError, match=f"device={device!r} is not a device adaptmem can manage|device must be None"):
        make_probe(device)
