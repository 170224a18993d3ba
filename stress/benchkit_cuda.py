"""`stress.bench` on a real GPU: the device, its clock and a peak meter no manager reads.

On CUDA every method runs on the one device, over its real host link (pinned copies on
side streams), in one process. Three things change from the stand-in:

- the runners share the base model's parameters (`shared_copy`): steps take no optimizer
  step and clear their gradients, so one copy of the weights serves every method, and
  what is allocated between steps is the same for all of them. Peaks and budgets are
  absolute device bytes, as the manager reads them;
- step time is wall time between two `torch.cuda.synchronize()` calls (`CudaClock`),
  around `GPU_RUN` steps back to back, as a training loop runs them: the host issues a
  step while the device still computes the one before, so what the host does between
  steps (the manager's planning, say) costs only where the host is the slower of the two.
  One step between synchronizations would charge all of it to every step;
- a step's peak is read by `CudaMeter`. The manager resets PyTorch's peak counter at
  block boundaries to measure block by block, so `max_memory_allocated()` alone would
  read only the stretch since the last boundary. The meter folds the counter into its
  own high-water mark before every reset, whoever calls it.
"""

from __future__ import annotations

import copy
import time

import torch

GPU_RUN = 3  # steps a reading covers on a GPU, back to back


class CudaMeter:
    """The peak of `torch.cuda.memory_allocated()` since `start()`, through anyone's resets."""

    _installed: CudaMeter | None = None

    def __init__(self) -> None:
        self._reset = torch.cuda.reset_peak_memory_stats
        self.high = 0

    @classmethod
    def installed(cls) -> CudaMeter:
        """The process's one meter, wrapped around `torch.cuda.reset_peak_memory_stats` on first use."""
        if cls._installed is None:
            meter = cls()
            torch.cuda.reset_peak_memory_stats = meter._folding
            cls._installed = meter
        return cls._installed

    def _folding(self, device=None) -> None:
        self.high = max(self.high, torch.cuda.max_memory_allocated(device))
        self._reset(device)

    def start(self) -> None:
        torch.cuda.synchronize()
        self.high = 0
        self._reset()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return max(self.high, torch.cuda.max_memory_allocated())


class CudaStage:
    """The real device where `stress.benchkit` puts a `SimulatedDevice`: the same few calls."""

    link = None
    host_peak_bytes = 0

    def __init__(self) -> None:
        self.meter = CudaMeter.installed()

    def __enter__(self) -> CudaStage:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def track(self, model: torch.nn.Module) -> None:
        """Nothing to do: the caching allocator counts every tensor on the device."""

    def reset_peak(self) -> None:
        self.meter.start()

    @property
    def peak_bytes(self) -> int:
        return self.meter.peak()


class CudaClock:
    """Wall seconds, with the device's queued work finished first."""

    def __call__(self) -> float:
        torch.cuda.synchronize()
        return time.perf_counter()


def shared_copy(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of `base` whose parameters are `base`'s own (buffers and wrappers are its own)."""
    return copy.deepcopy(base, memo={id(p): p for p in base.parameters()})


def link_bytes_per_s(nbytes: int = 1 << 30) -> float:
    """Device-to-host bytes per second of one pinned copy: the real link offload uses."""
    from stress.bench_modes import link_gbps

    return link_gbps(nbytes)[0] * 1e9


def machine() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name}, torch {torch.__version__}"
