"""What a block does with the activations autograd saves for its backward.

`Mode` is a flag so that the two combinations read as what they are:
``Mode.CHECKPOINT | Mode.OFFLOAD`` keeps only the block input and keeps it on
the host (DeepSpeed's ``cpu_checkpointing``); ``Mode.COMPRESS | Mode.OFFLOAD``
quantizes saved tensors and sends the smaller payload over the bus.
"""

from __future__ import annotations

import enum


class Mode(enum.Flag):
    """Per-block treatment of saved activations.

    NONE        keep them on the device.
    SELECTIVE   keep the weight layers' (and fused attention's) outputs, recompute the rest.
    CHECKPOINT  keep only the block input, recompute the block in backward.
    OFFLOAD     move saved tensors to host memory, bring them back in backward.
    COMPRESS    quantize saved floating tensors (lossy; opt-in).
    """

    NONE = 0
    SELECTIVE = 1
    CHECKPOINT = 2
    OFFLOAD = 4
    COMPRESS = 8

    @property
    def label(self) -> str:
        """Stable text form, e.g. ``"CHECKPOINT+OFFLOAD"`` (same on every Python). Kept once made:
        every step's record names each block's mode."""
        text = _LABELS.get(self._value_)
        if text is None:
            text = "NONE" if self._value_ == 0 else "+".join(m.name for m in _ATOMS if m in self)
            _LABELS[self._value_] = text
        return text

    @property
    def lossless(self) -> bool:
        """True when gradients under this mode equal those under NONE bit for bit."""
        return Mode.COMPRESS not in self

    @property
    def offloads(self) -> bool:
        """True when its saved tensors go to host memory (OFFLOAD, alone or with another mode).
        Read once per block per step: an integer test, not a Flag operation (about 1 us each)."""
        return bool(self._value_ & _OFFLOAD_BIT)

    @property
    def recomputes(self) -> bool:
        """True when the block's forward runs again during backward."""
        return bool(self & (Mode.SELECTIVE | Mode.CHECKPOINT))

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        """A `Mode` from a `Mode` or its text (``"checkpoint"``, ``"CHECKPOINT+OFFLOAD"``).

        Raises ValueError naming the allowed modes for anything else, including
        combinations adaptmem does not support.
        """
        if isinstance(value, Mode):
            return _check_allowed(value)
        if not isinstance(value, str):
            raise TypeError(f"mode must be an adaptmem.Mode or its name, got {type(value).__name__} {value!r}")
        parts = [p.strip().upper() for p in value.replace("|", "+").split("+")]
        mode = Mode.NONE
        for part in parts:
            if part not in Mode.__members__:
                raise ValueError(
                    f"unknown mode {value!r}: expected one of {allowed_labels()} "
                    "(case-insensitive; combine two with '+')"
                )
            mode |= Mode[part]
        return _check_allowed(mode)


_LABELS: dict[int, str] = {}
_OFFLOAD_BIT = Mode.OFFLOAD.value
_ATOMS = (Mode.SELECTIVE, Mode.CHECKPOINT, Mode.COMPRESS, Mode.OFFLOAD)  # label order: what happens first

#: Every mode a block may be set to. SELECTIVE is not combined with OFFLOAD:
#: tensors cached by selective checkpointing bypass saved-tensor hooks, so an
#: offload around them would silently offload nothing.
ALLOWED_MODES: tuple[Mode, ...] = (
    Mode.NONE,
    Mode.SELECTIVE,
    Mode.CHECKPOINT,
    Mode.OFFLOAD,
    Mode.COMPRESS,
    Mode.CHECKPOINT | Mode.OFFLOAD,
    Mode.COMPRESS | Mode.OFFLOAD,
)

LOSSLESS_MODES: tuple[Mode, ...] = tuple(m for m in ALLOWED_MODES if m.lossless)


def allowed_labels() -> str:
    return ", ".join(m.label for m in ALLOWED_MODES)


def _check_allowed(mode: Mode) -> Mode:
    if mode not in ALLOWED_MODES:
        raise ValueError(f"mode {mode.label} is not supported: allowed modes are {allowed_labels()}")
    return mode


#: Modes from the loosest to the tightest, by the bytes a block keeps until its
#: backward. An out-of-memory retry moves blocks up this ladder when the
#: planner has nothing tighter to offer.
LADDER: tuple[Mode, ...] = (
    Mode.NONE,
    Mode.SELECTIVE,
    Mode.COMPRESS,
    Mode.CHECKPOINT,
    Mode.OFFLOAD,
    Mode.COMPRESS | Mode.OFFLOAD,
    Mode.CHECKPOINT | Mode.OFFLOAD,
)


def ladder(allowed: tuple[Mode, ...]) -> tuple[Mode, ...]:
    """The ladder restricted to `allowed` modes."""
    return tuple(m for m in LADDER if m in allowed)


def ladder_ranks(allowed: tuple[Mode, ...]) -> dict[Mode, int]:
    """Each allowed mode's place on the ladder, the tighter the higher."""
    return {m: i for i, m in enumerate(ladder(allowed))}


def step_up(mode: Mode, allowed: tuple[Mode, ...]) -> Mode:
    """The next tighter allowed mode (the mode itself at the top)."""
    rungs = ladder(allowed)
    if mode not in rungs:
        return rungs[-1]
    i = rungs.index(mode)
    return rungs[min(i + 1, len(rungs) - 1)]


class HeadMode(enum.Enum):
    """What the loss head (the output projection and the loss after it) does with its logits.

    KEPT     the model's own code, as it is: the whole tokens x vocabulary logits exist.
    CHUNKED  the logits are made and consumed a chunk of tokens at a time inside the loss,
             and the head's gradients are taken there; the whole logits never exist. Exact
             up to the order of summation (not bit for bit).
    """

    KEPT = "kept"
    CHUNKED = "chunked"

    @property
    def label(self) -> str:
        return self.name

    @classmethod
    def parse(cls, value: HeadMode | str) -> HeadMode:
        if isinstance(value, HeadMode):
            return value
        if isinstance(value, str) and value.strip().lower() in ("kept", "chunked"):
            return cls(value.strip().lower())
        raise ValueError(f"unknown head mode {value!r}: expected 'kept' or 'chunked'")
