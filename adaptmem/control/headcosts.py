"""What the loss head costs in each of its modes, for the planner.

The head runs after the blocks: its bytes stand above everything the blocks
keep for backward, where the planner's last constraint has them. Here the head
is one more row of the plan: KEPT, or CHUNKED with a chunk size among powers of
two, each with its bytes and its time, so the planner weighs chunking the
logits against recomputing or offloading a block, and picks the chunk size
itself (the largest that fits: fewer chunks, less overhead).

Bytes are known from the shapes before anything runs (the logits are tokens x
vocabulary, the chunk's buffers chunk x vocabulary) and learned from the steps
once a mode has run: KEPT's peak above the blocks (`kept`), and CHUNKED's less
its chunk's buffers (`chunked`: the hidden states' gradient, the weight's
gradient buffer, the final norm), each a `Fit` over the shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptmem.control.fits import Fit
from adaptmem.modes import HeadMode

#: Bytes per token of a KEPT head, in logits (tokens x vocabulary x 4 bytes) at its peak, before a
#: step has shown them: the logits, their log-softmax and the gradients of both (3.2 measured by
#: `stress/head_variants.py` on the plain loss; a model that also keeps its output's logits holds one more).
KEPT_LOGITS_PRIOR = 4.0
#: The same for one chunk of a CHUNKED head, before a chunked step has shown it: the float32 logits
#: turned in place into their gradient, the logsumexp beside them, and a cast under autocast (1.45
#: measured by `stress/head_variants.py` under autocast; about 1.0 in float32). Learned once chunked.
CHUNK_LOGITS = 1.6
#: What a chunked step may teach of it: a reading outside is another allocation's, not the chunk's.
#: A chunk whose epilogue goes through autograd (a soft-cap in bfloat16, label smoothing) holds five
#: or so: a Gemma 2's float32 soft-cap, before it ran in place, held 5.0, and was priced at 1.6.
CHUNK_LOGITS_RANGE = (0.5, 8.0)
#: Time a chunk adds (seconds): one more pass of the chunk loop, its kernels launched again. Chunking
#: costs no matmul (the gradients are taken in forward: three matmuls, as the kept head's), so this and
#: `CHUNKED_S` are all it is priced at.
CHUNK_S = {"cuda": 5e-5, "host": 2e-4}
#: Time CHUNKED costs whatever the chunk (seconds): a price on the order of summation, so a head that
#: fits kept stays kept (bit for bit) and chunking is picked where it buys memory.
CHUNKED_S = {"cuda": 1e-4, "host": 1e-3}
#: The smallest chunk planned (tokens): below it the loop's overhead outgrows what it saves.
MIN_CHUNK = 64


@dataclass(frozen=True)
class HeadChoice:
    """The head's mode in a plan, and its chunk (tokens) when CHUNKED."""

    mode: HeadMode
    chunk: int | None = None

    @property
    def label(self) -> str:
        return "KEPT" if self.mode is HeadMode.KEPT else f"CHUNKED:{self.chunk}"

    @classmethod
    def parse(cls, label: str) -> HeadChoice:
        mode, _, chunk = label.partition(":")
        return cls(HeadMode.parse(mode), int(chunk) if chunk else None)


KEPT = HeadChoice(HeadMode.KEPT)


