"""The cost model: what each mode of each block costs, learned from the run itself.

For a batch of B sequences of S tokens, and per block and mode, it predicts

  held    bytes the block adds from its start to the next block's start
  fx      transient above its start during its forward
  wx      transient above the start of its backward (a recomputed block
          rematerializes its activations here)
  seconds time the mode adds to a step

plus per block `grad` (what else is alive when its backward starts: gradients
so far, leftovers) and, per step, `head` (the model after the blocks: head and
loss) and `tail` (the backward after the blocks).

Where a mode has run on a block (or on a block of the same class), its own
measurements are used. Elsewhere figures are derived from latent quantities
every mode reveals some of: input bytes X, output growth O, recomputable
activations A (a checkpoint's recompute, an offload's packed bytes, or NONE's
held bytes), backward temporaries D, the forward transient, and timings; and
those derived figures are inflated by the policy's `prior_margin`.

Every quantity is a `Fit` against the shape: a linear term in tokens T = B*S
and a quadratic one T*S (attention scores), so a length never seen is
predicted before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptmem.modes import LADDER, Mode
from adaptmem.observe import StepSample
from adaptmem.planner import Option
from adaptmem.policy import Policy

_REC = Mode.CHECKPOINT | Mode.OFFLOAD
_CO = Mode.COMPRESS | Mode.OFFLOAD


class Fit:
    """One quantity as a function of (batch, seq), from the observations so far.

    `kind="act"`: proportional to tokens, plus a T*S term once two shapes are
    seen (before that, a `quadratic` share is assumed when extrapolating to a
    longer sequence). `kind="base"`: an intercept (weights, gradients) plus a
    token term; with one shape seen it is held constant when shapes shrink and
    scaled with tokens when they grow.
    """

    def __init__(self, kind: str = "act") -> None:
        self.kind = kind
        self.points: dict[tuple[int, int], float] = {}

    def add(self, batch: int, seq: int, value: float) -> None:
        key = (int(batch), int(seq))
        old = self.points.get(key)
        self.points[key] = float(value) if old is None else 0.5 * old + 0.5 * float(value)
        if len(self.points) > 32:  # keep the most recent shapes
            self.points.pop(next(iter(self.points)))

    def __bool__(self) -> bool:
        return bool(self.points)

    def predict(self, batch: int, seq: int, quadratic: float = 0.0) -> float:
        if not self.points:
            return 0.0
        tokens = batch * seq
        if self.kind == "base":
            return self._base(tokens)
        # the nearest shape seen, scaled: tokens linearly, and an assumed quadratic share upwards
        (b0, s0), y0 = min(self.points.items(), key=lambda kv: abs(kv[0][0] * kv[0][1] - tokens))
        scale = tokens / max(1, b0 * s0)
        guess = y0 * scale * ((1 - quadratic) + quadratic * seq / s0 if seq > s0 else 1.0)
        if len({s for _, s in self.points}) < 2:
            return guess
        fitted = self._least_squares(batch, seq)
        return max(fitted, y0 * scale) if fitted is not None else guess

    def _least_squares(self, batch: int, seq: int) -> float | None:
        rows = [(b * s, b * s * s, y) for (b, s), y in self.points.items()]
        a11 = sum(r[0] * r[0] for r in rows)
        a12 = sum(r[0] * r[1] for r in rows)
        a22 = sum(r[1] * r[1] for r in rows)
        b1 = sum(r[0] * r[2] for r in rows)
        b2 = sum(r[1] * r[2] for r in rows)
        det = a11 * a22 - a12 * a12
        lin, quad = (b1 / a11 if a11 else 0.0), 0.0
        if det > 1e-12 * a11 * a22:
            lin2 = (b1 * a22 - b2 * a12) / det
            quad2 = (a11 * b2 - a12 * b1) / det
            if lin2 >= 0 and quad2 >= 0:
                lin, quad = lin2, quad2
            elif quad2 > 0 > lin2:
                lin, quad = 0.0, b2 / a22
        tokens = batch * seq
        return lin * tokens + quad * tokens * seq

    def _base(self, tokens: int) -> float:
        pts = [(b * s, y) for (b, s), y in self.points.items()]
        if len({t for t, _ in pts}) < 2:
            t0, y0 = max(pts)
            return y0 * max(1.0, tokens / t0) if y0 > 0 else y0
        n = len(pts)
        mean_t = sum(t for t, _ in pts) / n
        mean_y = sum(y for _, y in pts) / n
        var = sum((t - mean_t) ** 2 for t, _ in pts)
        slope = max(0.0, sum((t - mean_t) * (y - mean_y) for t, y in pts) / var)
        return mean_y + slope * (tokens - mean_t)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "points": [[b, s, y] for (b, s), y in self.points.items()]}

    @classmethod
    def from_state(cls, state: dict) -> "Fit":
        fit = cls(state["kind"])
        fit.points = {(int(b), int(s)): float(y) for b, s, y in state["points"]}
        return fit


_QUANTITIES = ("held", "fx", "wx", "seconds")
_TIE_BREAK = 1e-6  # seconds per ladder rung: far below any measured cost
_LATENTS = ("X", "O", "A", "D", "fxt", "fwd_s", "rec_s", "none_s")


@dataclass
class Figures:
    held: float
    fx: float
    wx: float
    seconds: float
    host: float


class CostModel:
    """Per-block, per-mode costs for one instrumented model, learned step by step."""

    def __init__(self, classes: list[str], policy: Policy, *, cuda: bool) -> None:
        self.classes = classes
        self.policy = policy
        self.cuda = cuda
        n = len(classes)
        self.direct: list[dict[Mode, dict[str, Fit]]] = [{} for _ in range(n)]
        self.latent: list[dict[str, Fit]] = [{k: Fit() for k in _LATENTS} for _ in range(n)]
        self.grad: list[Fit] = [Fit("base") for _ in range(n)]
        self.head = Fit("base")
        self.tail = Fit("base")
        self.elem_size = 4
        self.steps_learned = 0

    @property
    def known(self) -> bool:
        return self.steps_learned > 0

    # ---------------------------------------------------------------- learn
    def learn(self, sample: StepSample) -> None:
        if not sample.blocks or sample.batch * sample.seq == 0:
            return
        b, s = sample.batch, sample.seq
        start0 = sample.blocks[0].start
        self.elem_size = sample.blocks[0].elem_size or self.elem_size
        prefix = 0
        for blk in sample.blocks:
            if blk.index >= len(self.direct) or blk.held is None:
                continue
            prefix += blk.held
            self._learn_block(blk, b, s)
            if blk.bwd_start is not None:
                self.grad[blk.index].add(b, s, blk.bwd_start - (start0 + prefix))
        if sample.head_top:
            self.head.add(b, s, sample.head_top - (start0 + prefix))
        if sample.completed:
            self.tail.add(b, s, max(sample.tail_top, sample.start) - sample.start)
        self.steps_learned += 1

    def _learn_block(self, blk: Any, b: int, s: int) -> None:
        mode, lat = blk.mode, self.latent[blk.index]
        x = blk.input_bytes
        lat["X"].add(b, s, x)
        lat["O"].add(b, s, max(0, blk.output_bytes - x))
        fits = self.direct[blk.index].setdefault(mode, {q: Fit() for q in _QUANTITIES})
        fits["held"].add(b, s, max(0, blk.held))
        fits["fx"].add(b, s, blk.fwd_peak)
        complete = blk.bwd_peak is not None and blk.bwd_seconds is not None
        if complete:
            fits["wx"].add(b, s, blk.bwd_peak)
        area = None
        if mode in (Mode.CHECKPOINT, _REC) and blk.recompute_bytes is not None:
            area = blk.recompute_bytes
        elif mode is Mode.NONE:
            area = blk.held - x - max(0, blk.output_bytes - x)
        elif mode & (Mode.OFFLOAD | Mode.COMPRESS) and blk.packed:
            area = blk.packed - x
        if area is not None:
            lat["A"].add(b, s, max(0, area))
        if mode in (Mode.CHECKPOINT, _REC, Mode.OFFLOAD, _CO):
            lat["fxt"].add(b, s, blk.fwd_peak)
        if complete and mode is Mode.NONE:
            lat["D"].add(b, s, blk.bwd_peak)
        elif complete and mode is Mode.CHECKPOINT and blk.recompute_bytes is not None:
            lat["D"].add(b, s, max(0, blk.bwd_peak - blk.recompute_bytes))
        if not mode & (Mode.OFFLOAD | Mode.COMPRESS):
            lat["fwd_s"].add(b, s, blk.fwd_seconds)
        if complete:
            total = blk.fwd_seconds + blk.bwd_seconds
            if mode is Mode.NONE:
                lat["none_s"].add(b, s, total)
            elif mode is Mode.CHECKPOINT:
                lat["rec_s"].add(b, s, blk.recompute_seconds)
                lat["none_s"].add(b, s, max(0.0, total - blk.recompute_seconds))
            fits["seconds"].add(b, s, total)

    # -------------------------------------------------------------- predict
    def figures(self, index: int, mode: Mode, batch: int, seq: int) -> Figures:
        """Predicted figures of `mode` on block `index` for a batch of `batch` x `seq`.

        A mode measured on this block (or a sibling) anchors the level. Its own fit
        is used within the range of lengths it was measured at; beyond that, or
        from a single length, the measurement is carried to the new shape by how
        the derived figures scale, since the latents learn the shape from every mode.
        """
        derived = self._derive(mode, self._latents(index, batch, seq))
        fits = self.direct[index].get(mode) or self._sibling(index, mode)
        if fits is None or not fits["held"]:
            return derived
        seqs = {s for _, s in fits["held"].points}
        if (batch, seq) in fits["held"].points or (len(seqs) >= 2 and min(seqs) <= seq <= max(seqs)):
            q = self.policy.quadratic_prior
            held, fx = fits["held"].predict(batch, seq, q), fits["fx"].predict(batch, seq, q)
            wx = fits["wx"].predict(batch, seq, q) if fits["wx"] else derived.wx
        else:
            tokens = batch * seq
            b0, s0 = min(fits["held"].points, key=lambda k: abs(k[0] * k[1] - tokens))
            there = self._derive(mode, self._latents(index, b0, s0))
            linear = tokens / max(1, b0 * s0)

            def carry(fit: Fit, here: float, at: float) -> float:
                return fit.points[(b0, s0)] * (here / at if at > 0 else linear)

            held = carry(fits["held"], derived.held, there.held)
            fx = carry(fits["fx"], derived.fx, there.fx)
            wx = carry(fits["wx"], derived.wx, there.wx) if (b0, s0) in fits["wx"].points else derived.wx
        return Figures(held, fx, wx, self._seconds(index, mode, batch, seq, derived), derived.host)

    def _latents(self, index: int, batch: int, seq: int) -> dict[str, float]:
        q = self.policy.quadratic_prior
        return {k: f.predict(batch, seq, q) for k, f in self.latent[index].items()}

    def _seconds(self, index: int, mode: Mode, batch: int, seq: int, derived: Figures) -> float:
        """Measured time of the mode less measured time of NONE (NONE's own when it ran)."""
        if mode is Mode.NONE:
            return 0.0
        fits = self.direct[index].get(mode) or self._sibling(index, mode)
        none = self.direct[index].get(Mode.NONE) or self._sibling(index, Mode.NONE)
        baseline = none["seconds"] if none is not None and none["seconds"] else self.latent[index]["none_s"]
        if fits is None or not fits["seconds"] or not baseline:
            return derived.seconds
        lat = self._latents(index, batch, seq)
        overhead = fits["seconds"].predict(batch, seq) - baseline.predict(batch, seq)
        return max(0.0, overhead) + self._penalty(mode, lat)

    def _sibling(self, index: int, mode: Mode) -> dict[str, Fit] | None:
        cls = self.classes[index]
        for j, fits in enumerate(self.direct):
            if j != index and self.classes[j] == cls and mode in fits and fits[mode]["held"]:
                return fits[mode]
        return None

    def _derive(self, mode: Mode, lat: dict[str, float]) -> Figures:
        """A mode's figures from the latents. Figures that follow from measured latents
        (NONE from a checkpoint's recompute, say) get a small margin; guesses (how
        much selective checkpointing keeps, how lazily offloaded tensors come back)
        get the policy's full `prior_margin`."""
        x, o, a, d = lat["X"], lat["O"], lat["A"], lat["D"]
        fxt = lat["fxt"] or (a + x)
        kappa = self._kappa()
        move = x + a
        bw, hide = (12e9, 0.7) if self.cuda else (4e9, 0.0)
        codec = 100e9 if self.cuda else 1.5e9
        rec = lat["rec_s"] or lat["fwd_s"]
        prefetch = move if self.cuda else 0.0
        g = self.policy.prior_margin  # a guess
        e = 1.0 + (g - 1.0) / 5  # follows from measurements
        # (held, fx, wx, seconds, host) with their margins applied
        table = {
            Mode.NONE: (e * (x + o + a), e * max(fxt, x + o + a), e * d, 0.0, 0.0),
            Mode.SELECTIVE: (g * (x + o + 0.5 * a), g * (fxt + 0.5 * a), e * (a + d), 0.4 * rec, 0.0),
            Mode.CHECKPOINT: (e * (x + o), e * fxt, e * (a + d), rec, 0.0),
            Mode.OFFLOAD: (g * (x + o + 0.02 * a), g * fxt, g * (move + d + prefetch),
                           2 * move / bw * (1 - hide), move),
            _REC: (e * (x + o), e * fxt, e * (move + d), rec + 2 * x / bw * (1 - hide), x),
            Mode.COMPRESS: (g * (x + o + kappa * move), g * (fxt + kappa * move), g * ((1 + kappa) * move + d),
                            2 * move / codec, 0.0),
            _CO: (g * (x + o), g * (fxt + kappa * move), g * ((1 + kappa) * move + d + kappa * prefetch),
                  2 * move / codec + 2 * kappa * move / bw * (1 - hide), kappa * move),
        }
        held, fx, wx, seconds, host = table[mode]
        return Figures(held, fx, wx, seconds + self._penalty(mode, lat), host)

    def _kappa(self) -> float:
        elem = max(1, self.elem_size)
        if self.policy.compress_codec == "bf16":
            return min(1.0, 2 / elem)
        return min(1.0, (1 + 4 / self.policy.compress_group_size) / elem)

    def _penalty(self, mode: Mode, lat: dict[str, float]) -> float:
        return self.policy.compress_penalty * lat["fwd_s"] if Mode.COMPRESS in mode else 0.0

    def options(self, batch: int, seq: int, allowed: tuple[Mode, ...], fixed: dict[int, Mode] | None = None) -> list[list[Option]]:
        """Planner input: each block's options, with its `grad` term folded into `need`."""
        fixed = fixed or {}
        out = []
        for i in range(len(self.classes)):
            grad = self.grad[i].predict(batch, seq)
            modes = (fixed[i],) if i in fixed else allowed
            row = []
            for mode in modes:
                f = self.figures(i, mode, batch, seq)
                # ties (a mode whose measured cost is within noise of zero) go to the simpler mode
                seconds = f.seconds + _TIE_BREAK * LADDER.index(mode)
                row.append(Option(mode, f.held, max(f.fx, f.held + grad + f.wx), seconds, f.host))
            out.append(row)
        return out

    def head_bytes(self, batch: int, seq: int) -> float:
        return self.head.predict(batch, seq)

    def tail_bytes(self, batch: int, seq: int) -> float:
        return self.tail.predict(batch, seq)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "classes": self.classes,
            "direct": [{m.label: {q: f.state_dict() for q, f in fits.items()} for m, fits in d.items()}
                       for d in self.direct],
            "latent": [{k: f.state_dict() for k, f in lat.items()} for lat in self.latent],
            "grad": [f.state_dict() for f in self.grad],
            "head": self.head.state_dict(),
            "tail": self.tail.state_dict(),
            "elem_size": self.elem_size,
            "steps_learned": self.steps_learned,
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["classes"]) != list(self.classes):
            raise ValueError(
                f"cost model state is for {len(state['classes'])} blocks "
                f"({', '.join(sorted(set(state['classes'])))}), this model has {len(self.classes)} "
                f"({', '.join(sorted(set(self.classes)))}); resume with the same model and block selection"
            )
        self.direct = [{Mode.parse(m): {q: Fit.from_state(f) for q, f in fits.items()} for m, fits in d.items()}
                       for d in state["direct"]]
        self.latent = [{k: Fit.from_state(f) for k, f in lat.items()} for lat in state["latent"]]
        self.grad = [Fit.from_state(f) for f in state["grad"]]
        self.head = Fit.from_state(state["head"])
        self.tail = Fit.from_state(state["tail"])
        self.elem_size = int(state["elem_size"])
        self.steps_learned = int(state["steps_learned"])
