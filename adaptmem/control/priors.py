"""What a mode costs before it has run: named priors, and one small derivation per mode.

Every mode reveals some of a block's latent quantities (`Latents`): a
checkpointed block shows what its recompute rematerializes, an offloaded one
how many bytes its pack hook saw, NONE what it keeps. From them each mode's
figures are derived by a function of its own (`DERIVATIONS`), using the
device's `Priors` for what no measurement shows (link speed, overlap, codec
speed, how much SELECTIVE keeps).

Margins: a figure that follows from measured latents (NONE from a checkpoint's
recompute, say) is inflated by the `measured` margin; a guess (how much
selective checkpointing keeps, how lazily offloaded tensors come back) by the
policy's full `prior_margin`, the `guess` margin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from adaptmem.modes import Mode

if TYPE_CHECKING:
    from adaptmem.strategies.offload import OffloadOptions


@dataclass(frozen=True)
class Priors:
    """What the cost model assumes about the hardware until it has measured."""

    link_bytes_per_s: float
    "Host link speed, one way (bytes/s), for moving offloaded tensors out and back."

    hidden_share: float
    "Share of transfer time hidden behind compute (0..1): side-stream copies overlap kernels."

    codec_bytes_per_s: float
    "Quantize plus dequantize throughput (bytes/s of the original tensor) for COMPRESS."

    prefetches: bool
    "Backward brings the next block's offloaded tensors back early: one more block resident."

    selective_keep_share: float = 0.5
    "Share of recomputable activations SELECTIVE keeps: its weight layers' outputs, about half of a block's."

    selective_recompute_share: float = 0.2
    "Share of a full recompute's time SELECTIVE pays: all but the weight layers (0.14 read side by side, CPU)."

    offload_residue_share: float = 0.02
    """Share of activations OFFLOAD leaves on the device (tensors under min_bytes) until a block's
    checkpointed forward, or its offload, has counted them (`Latents.residue`)."""

    unpacked_share: float = 0.5
    """Share of a compressing mode's moved bytes live at once in its block's backward, where each saved
    tensor is decoded (and, with no prefetch, copied back) only as autograd reads it and goes once its
    node has run: on the stand-in, a Llama-like block's COMPRESS backward held 0.38 of them,
    COMPRESS+OFFLOAD's 0.45 (OFFLOAD's 0.51; its guess keeps every tensor back at once: it is tried on
    a block and measured, and a plan's reach at long lengths is carried from that measurement by how
    this guess grows, which the lower share made steeper)."""

    measured_margin_share: float = 0.2
    "Share of the policy's prior_margin applied to figures that follow from measurements."

    in_flight_cap: float = 0.0
    "Device bytes of offloaded copies that may be in flight (`OffloadOptions.max_in_flight_bytes`); 0: instant."

    covered_by_compute: bool = False
    """Copies travel while the rest of the step computes: one going out hides behind the forward
    of the blocks after it, one coming back (prefetched) behind the next block's backward. False:
    a flat `hidden_share` of every copy hides."""

    back_covered: bool = True
    "With `covered_by_compute`, a copy coming back is prefetched (`OffloadOptions.prefetch`)."

    copy_bytes_per_s: float = 0.0
    "Host work per byte an offload copies out and back, which no compute hides (a memcpy); 0: none."


#: CUDA: pinned copies over PCIe 4.0 x16 reach ~12 GB/s one way, and copies on a side
#: stream hide behind about 70% of a block's kernels; quantize kernels are memory-bound.
CUDA_PRIORS = Priors(link_bytes_per_s=12e9, hidden_share=0.7, codec_bytes_per_s=100e9, prefetches=True)

#: The host (and the CPU stand-in): an offload is a synchronous memcpy in RAM, nothing
#: overlaps, and quantizing runs on the CPU.
HOST_PRIORS = Priors(link_bytes_per_s=4e9, hidden_share=0.0, codec_bytes_per_s=1.5e9, prefetches=False)


#: The stand-in's pack and unpack hooks copy in host RAM besides the link's travel time, as
#: fast as the host's own offload: 3.1 to 5.8 ms for an 18 MB block out and back, side by side.
STAND_IN_COPY_BYTES_PER_S = HOST_PRIORS.link_bytes_per_s


def priors_for(probe: object, cuda: bool, options: Sequence[OffloadOptions] = ()) -> Priors:
    """The priors for a probe: CUDA's, or the host's with the speed of a stand-in's link
    (`SimulatedDevice(link_bytes_per_s=...)`), whose copies travel while compute goes on.
    Where copies take time, the blocks' `options` say how many bytes of them may be in
    flight (`max_in_flight_bytes`; None: a block's worth) and whether backward prefetches."""
    windows = [o.max_in_flight_bytes for o in options]
    in_flight = math.inf if None in windows else max(windows, default=0)
    if cuda:
        return replace(CUDA_PRIORS, in_flight_cap=in_flight)
    link = getattr(probe, "link_bytes_per_s", None)
    if not link:
        return HOST_PRIORS
    # its copies travel while compute goes on; it allocates a copy back only when backward needs
    # it (no prefetched block resident), though a prefetch starts its travel a block early
    return replace(
        HOST_PRIORS,
        link_bytes_per_s=link,
        in_flight_cap=in_flight,
        covered_by_compute=True,
        copy_bytes_per_s=STAND_IN_COPY_BYTES_PER_S,
        back_covered=all(o.prefetch for o in options),
    )


@dataclass(frozen=True)
class Latents:
    """A block's latent quantities at one shape (bytes and seconds), as learned so far."""

    input_bytes: float = 0.0  # X: the block's inputs that require grad
    output_growth: float = 0.0  # O: output bytes beyond the input
    activations: float = 0.0  # A: what a recompute rematerializes (the block's saved activations)
    backward_temp: float = 0.0  # D: backward's temporaries above what was saved
    forward_transient: float = 0.0  # peak above the block's start during a forward that keeps little
    residue: float = 0.0  # of the input and activations, what OFFLOAD leaves on the device (under its min_bytes)
    forward_s: float = 0.0  # the block's forward
    recompute_s: float = 0.0  # a full recompute in backward
    none_s: float = 0.0  # forward + backward under NONE


LATENT_NAMES = tuple(f.name for f in fields(Latents))


@dataclass(frozen=True)
class Figures:
    """One mode's predicted figures on one block (bytes, seconds)."""

    held: float  # bytes the block adds until the next block starts (kept for backward, and its output)
    forward_transient: float  # transient above its start during its forward
    backward_transient: float  # transient above the start of its backward
    seconds: float  # time the mode adds to a step
    host: float  # host bytes it keeps


@dataclass(frozen=True)
class Assumptions:
    """What a derivation needs beside the latents."""

    priors: Priors
    guess: float  # the policy's prior_margin
    kappa: float  # compressed bytes per original byte
    out_cover_s: float = 0.0  # compute after the block's forward a copy out can hide behind
    back_cover_s: float = 0.0  # compute before the block's backward a copy back can hide behind

    @property
    def measured(self) -> float:
        return 1.0 + (self.guess - 1.0) * self.priors.measured_margin_share

    def transfer_s(self, nbytes: float) -> float:
        """Out to the host and back, less what overlaps, plus the host's own work on the copies.

        Where copies are covered by compute, each way costs what its travel outlasts the compute
        it hides behind: on the stand-in's link, offloading only the first block cost its copies'
        host work alone, and only the last, twice its travel besides."""
        p = self.priors
        work = 2 * nbytes / p.copy_bytes_per_s if p.copy_bytes_per_s else 0.0
        travel = nbytes / p.link_bytes_per_s
        if not p.covered_by_compute:
            return work + 2 * travel * (1 - p.hidden_share)
        back = self.back_cover_s if p.back_covered else 0.0
        return work + max(0.0, travel - self.out_cover_s) + max(0.0, travel - back)

    def codec_s(self, nbytes: float) -> float:
        return 2 * nbytes / self.priors.codec_bytes_per_s

    def prefetched(self, nbytes: float) -> float:
        return nbytes if self.priors.prefetches else 0.0

    def brought_back(self, nbytes: float) -> float:
        """Of `nbytes` a block's backward brings back from the host, what is on the device at once:
        all of it where it is prefetched as a group, else the tensors autograd is reading."""
        return nbytes if self.priors.prefetches else self.priors.unpacked_share * nbytes

    def decoded(self, nbytes: float) -> float:
        """Of `nbytes` compressed for backward, what is decoded at once: each tensor as autograd reads it."""
        return self.priors.unpacked_share * nbytes

    def in_flight(self, nbytes: float, forward_s: float) -> float:
        """Of `nbytes` sent during a forward of `forward_s` seconds, what has not arrived when it
        ends: the backlog the link could not clear, within the window of copies in flight."""
        backlog = nbytes - self.priors.link_bytes_per_s * forward_s
        return min(self.priors.in_flight_cap, max(0.0, backlog))


def _irreducible(lat: Latents) -> float:
    """What a block keeps that no mode removes: its input and its output's growth."""
    return lat.input_bytes + lat.output_growth


def plain_transient(lat: Latents) -> float:
    """A plain forward's transient above the block's start: what every mode's forward peak holds."""
    return lat.forward_transient or (lat.activations + lat.input_bytes)


def _moved(lat: Latents) -> float:
    """Bytes a packing mode sees: the input and the activations."""
    return lat.input_bytes + lat.activations


def none(lat: Latents, a: Assumptions) -> Figures:
    """Keeps everything: its figures follow from the latents."""
    held = _irreducible(lat) + lat.activations
    return Figures(
        a.measured * held, a.measured * max(plain_transient(lat), held), a.measured * lat.backward_temp, 0.0, 0.0
    )


def selective(lat: Latents, a: Assumptions) -> Figures:
    """Keeps a share of the activations, recomputes the rest at a share of a recompute's time."""
    keep = a.priors.selective_keep_share * lat.activations
    recompute = lat.recompute_s or lat.forward_s
    return Figures(
        a.guess * (_irreducible(lat) + keep),
        a.guess * (plain_transient(lat) + keep),
        a.measured * (lat.activations + lat.backward_temp),
        a.priors.selective_recompute_share * recompute,
        0.0,
    )


def checkpoint(lat: Latents, a: Assumptions) -> Figures:
    """Keeps the input; rematerializes the activations in backward, for one more forward."""
    return Figures(
        a.measured * _irreducible(lat),
        a.measured * plain_transient(lat),
        a.measured * (lat.activations + lat.backward_temp),
        lat.recompute_s or lat.forward_s,
        0.0,
    )


def offload(lat: Latents, a: Assumptions) -> Figures:
    """Sends input and activations to the host; they come back (prefetched on CUDA) in backward."""
    move = _moved(lat)  # the residue among it, counted as moved too: a guess errs high
    held = _irreducible(lat) + min(lat.residue, move) + a.in_flight(move, lat.forward_s)
    return Figures(
        a.guess * held,
        a.guess * plain_transient(lat),
        a.guess * (move + lat.backward_temp + a.prefetched(move)),
        a.transfer_s(move),
        move,
    )


def checkpoint_offload(lat: Latents, a: Assumptions) -> Figures:
    """CHECKPOINT with its input on the host."""
    x = lat.input_bytes
    return Figures(
        a.measured * (_irreducible(lat) + a.in_flight(x, lat.forward_s)),
        a.measured * plain_transient(lat),
        a.measured * (_moved(lat) + lat.backward_temp),
        (lat.recompute_s or lat.forward_s) + a.transfer_s(x),
        x,
    )


def compress(lat: Latents, a: Assumptions) -> Figures:
    """Keeps a `kappa` share of input and activations (held into its backward, so not counted again
    there); backward decodes each as autograd reads it."""
    move, k = _moved(lat), a.kappa
    return Figures(
        a.guess * (_irreducible(lat) + k * move),
        a.guess * (plain_transient(lat) + k * move),
        a.guess * (a.decoded(move) + lat.backward_temp),
        a.codec_s(move),
        0.0,
    )


def compress_offload(lat: Latents, a: Assumptions) -> Figures:
    """COMPRESS, with the smaller payload on the host."""
    move, k = _moved(lat), a.kappa
    held = _irreducible(lat) + a.in_flight(k * move, lat.forward_s)
    return Figures(
        a.guess * held,
        a.guess * (plain_transient(lat) + k * move),
        a.guess * (a.brought_back(k * move) + a.decoded(move) + lat.backward_temp + k * a.prefetched(move)),
        a.codec_s(move) + a.transfer_s(k * move),
        k * move,
    )


DERIVATIONS: dict[Mode, Callable[[Latents, Assumptions], Figures]] = {
    Mode.NONE: none,
    Mode.SELECTIVE: selective,
    Mode.CHECKPOINT: checkpoint,
    Mode.OFFLOAD: offload,
    Mode.CHECKPOINT | Mode.OFFLOAD: checkpoint_offload,
    Mode.COMPRESS: compress,
    Mode.COMPRESS | Mode.OFFLOAD: compress_offload,
}
