"""The cost model: what each mode of each block costs, learned from the run itself.

For a batch of B samples of E elements each (the first block's main input,
`recorder.shape_of`: S x H for tokens, C x H x W for images), and per block and
mode, it predicts

  held                bytes the block adds from its start to the next block's start
  forward_transient   transient above its start during its forward
  backward_transient  transient above the start of its backward (a recomputed block
                      rematerializes its activations here)
  seconds             time the mode adds to a step (`adaptmem.control.timings`: its own
                      work, recompute or packing, read within its steps)

plus per block `grad` (what else is alive when its backward starts: gradients
so far, leftovers) and, per step, `head` (the model after the blocks: head and
loss) and `tail` (the backward after the blocks).

Where a mode has run on a block (or on a block alike with it: the same class, made of the same
modules, and the same input size), its own
measurements are used. Elsewhere figures are derived (`adaptmem.control.priors`)
from latent quantities every mode reveals some of: input bytes, output growth,
recomputable activations (a checkpoint's recompute, an offload's packed bytes,
or NONE's held bytes), backward temporaries, the forward transient, and
timings.

Every quantity is a `Fit` (`adaptmem.control.fits`) against the shape: a linear
term in T = B*E and a quadratic one T*E (attention scores), so a size
never seen is predicted before it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from adaptmem.config.policy import Policy
from adaptmem.control.fits import Fit
from adaptmem.control.headcosts import HeadChoice, HeadCosts
from adaptmem.control.planner import Option
from adaptmem.control.priors import (
    CUDA_PRIORS,
    DERIVATIONS,
    HOST_PRIORS,
    LATENT_NAMES,
    Assumptions,
    Figures,
    Latents,
    Priors,
    plain_transient,
)
from adaptmem.control.samples import BlockSample, StepSample
from adaptmem.control.timings import ModeTimes
from adaptmem.modes import LADDER, HeadMode, Mode

_REC = Mode.CHECKPOINT | Mode.OFFLOAD
_CO = Mode.COMPRESS | Mode.OFFLOAD
_FROM_MEASURED = (Mode.NONE, Mode.CHECKPOINT, _REC)  # modes whose derivations follow from measured latents
_QUANTITIES = ("held", "forward_transient", "backward_transient", "seconds")
_TIE_BREAK = 1e-6  # seconds per ladder rung: far below any measured cost
_TIME_SPAN = 4  # observations a time is averaged over (`Fit.span`); bytes keep the default 2


def _is_time(name: str) -> bool:
    """The quantity `name` is a time ("seconds", "..._s"), not bytes."""
    return name == "seconds" or name.endswith("_s")


def _fit(name: str, pinned: bool = False) -> Fit:
    """A new fit for the quantity `name`: a time averages more readings. `pinned`: bytes predicted
    at a shape seen as what was seen there (`Fit.exact`; see `CostModel.pin_seen_bytes`)."""
    return Fit(span=_TIME_SPAN) if _is_time(name) else Fit(exact=pinned)


class CostModel:
    """Per-block, per-mode costs for one instrumented model, learned step by step.

    `priors` default to `CUDA_PRIORS` on CUDA and `HOST_PRIORS` elsewhere.
    `weight_grad_bytes`: per block, its trainable weights' gradient bytes.
    """

    def __init__(
        self,
        classes: list[str],
        policy: Policy,
        *,
        cuda: bool,
        priors: Priors | None = None,
        weight_grad_bytes: list[int] | None = None,
        head_costs: HeadCosts | None = None,
        calls: list[int] | None = None,
        kinds: list[str] | None = None,
    ) -> None:
        self.classes = classes
        # what blocks alike share (`selection.block_kind`: their class, and what is inside them)
        self.kinds = kinds if kinds is not None else classes
        # each block's module, by its first block (a module called more than once a forward is a block
        # per call): a call no step has measured (a loop's last turn) reads as its module's other calls
        self.calls = calls if calls is not None else list(range(len(classes)))
        self.policy = policy
        self.cuda = cuda
        self.priors = priors if priors is not None else (CUDA_PRIORS if cuda else HOST_PRIORS)
        n = len(classes)
        self.direct: list[dict[Mode, dict[str, Fit]]] = [{} for _ in range(n)]
        self.latent: list[dict[str, Fit]] = [{k: _fit(k) for k in LATENT_NAMES} for _ in range(n)]
        # what a block's backward starts with beyond the saved tensors, and the peak after the last
        # block's backward: one fit for steps that allocate the weights' gradients and one for steps
        # that find them kept from the step before (accumulating), which differ by those gradients
        self.grad: list[Fit] = [Fit("base") for _ in range(n)]
        self.grad_resident: list[Fit] = [Fit("base") for _ in range(n)]
        self.tail, self.tail_resident = Fit("base"), Fit("base")
        # before a block's backward, the gradients of the later blocks' weights have been allocated
        # whatever the shape (unless they were there before the step): extrapolated from one shape,
        # they would grow with the tokens
        weights, self._weights_after = weight_grad_bytes or [0] * n, [0.0] * n
        self._weights = list(weights)
        for i in reversed(range(n - 1)):
            self._weights_after[i] = self._weights_after[i + 1] + weights[i + 1]
        self._grads_resident = False  # in the step being planned (`expect_gradients`) or learned
        self.head = Fit("base")
        self.head_costs = head_costs  # the managed loss head's modes (None: no head is managed)
        self.elem_size = 4
        self.steps_learned = 0
        self.pinned = False  # a block's bytes at a shape seen are what was seen there (`pin_seen_bytes`)
        self.provisional = False  # the last step run held a first offload, whose time stands only until the next
        self.offloaded: set[tuple[int, Mode]] = set()  # (block, mode) with OFFLOAD that has run in this process
        self._ran: tuple[Mode, ...] | None = None  # the plan `ran` last added to `offloaded` (a light step's)
        self.cold: set[tuple[int, Mode]] = set()  # (block, mode) whose only time reading is its first offload's
        self.times = ModeTimes(self)  # the seconds each mode adds (adaptmem.control.timings)
        self._latents: dict[tuple[int, int, int], Latents] = {}  # `latents` asked for since the fits last changed
        # the blocks' indices in the order a forward runs them, where that is not their order (a SigLIP's
        # vision tower runs before its text tower, registered first): plans sum what the blocks hold so
        self.order: list[int] | None = None

    def pin_seen_bytes(self) -> None:
        """From now on, a block's own bytes at a shape seen are predicted as what was seen there, not
        by its fitted terms. Under FSDP2 a block's bytes hold its gathered parameters, a constant the
        terms (through the origin) do not fit: they read 200 KB of them plus 300 B per token at 48,
        64 and 80 tokens 18% high at 80, and a plan 14% high at a length where it had run. Elsewhere
        the terms stay: pinned everywhere, the demo's mean prediction error was 10.4% to 10.8% in
        three runs, against 8.1% with the terms."""
        if self.pinned:
            return
        self.pinned = True
        for by_mode in self.direct:
            for fits in by_mode.values():
                for name, fit in fits.items():
                    fit.exact = not _is_time(name)

    @property
    def grads_resident(self) -> bool:
        """The step planned for starts with the weights' gradients allocated (accumulation): the
        figures of the gradients and the tail are those of that state."""
        return self._grads_resident

    def expect_gradients(self, resident: bool) -> None:
        """The step about to be planned starts with (True) or without the weights' gradients."""
        self._grads_resident = resident

    @contextlib.contextmanager
    def expecting(self, resident: bool) -> Iterator[None]:
        """Figures of a step that starts with (True) or without the weights' gradients, inside; the
        state planned before, after."""
        before, self._grads_resident = self._grads_resident, resident
        try:
            yield
        finally:
            self._grads_resident = before

    def snapshot(self) -> tuple:
        """Everything learned, to put back with `restore` (a batch given up leaves no trace)."""
        return self.state_dict(), self.provisional, set(self.offloaded), set(self.cold)

    def restore(self, snapshot: tuple) -> None:
        state, self.provisional, offloaded, cold = snapshot
        self.load_state_dict(state)
        self.offloaded, self.cold = set(offloaded), set(cold)
        self._ran = None

    @property
    def known(self) -> bool:
        return self.steps_learned > 0

    def measured(self, batch: int, extent: int) -> bool:
        """This very shape has been measured block by block (among the shapes the fits keep)."""
        return bool(self.latent) and (int(batch), int(extent)) in self.latent[0]["input_bytes"].points

    def ran_here(self, modes: tuple[Mode, ...], batch: int, extent: int) -> bool:
        """Each block has run its mode in `modes` at this very shape, measured block by block: the
        plan's figures are its own, not carried from a block alike or from other sizes."""
        key = (int(batch), int(extent))
        for fits, mode in zip(self.direct, modes):
            held = fits.get(mode, {}).get("held")
            if held is None or key not in held.points:
                return False
        return True

    def ran(self, modes: tuple[Mode, ...]) -> None:
        """A step not measured block by block runs `modes`: its offloads allocate their host memory,
        and it is the last step run, so none of its offloads is a first one learned (`provisional`)."""
        if modes is not self._ran:  # steady steps run the one cached plan: added once
            self.offloaded.update((i, m) for i, m in enumerate(modes) if m.offloads)
            self._ran = modes
        self.provisional = False

    # ---------------------------------------------------------------- learn
    def learn(self, sample: StepSample) -> None:
        """What a step measured block by block shows. One with two forwards before its backward
        (`overlapped`) shows the first forward's blocks whole, but for what the second changed
        around them: its backward ran first and allocated every weight's gradient, so the first's
        blocks' backward starts tell nothing of the gradients (`grad`) and allocate none of their
        own; and the first's head and loss ran beside the second forward: where the forwards ran
        alike (`forwards`), the head is learned at all their samples from the peak between the
        second's start and the first's backward, the one a step of them all peaks at (`_learn_head`)."""
        if not sample.blocks or sample.batch * sample.extent == 0:
            return
        b, s = sample.batch, sample.extent
        start0 = sample.blocks[0].start
        self.provisional = False
        run = [blk.index for blk in sample.blocks]
        if not sample.overlapped and sorted(run) == list(range(len(self.direct))):
            self.order = None if run == sorted(run) else run
        self.elem_size = sample.blocks[0].elem_size or self.elem_size
        self._grads_resident = sample.grads_resident
        prefix = 0
        for blk in sample.blocks:
            if blk.index >= len(self.direct) or blk.held is None:
                continue
            prefix += blk.held
            self._learn_block(blk, b, s, 0.0 if sample.overlapped else self.own_grads(blk.index))
            if blk.bwd_start is not None and not sample.overlapped:
                grad = self.grad_resident if sample.grads_resident else self.grad
                grad[blk.index].add(b, s, blk.bwd_start - (start0 + prefix))
        if sample.head_top and sample.backward_reached and not sample.overlapped:
            # (the head's peak is whole once the backward reached a block: a step that ran out of
            # memory before, in a block's forward or in the head, read a part of it)
            self._learn_head(sample, b, s, sample.head_top - (start0 + prefix))
        elif sample.overlapped and sample.forwards > 1 and sample.overlap_top and sample.backward_reached:
            # forwards alike, their backward run from the last: from the second's start to the first's
            # backward, the peak stands above every forward's blocks, as a lone forward of all their
            # samples stands above its blocks, which is how such a step is planned
            n = sample.forwards
            self._learn_head(sample, b * n, s, sample.overlap_top - (start0 + n * prefix))
        if sample.completed:
            # above the first block's start, where plans add it: from the step's start, what runs before
            # the blocks (a ResNet's stem) was counted twice
            tail = self.tail_resident if sample.grads_resident else self.tail
            tail.add(b, s, max(sample.tail_top, start0) - start0)
        self.steps_learned += 1
        self._latents = {}  # the fits changed

    def _learn_head(self, sample: StepSample, b: int, s: int, above: float) -> None:
        """The head and loss's peak above the blocks' saved bytes, at batch `b`."""
        if self.head_costs is not None and sample.head is not None:
            self.head_costs.learn(sample.head, b, s, above)
        else:
            self.head.add(b, s, above)

    def _learn_block(self, blk: BlockSample, b: int, s: int, own: float) -> None:
        """`own`: the bytes of the block's weights' gradients its backward allocated."""
        mode, lat = blk.mode, self.latent[blk.index]
        x = blk.input_bytes
        lat["input_bytes"].add(b, s, x)
        lat["output_growth"].add(b, s, max(0, blk.output_bytes - x))
        fits = self.direct[blk.index].setdefault(mode, {q: _fit(q, self.pinned) for q in _QUANTITIES})
        fits["held"].add(b, s, max(0, blk.held))
        fits["forward_transient"].add(b, s, blk.fwd_peak)
        complete = blk.bwd_peak is not None and blk.bwd_seconds is not None
        # a backward's transient less its weights' gradients, allocated there whatever the shape: fitted
        # as activations, they would grow with the tokens (NONE's backward, 3 MiB of them at 128 tokens,
        # was predicted at 22 MiB for 1750)
        if complete:
            fits["backward_transient"].add(b, s, max(0, blk.bwd_peak - own))
        activations, act = _revealed_activations(blk), lat["activations"]
        if activations is not None:
            if act.points and not act.settled:  # stand-ins only (below): the first reading replaces them
                lat["activations"] = act = _fit("activations")
            act.add(b, s, max(0, activations))
        elif mode in (Mode.OFFLOAD, Mode.COMPRESS, _CO) and blk.packed > 0 and not act.settled:
            # nothing has shown this block's activations yet (a calibration that ran out of memory before
            # its recompute, retried under OFFLOAD: NONE was then planned at half its peak): what it
            # packed stands for them, erring high (every saved view counts apart), until a recompute
            # or NONE shows them
            act.add(b, s, blk.packed, provisional=True)
        residue = blk.on_device if mode is Mode.OFFLOAD else blk.residue
        if residue is not None:
            lat["residue"].add(b, s, residue)
        if mode in (Mode.CHECKPOINT, _REC, Mode.OFFLOAD, _CO):
            lat["forward_transient"].add(b, s, blk.fwd_peak)
        if complete and mode is Mode.NONE:
            lat["backward_temp"].add(b, s, max(0, blk.bwd_peak - own))
        elif complete and mode is Mode.CHECKPOINT and blk.recompute_bytes is not None:
            lat["backward_temp"].add(b, s, max(0, blk.bwd_peak - blk.recompute_bytes - own))
        if mode in (Mode.NONE, Mode.CHECKPOINT):  # a plain forward (SELECTIVE's also holds its weight layers' outputs)
            lat["forward_s"].add(b, s, blk.fwd_seconds)
        if mode in (Mode.NONE, Mode.SELECTIVE):
            fits.setdefault("forward_s", _fit("forward_s")).add(b, s, blk.fwd_seconds)
        if complete:
            # a block's first offload allocates the host memory its copies go to (pinned, on CUDA):
            # its time stands only until the next reading, which replaces it; that step is measured
            first = bool(mode & Mode.OFFLOAD) and (blk.index, mode) not in self.offloaded
            if first:
                self.offloaded.add((blk.index, mode))
                self.provisional = True
                self.cold.add((blk.index, mode))
            else:
                self.cold.discard((blk.index, mode))
            total = blk.fwd_seconds + blk.bwd_seconds
            if mode is Mode.NONE:
                lat["none_s"].add(b, s, total)
            elif mode is Mode.CHECKPOINT:
                lat["recompute_s"].add(b, s, blk.recompute_seconds)
                lat["none_s"].add(b, s, max(0.0, total - blk.recompute_seconds))
            fits["seconds"].add(b, s, total, provisional=first)
            if blk.recompute_seconds > 0:
                fits.setdefault("recompute_s", _fit("recompute_s")).add(b, s, blk.recompute_seconds)
            if blk.moved_seconds is not None and mode & (Mode.OFFLOAD | Mode.COMPRESS):
                fits.setdefault("moved_s", _fit("moved_s")).add(b, s, blk.moved_seconds, provisional=first)

    # -------------------------------------------------------------- predict
    def figures(self, index: int, mode: Mode, batch: int, extent: int) -> Figures:
        """Predicted figures of `mode` on block `index` for a batch of `batch` x `extent`.

        A mode measured on this block (or one alike with it) anchors the level. Its own fit
        is used within the range of lengths it was measured at; beyond that, or
        from a single length, the measurement is carried to the new shape by how
        the derived figures scale, since the latents learn the shape from every mode.
        """
        derived = self._derive(mode, self.latents(index, batch, extent), self.times.covers(index, mode, batch, extent))
        fits = self.direct[index].get(mode) or self.sibling(index, mode, batch, extent)
        if fits is None or not fits["held"]:
            return replace(derived, backward_transient=derived.backward_transient + self.own_grads(index))
        extents = {s for _, s in fits["held"].points}
        if (batch, extent) in fits["held"].points or (len(extents) >= 2 and min(extents) <= extent <= max(extents)):
            q = self.policy.quadratic_prior
            held, forward_transient = (
                fits["held"].predict(batch, extent, q),
                fits["forward_transient"].predict(batch, extent, q),
            )
            backward_transient = (
                fits["backward_transient"].predict(batch, extent, q)
                if fits["backward_transient"]
                else derived.backward_transient
            )
        else:
            tokens = batch * extent
            (b0, e0), _ = fits["held"].nearest(batch, extent)
            there = self._derive(mode, self.latents(index, b0, e0))  # its bytes: no covers needed
            linear = tokens / max(1, b0 * e0)

            def carry(fit: Fit, here: float, at: float, least: float = 0.0) -> float:
                # a derivation from measured latents differs from the block's own figure by a constant
                # (a checkpoint's backward at 128 tokens holds part of its weights' gradients: scaled,
                # that grew 21-fold, 64 MiB at 2727 tokens for 121), a guess by a share (an offload's
                # backward brings back 0.7 of what the guess holds): offset the one, scale the other,
                # by no less than `least`
                measured = fit.points[(b0, e0)]
                if mode in _FROM_MEASURED:
                    return max(0.0, measured + here - at)
                return measured * max(least, here / at if at > 0 else linear)

            # a forward's peak holds the plain forward's transient (the attention's scores, say), which
            # no mode removes: it grows at least as that does. A guess that adds what a mode keeps grows
            # slower where the transient is quadratic: a GptOss's SELECTIVE, measured at 768 tokens
            # alone, was carried to 172 MiB at 2 x 1,296, where its plain forward's transient was 189
            plain = plain_transient(self.latents(index, b0, e0))
            growth = plain_transient(self.latents(index, batch, extent)) / plain if plain > 0 else 0.0
            held = carry(fits["held"], derived.held, there.held)
            forward_transient = carry(
                fits["forward_transient"], derived.forward_transient, there.forward_transient, growth
            )
            backward_transient = (
                carry(fits["backward_transient"], derived.backward_transient, there.backward_transient)
                if (b0, e0) in fits["backward_transient"].points
                else derived.backward_transient
            )
        return Figures(
            held,
            forward_transient,
            backward_transient + self.own_grads(index),
            self.times.seconds(index, mode, batch, extent, derived),
            derived.host,
        )

    def own_grads(self, index: int) -> float:
        """The gradients of block `index`'s own weights, allocated in its backward: kept where none
        were there before, added into the resident ones and freed where the step accumulates. A
        Llama's layer peaked as high in its backward either way; taken as none when resident,
        the steps that accumulate taught each block's transient its weights' gradients at one
        size and not at another, and the fit through them predicted a length that ran out of
        memory in the first step's backward."""
        return float(self._weights[index])

    def latents(self, index: int, batch: int, extent: int) -> Latents:
        """Block `index`'s latents at a shape; kept until the cost model learns or is loaded (a plan
        asks for each block's at one shape once per mode, and at the shapes they were measured at)."""
        key = (index, batch, extent)
        if len(self._latents) > 4096:
            self._latents = {}
        got = self._latents.get(key)
        if got is None:
            q = self.policy.quadratic_prior
            values = {k: self._latent(index, k, batch, extent, q) for k in self.latent[index]}
            if not self.latent[index]["residue"].settled and self._twin(index, "residue", batch, extent) is None:
                # counted on no block of its kind yet: the prior's share of its activations
                values["residue"] = self.priors.offload_residue_share * values["activations"]
            got = self._latents[key] = Latents(**values)
        return got

    def _latent(self, index: int, name: str, batch: int, extent: int, quadratic: float) -> float:
        """Latent `name` of block `index` at a shape: its own fit, or carried (`_carried`) where it was
        seen at one length, or at fewer than a block alike (`_guide`)."""
        fit = self.latent[index][name]
        if not fit.settled:
            # never seen on this block (or only stood in for): as its module's other calls saw it, else
            # as a block alike did (a calibration that ran out of memory in the second block's backward
            # had recomputed the last block alone, and its others, read 0 bytes of activations, were
            # planned in NONE at half their peak)
            twin = self._twin(index, name, batch, extent)
            if twin is not None:
                return self._latent(twin, name, batch, extent, quadratic)
        guide = self._guide(index, name, batch, extent)
        if guide is None and _extents(fit) != 1:
            return fit.predict(batch, extent, quadratic)
        return self._carried(index, name, batch, extent, guide)

    def _twin(self, index: int, name: str, batch: int, extent: int) -> int | None:
        """The block that has seen latent `name` and stands for block `index`, which has not: another
        call of its module, else the block alike with it that saw it at the most lengths."""
        latent, calls = self.latent, self.calls
        twin = next((j for j, m in enumerate(calls) if m == calls[index] and latent[j][name].settled), None)
        if twin is None:
            group = self.times.alike_groups(batch, extent)[index]
            seen = [j for j in group if latent[j][name].settled]
            twin = max(seen, key=lambda j: _extents(latent[j][name])) if seen else None
        return twin

    def _carried(self, index: int, name: str, batch: int, extent: int, guide: Fit | None) -> float:
        """A latent seen at fewer lengths than on a block alike (its class, its input size), carried
        from its own nearest reading as that block's grows (`guide`, `_guide`'s); one seen at a single
        length with no such block, as the block's activations grow (bytes), else by the assumed
        quadratic share. A forward transient seen at 128 tokens alone, grown with the prior's
        quadratic share, was predicted at 265 MiB for 2389 tokens, where its siblings, seen at three
        lengths, showed it linear: 47 MiB."""
        fit = self.latent[index][name]
        seen = fit.points.get((batch, extent)) if fit.kind == "act" else None
        if seen is not None:  # measured at this very shape: every guide carries it to itself
            return seen
        if guide is None and not _is_time(name):
            group = self.times.alike_groups(batch, extent)[index]
            guide = next(
                (self.latent[j]["activations"] for j in self._spanning(group, "activations", batch, extent)), None
            )
        if guide is None:
            return fit.predict(batch, extent, self.policy.quadratic_prior)
        (b0, e0), y0 = fit.nearest(batch, extent)
        there = guide.predict(b0, e0)
        return y0 * guide.predict(batch, extent) / there if there > 0 else fit.predict(batch, extent)

    def _guide(self, index: int, name: str, batch: int, extent: int) -> Fit | None:
        """Latent `name` on the block alike with `index` that saw it at the most lengths, where that is
        more than `index` saw, and as long a length. Two lengths leave a part that shows only past some
        size (a backward's temporaries less the gradients they overlap: 1.4 and 12.5 MiB at 2 x 320 and
        2 x 1,728 tokens) read as a square: extrapolated to 401 MiB at 2 x 13,120 tokens, where a block
        alike, seen at four lengths, read 102 (an offload's backward, carried by it, was 257 there)."""
        fit = self.latent[index][name]
        if not fit.points:
            return None
        own, longest = _extents(fit), max(e for _, e in fit.points)
        for j in self._spanning(self.times.alike_groups(batch, extent)[index], name, batch, extent):
            other = self.latent[j][name]
            if j != index and (own < 2 or (_extents(other) > own and max(e for _, e in other.points) >= longest)):
                return other
        return None

    def _spanning(self, group: tuple[int, ...], name: str, batch: int, extent: int) -> list[int]:
        """The blocks of `group` whose latent `name` was seen at two lengths or more, most lengths first
        (kept with the figures pooled at this shape: every block of the group asks)."""
        pool = self.times.shape_pool(batch, extent)
        key = ("spanning", group, name)
        if key not in pool:
            spanning = [j for j in group if _extents(self.latent[j][name]) >= 2]
            pool[key] = sorted(spanning, key=lambda j: -_extents(self.latent[j][name]))
        return pool[key]

    def sibling(self, index: int, mode: Mode, batch: int, extent: int) -> dict[str, Fit] | None:
        """The fits of `mode` on the first block alike with `index` (`times.group`: its class, its input
        size) that has run it. A block of the same class in another stage of a network holds
        another size: a CNN's later stage, borrowed for the first ones, put SELECTIVE on three
        stages at 96 pixels that ran at 1.14x the budget."""
        for j in self.times.group(index, batch, extent):
            if j != index and mode in self.direct[j] and self.direct[j][mode]["held"]:
                return self.direct[j][mode]
        return None

    def _derive(self, mode: Mode, lat: Latents, covers: tuple[float, float] = (0.0, 0.0)) -> Figures:
        """A mode's figures from the latents (`DERIVATIONS`), with the compute an offloaded copy
        hides behind (`covers`: out, back), plus a lossy mode's penalty."""
        assumptions = Assumptions(self.priors, self.policy.prior_margin, self._kappa(), *covers)
        figures = DERIVATIONS[mode](lat, assumptions)
        return replace(figures, seconds=figures.seconds + self.penalty(mode, lat))

    def _kappa(self) -> float:
        """Compressed bytes per original byte under the policy's codec."""
        elem = max(1, self.elem_size)
        if self.policy.compress_codec == "bf16":
            return min(1.0, 2 / elem)
        return min(1.0, (1 + 4 / self.policy.compress_group_size) / elem)

    def penalty(self, mode: Mode, lat: Latents) -> float:
        """Planner cost of a lossy mode: a share of the block's forward time (policy.compress_penalty)."""
        return self.policy.compress_penalty * lat.forward_s if Mode.COMPRESS in mode else 0.0

    def options(
        self, batch: int, extent: int, allowed: tuple[Mode, ...], fixed: dict[int, Mode] | None = None
    ) -> list[list[Option]]:
        """Planner input: each block's options, with its `grad` term folded into `need`."""
        fixed = fixed or {}
        out, n = [], len(self.classes)
        for i in range(n):
            grad = self.grad_bytes(i, batch, extent)
            modes = (fixed[i],) if i in fixed else allowed
            row = []
            for mode in modes:
                f = self.figures(i, mode, batch, extent)
                # ties (a mode whose measured cost is within noise of zero) go to the simpler mode, and
                # an offload to the earlier block: the later blocks' compute hides its copies both ways
                seconds = f.seconds + _TIE_BREAK * (LADDER.index(mode) + (i / n if mode & Mode.OFFLOAD else 0.0))
                row.append(
                    Option(
                        mode, f.held, max(f.forward_transient, f.held + grad + f.backward_transient), seconds, f.host
                    )
                )
            out.append(row)
        return out

    def grad_constant(self, index: int) -> float:
        """The part of block `index`'s `grad` that does not grow with the shape: the gradients of the
        later blocks' weights, allocated in the step (none where they were resident from the one before)."""
        return 0.0 if self.grads_resident else self._weights_after[index]

    def grad_bytes(self, index: int, batch: int, extent: int) -> float:
        """What block `index`'s backward starts with beyond the saved tensors, in a step of the
        state planned (`grads_resident`): learned in that state, or, for a first step that finds
        the gradients resident, what a step allocating them starts with less the later blocks' ones."""
        fit, after = self.grad_resident[index], self._weights_after[index]
        if self.grads_resident and fit:
            return _across_states(fit, self.grad[index], batch, extent, other_constant=after)
        # none learned (every step ran two forwards): the later blocks' gradients, at least
        fresh = _across_states(self.grad[index], fit, batch, extent, own_constant=after) if self.grad[index] else after
        return max(0.0, fresh - after) if self.grads_resident else fresh

    def head_bytes(self, batch: int, extent: int, head: HeadChoice | None = None) -> float:
        """The head and loss after the blocks: the managed head's figure for `head`, else learned."""
        costs = self.head_costs
        if costs is not None and head is not None:
            if head.mode is HeadMode.KEPT:
                return costs.kept_bytes(batch, extent)
            return costs.chunked_bytes(batch, extent, head.chunk or 1)
        return self.head.predict(batch, extent)

    def tail_bytes(self, batch: int, extent: int) -> float:
        """The peak after the blocks' backward, above the first block's start, in the state planned."""
        if self.grads_resident and self.tail_resident:
            return _across_states(self.tail_resident, self.tail, batch, extent)
        return _across_states(self.tail, self.tail_resident, batch, extent)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "classes": self.classes,
            "direct": [
                {m.label: {q: f.state_dict() for q, f in fits.items()} for m, fits in d.items()} for d in self.direct
            ],
            "latent": [{k: f.state_dict() for k, f in lat.items()} for lat in self.latent],
            "grad": [f.state_dict() for f in self.grad],
            "grad_resident": [f.state_dict() for f in self.grad_resident],
            "head": self.head.state_dict(),
            "tail": self.tail.state_dict(),
            "tail_resident": self.tail_resident.state_dict(),
            "head_costs": self.head_costs.state_dict() if self.head_costs is not None else None,
            "elem_size": self.elem_size,
            "steps_learned": self.steps_learned,
            "order": self.order,
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["classes"]) != list(self.classes):
            raise ValueError(
                f"cost model state is for {len(state['classes'])} blocks "
                f"({', '.join(sorted(set(state['classes'])))}), this model has {len(self.classes)} "
                f"({', '.join(sorted(set(self.classes)))}); resume with the same model and block selection"
            )
        self.direct = [
            {Mode.parse(m): {q: Fit.from_state(f) for q, f in fits.items()} for m, fits in d.items()}
            for d in state["direct"]
        ]
        self.latent = [
            {k: Fit.from_state(lat[k]) if k in lat else _fit(k) for k in LATENT_NAMES} for lat in state["latent"]
        ]
        self.grad = [Fit.from_state(f) for f in state["grad"]]
        self.grad_resident = [Fit.from_state(f) for f in state["grad_resident"]]
        self.head = Fit.from_state(state["head"])
        self.tail = Fit.from_state(state["tail"])
        self.tail_resident = Fit.from_state(state["tail_resident"])
        if self.head_costs is not None and state.get("head_costs"):
            self.head_costs.load_state_dict(state["head_costs"])
        self.elem_size = int(state["elem_size"])
        self.steps_learned = int(state["steps_learned"])
        order = state.get("order")
        self.order = [int(i) for i in order] if order is not None else None
        self.times.forget()  # its pools are kept per steps learned, which may have gone back
        self._latents = {}  # the fits changed


