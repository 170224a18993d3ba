"""One learned quantity as a function of the batch shape: B samples of E elements each.

E is the whole size of a sample of the main input (S x H for tokens, C x H x W
for images), so it grows with the sequence or the resolution.
`kind="act"` (activations): proportional to T = B*E, plus a T*E term
(attention scores grow with the sequence squared) once two sizes are seen;
before that, a `quadratic` share is assumed when extrapolating to a larger one.
`kind="base"` (gradients, the head): an intercept plus a token term; with one
shape seen it is held constant when shapes shrink and scaled with tokens when
they grow, all but a given `constant` part (bytes known not to depend on the
shape, such as the gradients of the weights whose backward has run).

An `exact` fit predicts a shape it has seen at what was seen there: the terms
through several shapes need not pass through each, and a part that is constant
(FSDP2's gathered parameters) is not proportional to the tokens. Elsewhere the
terms average what varies at one shape (`CostModel.pin_seen_bytes` says where).

The fits are least squares by `torch.linalg.lstsq` on a handful of points;
coefficients are kept non-negative (bytes and seconds do not shrink as a
batch grows) by refitting on one column when the joint fit gives one negative.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

#: Shapes remembered per quantity; past it the least recently observed is dropped.
MAX_SHAPES = 32


class Fit:
    """One quantity as a function of (batch, extent), from the observations so far."""

    def __init__(self, kind: str = "act", span: int = 2, exact: bool = False) -> None:
        if kind not in ("act", "base"):
            raise ValueError(f"Fit kind must be 'act' or 'base', got {kind!r}")
        if span < 1:
            raise ValueError(f"Fit span must be at least 1 observation, got {span}")
        self.kind = kind
        self.span = span
        self.exact = exact  # a shape seen is predicted at what was seen (see the module's docstring)
        self.points: OrderedDict[tuple[int, int], float] = OrderedDict()
        self.counts: dict[tuple[int, int], int] = {}
        self._terms: tuple | None = None  # the least-squares terms of the points as they stand
        self._extents: int | None = None  # how many extents the points hold, as they stand

    def add(self, batch: int, extent: int, value: float, *, provisional: bool = False) -> None:
        """Observe `value` at this shape: the mean of the last observations of it, about `span`
        of them (the plain mean of the first `span`, then each new one weighs 1/span). A
        `provisional` value stands until the next observation, which replaces it.

        Bytes repeat exactly from step to step, and a short span (2) follows a change
        at once; a time is one reading of a noisy clock, and a longer span averages
        the noise out. The shape becomes the most recently used; past `MAX_SHAPES` the
        least recently used one is forgotten, so a shape that keeps coming back stays.
        """
        key = (int(batch), int(extent))
        self._terms = self._extents = None
        old = self.points.pop(key, None)
        n = 0 if old is None else min(self.counts.get(key, 1), self.span - 1)
        self.points[key] = float(value) if old is None else (n * old + float(value)) / (n + 1)
        self.counts[key] = 0 if provisional else n + 1
        while len(self.points) > MAX_SHAPES:
            self.counts.pop(self.points.popitem(last=False)[0], None)

    def __bool__(self) -> bool:
        return bool(self.points)

    def nearest(self, batch: int, extent: int) -> tuple[tuple[int, int], float]:
        """The shape seen with the element count (batch x extent) nearest this one's, and its value."""
        elements = batch * extent
        return min(self.points.items(), key=lambda kv: abs(kv[0][0] * kv[0][1] - elements))

    @property
    def extents(self) -> int:
        """How many extents (lengths) the points hold: a plan asks each fit many times."""
        if self._extents is None:
            self._extents = len({e for _, e in self.points})
        return self._extents

    @property
    def sizes(self) -> int:
        """How many sizes (elements a batch, batch x extent) the points hold."""
        return len({b * e for b, e in self.points})

    @property
    def settled(self) -> bool:
        """Some observation here is more than a provisional one."""
        return any(n > 0 for n in self.counts.values())

    def predict(self, batch: int, extent: int, quadratic: float = 0.0, constant: float = 0.0) -> float:
        """The quantity at this shape; `quadratic`: the share assumed to grow with the extent
        squared ("act"); `constant`: bytes of it that do not grow with the shape ("base")."""
        if not self.points:
            return 0.0
        if self.exact and (seen := self.points.get((batch, extent))) is not None:
            return seen
        elements = batch * extent
        if self.kind == "base":
            return self._base(elements, constant)
        # the nearest shape seen, scaled: tokens linearly, and an assumed quadratic share upwards
        (b0, e0), y0 = self.nearest(batch, extent)
        scale = elements / max(1, b0 * e0)
        guess = y0 * scale * ((1 - quadratic) + quadratic * extent / e0 if extent > e0 else 1.0)
        if self.extents < 2:
            return guess
        lin, quad, offset = self._activation_terms()
        return max(offset + lin * elements + quad * elements * extent, y0 * scale)

    def _activation_terms(self) -> tuple[float, float, float]:
        """(bytes per token, bytes per token x token of sequence, both >= 0, and an offset <= 0);
        solved once per change of the points (a plan asks each fit many times)."""
        if self._terms is None:
            self._terms = self._solve_activation_terms()
        return self._terms

    def _solve_activation_terms(self) -> tuple[float, float, float]:
        shapes = list(self.points)
        columns = torch.tensor([[b * s, b * s * s] for b, s in shapes], dtype=torch.float64)
        y = torch.tensor(list(self.points.values()), dtype=torch.float64)
        if self.extents >= 3:
            # a part that shows only past some size reads as an offset below zero, not as a square:
            # a backward's temporaries less the gradients they overlap (0 at 2 x 128 tokens, then
            # 1.9, 5.9 and 12.5 MiB to 2 x 1,728), fitted through the origin, took a share growing with
            # the sequence and were extrapolated to 298 MiB at 2 x 13,120, where an offload's backward,
            # carried by them, grew with the tokens alone
            ones = torch.ones(len(shapes), 1, dtype=torch.float64)
            offset, lin, quad = _lstsq(torch.cat([ones, columns], 1), y)
            if offset < 0 and lin >= 0 and quad >= 0:
                return lin, quad, offset
            if offset < 0 and quad < 0:  # no square at all: a line below zero at no tokens
                offset, lin = _lstsq(torch.cat([ones, columns[:, :1]], 1), y)
                if offset < 0 and lin >= 0:
                    return lin, 0.0, offset
        lin, quad = _lstsq(columns, y)
        if lin >= 0 and quad >= 0:
            return lin, quad, 0.0
        if quad > 0 > lin:
            return 0.0, max(0.0, _lstsq(columns[:, 1:], y)[0]), 0.0
        return max(0.0, _lstsq(columns[:, :1], y)[0]), 0.0, 0.0

    def _base(self, tokens: int, constant: float) -> float:
        pts = [(b * s, y) for (b, s), y in self.points.items()]
        if self.sizes < 2:
            t0, y0 = max(pts)
            fixed = min(constant, max(y0, 0.0))
            return fixed + (y0 - fixed) * max(1.0, tokens / t0) if y0 > 0 else y0
        if self._terms is None:
            t = torch.tensor([p[0] for p in pts], dtype=torch.float64)
            y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
            center = float(t.mean())
            intercept, slope = _lstsq(torch.stack([torch.ones_like(t), t - center], dim=1), y)
            if slope < 0:
                self._terms = (float(y.mean()), None, center)
            elif intercept < slope * center:
                # below zero at no tokens: the sizes grew faster than in proportion, which a constant part
                # plus a part per token cannot; a step's other changes (its plan, its head's chunks) read as
                # bytes per token where the sizes were close. Through the origin: in proportion at most
                # (block 5 of a Nemotron, 2.49 and 4.72 MiB at 1,504 and 1,554 tokens, was extrapolated
                # to 95.6 MiB at 3,592: a sequence 2.8 times as long as one predicted to fit trained)
                through = float((t * y).sum() / (t * t).sum().clamp_min(1e-300))
                self._terms = (through * center, through, center)
            else:
                self._terms = (intercept, slope, center)
        intercept, slope, center = self._terms
        if slope is None:  # gradients and the head do not shrink with more tokens
            return intercept
        return intercept + slope * (tokens - center)

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "span": self.span,
            "exact": self.exact,
            "points": [[b, s, y, self.counts.get((b, s), 1)] for (b, s), y in self.points.items()],
        }

    @classmethod
    def from_state(cls, state: dict) -> Fit:
        fit = cls(state["kind"], int(state.get("span", 2)), bool(state.get("exact", False)))
        rows = [(int(b), int(s), float(y), int(rest[0]) if rest else 1) for b, s, y, *rest in state["points"]]
        fit.points = OrderedDict(((b, s), y) for b, s, y, _ in rows)
        fit.counts = {(b, s): n for b, s, _, n in rows}
        return fit


def _lstsq(columns: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Least-squares coefficients; columns are scaled to unit norm first (T and T*S
    differ by orders of magnitude), and a rank-deficient system solves on its first column."""
    norms = columns.norm(dim=0).clamp_min(1e-300)
    solution = torch.linalg.lstsq(columns / norms, y.unsqueeze(1), driver="gelsd")
    if columns.shape[1] > 1 and int(solution.rank) < columns.shape[1]:
        first = _lstsq(columns[:, :1], y)
        return first + [0.0] * (columns.shape[1] - 1)
    return (solution.solution.squeeze(1) / norms).tolist()


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence to `values` in least squares (pool adjacent violators:
    a run that falls is replaced by its mean)."""
    runs: list[list[float]] = []  # [mean, count]
    for v in values:
        runs.append([v, 1])
        while len(runs) > 1 and runs[-2][0] > runs[-1][0]:
            (m1, n1), (m2, n2) = runs.pop(-2), runs.pop()
            runs.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in runs for _ in range(n)]
