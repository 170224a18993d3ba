"""What a backward that raised leaves in autograd's engine: a block with two branches, one
recomputing when the error comes while the other waits in the engine's ready queue, keeps the
failed step's graph alive until the thread's next backward; `release_failed_backward` lets it
go, and the manager calls it after every out-of-memory error."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch import nn

import adaptmem
from adaptmem import Mode
from adaptmem.testing import OutOfMemoryInjector, SimulatedDevice


class TwoBranches(nn.Module):
    """Attention beside an MLP, as Cohere's and GPT-J's blocks have them (here linear layers)."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.left = nn.Linear(width, width)
        self.right = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.left(h).tanh() + self.right(h)


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TwoBranches() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _failed_recompute(model: Net, step=lambda fn: fn(), device: str = "cpu") -> None:
    """One step whose recompute of the middle block raises, the error caught as a user would."""
    injector = OutOfMemoryInjector(model.layers)
    injector.arm(1, "recompute")
    with pytest.raises(torch.OutOfMemoryError):
        step(lambda: model(torch.randn(32, 64, 128, device=device, requires_grad=True)).sum().backward())
    injector.remove()
    model.zero_grad(set_to_none=True)
    gc.collect()


def test_a_failed_recompute_leaves_the_graph_queued_until_released():
    torch.manual_seed(0)
    model = Net()
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    with SimulatedDevice() as dev:
        dev.track(model)
        start = dev.allocated_bytes
        _failed_recompute(model)
        held = dev.allocated_bytes - start
        adaptmem.release_failed_backward()
        assert held > 2**20, "autograd's engine no longer keeps a failed backward's graph: drop the release"
        assert dev.allocated_bytes == start


def test_the_manager_lets_a_failed_steps_graph_go_before_it_reads_memory_again():
    """Under `step()` the error reaches the caller, and the memory the failed backward held is
    free by then: the next step is planned from what the model holds, not from a dead graph."""
    torch.manual_seed(0)
    model = Net()
    policy = adaptmem.load_policy("every-2").model_copy(update={"every_k": 1, "head": None})
    with SimulatedDevice(2**31) as dev, adaptmem.manage(model, device=dev, policy=policy) as mem:
        dev.track(model)
        start = dev.allocated_bytes

        def step(fn):
            with mem.step():
                fn()

        _failed_recompute(model, step)
        assert mem.summary()["ooms"] == 1
        assert dev.allocated_bytes == start


@pytest.mark.cuda
def test_a_failed_recompute_on_cuda_is_released_from_the_devices_queue():
    """On CUDA the nodes run in the device's own engine thread, whose queue a backward of nothing
    there drains."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = Net().cuda()
    adaptmem.instrument(model, mode=Mode.CHECKPOINT)
    # one step first: cuBLAS keeps a workspace per thread (the caller's, the device's) from its
    # first matmul on, allocated through PyTorch's allocator (without this step an H200 read
    # 69.2 MB above the start after the release)
    model(torch.randn(32, 64, 128, device="cuda", requires_grad=True)).sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    _failed_recompute(model, device="cuda")
    held = torch.cuda.memory_allocated() - start
    adaptmem.release_failed_backward(["cuda"])
    for _ in range(100):  # the device's thread lets the queued nodes go after the backward returns
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() == start:
            break
        time.sleep(0.01)
    print(f"held after the error: {held} bytes; after the release: {torch.cuda.memory_allocated() - start}")
    assert torch.cuda.memory_allocated() == start