def _extents(fit: Fit) -> int:
    """How many lengths (extents) a fit has seen."""
    return fit.extents


def _revealed_activations(blk: BlockSample) -> float | None:
    """The block's recomputable activations, as far as its mode shows them: a checkpoint's
    recompute, or NONE's held bytes less input and output; both count storages. A pack hook
    sees every saved view apart (a block's views of one storage, 11% more than its storages at
    512 tokens, and more the longer): mixed with the others, its readings made a quadratic term
    of nothing, so packing modes teach only their own figures."""
    mode = blk.mode
    if mode in (Mode.CHECKPOINT, _REC) and blk.recompute_bytes is not None:
        return blk.recompute_bytes
    if mode is Mode.NONE:
        return blk.held - blk.input_bytes - max(0, blk.output_bytes - blk.input_bytes)
    return None


def _across_states(
    own: Fit, other: Fit, batch: int, extent: int, own_constant: float = 0.0, other_constant: float = 0.0
) -> float:
    """A figure of a step in one gradients' state (`own`: resident, as in accumulation, or not) from
    its own fit, or, where that state was seen at one size and the other state at more, the other's
    figure shifted by the difference measured where `own` was seen. What the resident gradients
    change does not grow with the shape. A figure from one size scaled with the tokens read the tail
    four times over six times past it (an embedding's gradient is most of it), and a second
    micro-batch at a new length was planned as unfit; the other way round, a loop that zeroes the
    gradients after its optimizer step, handed a state learned under Lightning's closure (whose
    steps all start with them), had a step 14 times the first's length predicted at 94 MiB where it
    took 41."""
    if not own.points or own.sizes >= 2 or other.sizes < 2:
        return own.predict(batch, extent, constant=own_constant)
    shift = sum(y - other.predict(b, e, constant=other_constant) for (b, e), y in own.points.items())
    return max(0.0, other.predict(batch, extent, constant=other_constant) + shift / len(own.points))
