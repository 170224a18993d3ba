"""What users' tests need to run adaptmem without a GPU.

`SimulatedDevice` is a CPU stand-in for a GPU with a capacity and real
`torch.OutOfMemoryError`s; `ScriptedProbe` reads peaks from a script, so
decisions can be asserted exactly; `measure_peak` gives the peak of a
training step with every block in one mode; `OutOfMemoryInjector` raises an
out-of-memory error in a block's forward, recompute or backward, to see a
step retried. They live in `adaptmem.devices`
and `adaptmem.control`; this module only re-exports them, and nothing inside
adaptmem imports it.
"""

from adaptmem.control.measure import measure_peak
from adaptmem.devices.faults import OutOfMemoryInjector
from adaptmem.devices.scripted import ScriptedProbe
from adaptmem.devices.simulated import PeakWindow, SimulatedDevice, SimulatedProbe

__all__ = ["OutOfMemoryInjector", "PeakWindow", "ScriptedProbe", "SimulatedDevice", "SimulatedProbe", "measure_peak"]
