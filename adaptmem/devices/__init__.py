"""Where memory lives and how it is read: probes and the CPU stand-in for a GPU.

A `MemoryProbe` reads one device (`probe.py`): a CUDA device through the
caching allocator, cudaMemGetInfo and NVML (`cuda.py`), the host through psutil
(`host.py`), or the `SimulatedDevice` stand-in with its own probe
(`simulated.py`); `ScriptedProbe` (`scripted.py`) follows a script so decisions
can be tested exactly. `make_probe` (`select.py`) picks one for what the user
passed as `device`. `tiers.py` marks host-tier allocations for the stand-in,
and `link.py` gives it a host link of finite speed.
"""
