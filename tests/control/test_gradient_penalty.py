"""A WGAN-GP critic: a gradient penalty backwards twice through every block (create_graph=True).
Under a policy whose only recompute mode is SELECTIVE, the managed critic trains in SELECTIVE,
every weight layer's output held, and its training state stays bit-identical to unmanaged
training."""

from __future__ import annotations

import torch
from torch import nn

import adaptmem
from adaptmem.config.policy import load_policy
from adaptmem.testing import SimulatedDevice

POLICY = load_policy("balanced").model_copy(update={"modes": ("SELECTIVE",), "sample_interval_s": 10.0})


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Critic(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(*(Residual(width) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.stem(x))).squeeze(-1)


def critic_loss(critic: Critic, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    mix = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(int(real.sum().item() * 1000) % 997))
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def batches(n: int = 5):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(64, 8, generator=gen), torch.randn(64, 8, generator=gen) * 2) for _ in range(n)]


def train(managed: bool, caplog=None) -> tuple[dict, list]:
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3, betas=(0.5, 0.9))
    dev = SimulatedDevice(2**30)
    dev.track(critic, opt)
    plans = []
    with dev:
        mem = adaptmem.manage(critic, policy=POLICY, device=dev) if managed else None
        for real, fake in batches():
            if managed:
                mem.run_step(lambda: critic_loss(critic, real, fake).backward())
                plans.append(mem.last_step["plan"])
            else:
                critic_loss(critic, real, fake).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if managed:
            mem.close()
    state = {n: p.detach().clone() for n, p in critic.named_parameters()}
    state.update({f"adam.{k}": v for k, v in _adam(opt).items()})
    return state, plans


def _adam(opt) -> dict:
    return {
        f"{i}.{name}": value.clone()
        for i, s in enumerate(opt.state.values())
        for name, value in s.items()
        if torch.is_tensor(value)
    }


def test_a_gradient_penalty_under_a_selective_only_policy_stays_exact(every_layer_held):
    expected, _ = train(managed=False)
    got, plans = train(managed=True)
    assert all(plan == ["SELECTIVE"] * 4 for plan in plans)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), [
        k for k in expected if not torch.equal(expected[k], got[k])
    ]
