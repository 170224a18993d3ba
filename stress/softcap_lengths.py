"""A soft-capped model on lengths that change from batch to batch: refused batches and the head's peaks.

    python -m stress.softcap_lengths            # both parts (about a minute and a half on 2 cores)
    python -m stress.softcap_lengths --head     # the loss head's peaks alone

A Gemma 2 from its config (4 layers, hidden 128, vocabulary 8,192, eager attention with both
soft-caps) with its weights frozen and a low-rank adapter of rank 8 on every projection of its
layers (a LoRA fine-tune, as `peft` makes it), batch 2:

  head    one step at 2 x 1,536 tokens with every block in NONE, the loss head kept and chunked
          at each size (an unlimited stand-in): a chunk as large as the batch should peak under
          the logits kept
  loop    `LENGTHS` under `manage` on a 400 MiB stand-in (budget 90%), `run_step` and AdamW, a
          refused batch caught and skipped: which batches were refused, with those of the same
          length or longer trained before them, the retries, and the worst peak against the budget

Lengths past the ones measured are predicted from smaller ones; on this model a recompute makes
the attention's scores again at once where an offload brings them back one at a time, and the
figures can rank the plans wrongly there. A batch of a length that has trained is expected to
train again.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

MiB = 2**20
VOCAB = 8192
DEVICE_MIB = 400
LENGTHS = (128, 512, 256, 1024, 2048, 384, 768, 1536, 128, 2048, 640, 1280, 256, 1792, 896, 2048)


def build() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=512,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        attn_implementation="eager",
        use_cache=False,
    )
    model = Gemma2ForCausalLM(config)
    model.requires_grad_(False)
    for layer in model.model.layers:  # low-rank adapters on every projection, as a LoRA fine-tune has
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name.endswith("_proj"):
                    setattr(parent, name, LowRank(child))
    return model.train()


class LowRank(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update (`rank` 8, scaled by 2), both factors
    random so that both get gradients."""

    def __init__(self, base: torch.nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 2.0 * self.up(self.down(x))


def batch(length: int, size: int = 2) -> dict:
    ids = torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def head_peaks(length: int = 1536) -> dict[str, float]:
    """{head choice: the step's peak in MiB} with every block in NONE."""
    import adaptmem
    from adaptmem.testing import SimulatedDevice

    model = build()
    adaptmem.instrument(model)
    head = adaptmem.get_head(model)
    peaks = {}
    tokens = 2 * length
    for chunk in (None, 1 << (tokens - 1).bit_length(), 2048, 1024, 256):
        head.mode, head.chunk_tokens = ("kept", None) if chunk is None else ("chunked", chunk)
        with SimulatedDevice(capacity_bytes=64 * 2**30) as dev:
            dev.track(model)
            model(**batch(length)).loss.backward()
        model.zero_grad(set_to_none=True)
        peaks["KEPT" if chunk is None else f"CHUNKED:{chunk}"] = dev.peak_bytes / MiB
    adaptmem.restore(model)
    return peaks


def loop() -> dict:
    """Train `LENGTHS`; what was refused, retried and how high the steps went."""
    import adaptmem
    from adaptmem.testing import SimulatedDevice

    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    trained: list[int] = []
    refused: list[tuple[int, bool]] = []  # (length, a batch as long or longer had trained)
    worst = 0.0
    with SimulatedDevice(capacity_bytes=DEVICE_MIB * MiB) as dev:
        dev.track(model)
        with adaptmem.manage(model, budget="90%", device=dev) as mem:
            for length in LENGTHS:
                data = batch(length)
                try:
                    mem.run_step(lambda: model(**data).loss.backward())
                except adaptmem.StepOutOfMemoryError:
                    refused.append((length, any(t >= length for t in trained)))
                    opt.zero_grad(set_to_none=True)
                    continue
                opt.step()
                opt.zero_grad(set_to_none=True)
                trained.append(length)
                last = mem.last_step
                worst = max(worst, last["observed_peak_bytes"] / last["budget_bytes"])
            summary = mem.summary()
            reach = mem.longest_sequence(2)
    return {
        "trained": len(trained),
        "refused": refused,
        "ooms": summary["ooms"],
        "ooms_recovered": summary["ooms_recovered"],
        "worst_of_budget": worst,
        "longest": reach.length,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", action="store_true", help="the loss head's peaks only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("adaptmem").setLevel(logging.ERROR)  # the loop's warnings are its subject, counted
    peaks = head_peaks()
    print("head, 2 x 1,536 tokens, every block NONE: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in peaks.items()))
    one = next(v for k, v in peaks.items() if k.startswith("CHUNKED"))
    ok = one < peaks["KEPT"]
    print(f"- {'met' if ok else '**missed**'}: one chunk as large as the batch peaks under the logits kept")
    if args.head:
        return 0 if ok else 1
    got = loop()
    again = [length for length, before in got["refused"] if before]
    print(
        f"loop of {len(LENGTHS)} batches on {DEVICE_MIB} MiB: {got['trained']} trained, refused "
        f"{[length for length, _ in got['refused']]}, out-of-memory errors {got['ooms']} "
        f"({got['ooms_recovered']} recovered), worst step {got['worst_of_budget']:.1%} of the budget; "
        f"longest_sequence(2) {got['longest']:,} tokens"
    )
    print(
        f"- {'met' if not again else '**missed**'}: no batch refused after one as long or longer trained {again or ''}"
    )
    return 0 if ok and not again else 1


if __name__ == "__main__":
    sys.exit(main())
