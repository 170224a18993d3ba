"""Steps with two forwards before one backward, on the stand-in: what the manager plans and predicts.

    python -m stress.two_forwards              # a DPO-style loop and an InfoNCE loop, 12 steps each
    python -m stress.two_forwards --steps 20

Two loops our other benchmarks never run:
  dpo       a Llama (4 layers, vocabulary 2,000) run on a chosen and on a rejected batch of 4 x 192
            tokens, its loss (a preference loss) taken from their logits: no `labels=`, so the head
            runs as it is;
  infonce   a six-block encoder run on two noisy views of 32 x 128 inputs, an InfoNCE loss of its own.
Each budget lies halfway between the step's peak with every block checkpointed and with none
(`measure_peak(step=...)`). Printed per step: each forward's plan, the head, the peak against the
budget, and the prediction's error; then the run's largest peak and the mean error of its last
half. A step's record carries each forward's plan (`forward_plans`).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import adaptmem
from adaptmem import Mode
from adaptmem.testing import SimulatedDevice, measure_peak
from stress.benchkit import plan_label


def log_probs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its tokens after the first, from the logits."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.gather(F.log_softmax(logits.float(), -1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loop(steps: int):
    """(model, step function, its batches): a Llama run on a chosen and on a rejected batch, a
    preference loss from their logits."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 2000, (4, 192), generator=gen) for _ in range(2)) for _ in range(steps)]

    def step(chosen, rejected):
        (-F.logsigmoid(0.1 * (log_probs(model, chosen) - log_probs(model, rejected)))).mean().backward()

    return model, step, batches


class Encoder(torch.nn.Module):
    """Six residual MLP blocks over (batch, positions, 16) inputs, pooled and projected: an encoder
    for contrastive losses, with no loss head of a language model's."""

    def __init__(self, width: int = 64, blocks: int = 6) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(blocks)
        )
        self.proj = torch.nn.Linear(width, 32)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.proj(h.mean(1))


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """InfoNCE of two views' embeddings: each one's pair is its own row."""
    z1, z2 = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
    return F.cross_entropy(z1 @ z2.T / temperature, torch.arange(len(z1)))


def infonce_loop(steps: int):
    """(model, step function, its batches): the encoder on two noisy views of each batch."""
    torch.manual_seed(0)
    model = Encoder()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 128, 16, generator=gen),) for _ in range(steps)]

    def step(x):
        info_nce(model(x + 0.1 * torch.randn_like(x)), model(x + 0.1 * torch.randn_like(x))).backward()

    return model, step, batches


LOOPS = {"dpo": dpo_loop, "infonce": infonce_loop}


def halfway(model: torch.nn.Module, step, args: tuple) -> tuple[int, int, int]:
    """(budget, peak with every block kept, with every block checkpointed) of `step(*args)`: the
    budget halfway between the two peaks."""
    kept = measure_peak(model, step=lambda: step(*args))
    checkpointed = measure_peak(model, step=lambda: step(*args), mode=Mode.CHECKPOINT)
    return int(checkpointed + 0.5 * (kept - checkpointed)), kept, checkpointed


def run(name: str, steps: int = 12) -> dict:
    """The loop's step records, its budget and its two measured peaks."""
    model, step, batches = LOOPS[name](steps)
    budget, kept, checkpointed = halfway(model, step, batches[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dev = SimulatedDevice(capacity_bytes=2 * budget)
    dev.track(model)
    with dev, adaptmem.manage(model, device=dev, budget=budget) as mem:
        for batch in batches:
            mem.run_step(step, *batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
        records = mem.events.of_type("step")
    return {"budget": budget, "kept": kept, "checkpointed": checkpointed, "steps": records}


def report(name: str, got: dict) -> list[str]:
    mib = 2**20
    lines = [
        f"{name}: budget {got['budget'] / mib:.2f} MiB (every block kept {got['kept'] / mib:.2f}, "
        f"checkpointed {got['checkpointed'] / mib:.2f})"
    ]
    for r in got["steps"]:
        plans = " | ".join(plan_label(tuple(map(Mode.parse, p))) for p in (r["forward_plans"] or [r["plan"]]))
        error = "-" if r["prediction_error"] is None else f"{r['prediction_error']:+.3f}"
        lines.append(
            f"  step {r['step']:2d}  {plans:<13} head {str(r['head']):<6} "
            f"{r['observed_peak_bytes'] / r['budget_bytes']:6.1%} of budget  error {error:>7}  {r['measured']}"
        )
    late = [
        abs(r["prediction_error"]) for r in got["steps"][len(got["steps"]) // 2 :] if r["prediction_error"] is not None
    ]
    top = max(r["observed_peak_bytes"] / r["budget_bytes"] for r in got["steps"])
    mean = f"{sum(late) / len(late):.3f}" if late else "none"
    lines.append(f"  largest peak {top:.1%} of budget; mean |error| over the last half {mean}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--loops", default="dpo,infonce")
    args = parser.parse_args()
    print(
        "plans, a letter a block (N NONE, S SELECTIVE, C CHECKPOINT, O OFFLOAD, K CHECKPOINT+OFFLOAD): "
        "first forward | second"
    )
    for name in args.loops.split(","):
        print("\n".join(report(name, run(name, args.steps))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