class HeadCosts:
    """The head of one model: `vocab` x `hidden` projection, `weight_bytes` of weight."""

    def __init__(self, vocab: int, hidden: int, weight_bytes: int, *, cuda: bool) -> None:
        self.vocab, self.hidden, self.weight_bytes = vocab, hidden, weight_bytes
        self.kind = "cuda" if cuda else "host"
        self.kept = Fit("base")
        self.chunked = Fit("base")
        # bytes a chunk held above the head's other bytes, and its logits' bytes, over the chunked
        # steps seen: their ratio is the chunk's size in logits, weighted to the larger chunks
        self._chunk_seen, self._chunk_logits = 0.0, 0.0

    def tokens(self, batch: int, extent: int) -> int:
        """Tokens reaching the head: the blocks' main input is (batch, tokens, hidden)."""
        return max(1, batch * extent // max(1, self.hidden))

    @property
    def chunk_logits(self) -> float:
        """A chunk's bytes at its peak, in its logits (chunk x vocabulary x 4 bytes): learned from
        the chunked steps seen, `CHUNK_LOGITS` before one."""
        if self._chunk_logits <= 0:
            return CHUNK_LOGITS
        low, high = CHUNK_LOGITS_RANGE
        return min(high, max(low, self._chunk_seen / self._chunk_logits))

    def chunk_bytes(self, chunk: int) -> float:
        return self.chunk_logits * chunk * self.vocab * 4

    def kept_bytes(self, batch: int, extent: int) -> float:
        if self.kept:
            return self.kept.predict(batch, extent)
        return KEPT_LOGITS_PRIOR * self.tokens(batch, extent) * self.vocab * 4 + self._fixed(batch, extent)

    def chunked_bytes(self, batch: int, extent: int, chunk: int) -> float:
        return self._beside(batch, extent) + self.chunk_bytes(min(chunk, self.tokens(batch, extent)))

    def _beside(self, batch: int, extent: int) -> float:
        """A chunked head's bytes beside its chunk: learned, or `_fixed` before a chunked step."""
        if self.chunked:
            return self.chunked.predict(batch, extent, constant=self._gradient)
        return self._fixed(batch, extent)

    def _fixed(self, batch: int, extent: int) -> float:
        """What the head holds beside its logits: its weight's gradient (a float32 buffer when
        chunked), and a few hidden-sized tensors per token (the final norm, the hidden states'
        gradient)."""
        return self._gradient + 4 * self.tokens(batch, extent) * self.hidden * 4

    @property
    def _gradient(self) -> float:
        """The weight's gradient (a float32 buffer when chunked): the same bytes at any shape."""
        return max(self.weight_bytes, self.vocab * self.hidden * 4)

    def chunks(self, tokens: int) -> list[int]:
        """The chunk sizes planned: powers of two from `MIN_CHUNK` to the first that holds every token."""
        top = 1 << max(0, math.ceil(math.log2(max(1, tokens))))
        sizes, size = [], min(MIN_CHUNK, top)
        while size <= top:
            sizes.append(size)
            size *= 2
        return sizes

    def choices(self, batch: int, extent: int, allowed: str) -> list[tuple[HeadChoice, float, float]]:
        """(choice, bytes above the blocks' saved ones, seconds) for every choice `allowed`
        ("auto", "kept" or "chunked"), KEPT first."""
        out = []
        if allowed != "chunked":
            out.append((KEPT, self.kept_bytes(batch, extent), 0.0))
        if allowed != "kept":
            tokens = self.tokens(batch, extent)
            for chunk in reversed(self.chunks(tokens)):
                seconds = CHUNKED_S[self.kind] + CHUNK_S[self.kind] * math.ceil(tokens / chunk)
                out.append((HeadChoice(HeadMode.CHUNKED, chunk), self.chunked_bytes(batch, extent, chunk), seconds))
        return out

    def learn(self, choice: HeadChoice, batch: int, extent: int, above: float) -> None:
        """A step's peak from the blocks' end to their backward, above the blocks' saved bytes."""
        if choice.mode is HeadMode.KEPT:
            self.kept.add(batch, extent, above)
        else:
            chunk = min(choice.chunk or 0, self.tokens(batch, extent))
            logits = chunk * self.vocab * 4
            seen = above - self._beside(batch, extent)
            low, high = CHUNK_LOGITS_RANGE
            if logits > 0 and low * logits <= seen <= high * logits:
                self._chunk_seen += seen
                self._chunk_logits += logits
            self.chunked.add(batch, extent, max(0.0, above - self.chunk_bytes(chunk)))

    def state_dict(self) -> dict:
        return {
            "kept": self.kept.state_dict(),
            "chunked": self.chunked.state_dict(),
            "chunk": [self._chunk_seen, self._chunk_logits],
        }

    def load_state_dict(self, state: dict) -> None:
        self.kept = Fit.from_state(state["kept"])
        self.chunked = Fit.from_state(state["chunked"])
        self._chunk_seen, self._chunk_logits = state.get("chunk", (0.0, 0.0))
