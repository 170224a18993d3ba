"""Policies: how the manager trades memory for time, as validated, frozen data.

`load_policy` takes a preset name ("balanced", "max-savings", "long-context",
"every-2", "sqrt-n"), a path to a TOML file, or a `Policy`. The environment
variable ADAPTMEM_POLICY overrides what the code asks for. A bad file gets an
error naming the file, the field and the allowed values.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from adaptmem.modes import Mode, allowed_labels

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger("adaptmem")

PRESETS = ("balanced", "max-savings", "long-context", "every-2", "sqrt-n")
ENV_POLICY = "ADAPTMEM_POLICY"
ENV_BUDGET = "ADAPTMEM_BUDGET"


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the source, field and allowed values."""


class Policy(BaseModel):
    """Every knob of the manager. Fractions are of the budget unless said otherwise."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = "custom"
    "A label for logs and the event file."

    modes: tuple[str, ...] = ("NONE", "SELECTIVE", "CHECKPOINT", "OFFLOAD", "CHECKPOINT+OFFLOAD")
    "Modes the planner may give a block (labels of adaptmem.Mode). Lossless ones only, unless you add COMPRESS."

    head: Literal["auto", "kept", "chunked"] = "auto"
    "The loss head: 'auto' chunks its logits when the budget needs it (a choice the planner makes like any block's, chunk size included), 'kept' never, 'chunked' always."

    static_plan: Literal["none", "every-k", "sqrt-n"] = "none"
    "A fixed plan instead of planning: checkpoint every k-th block, or every round(sqrt(L))-th. OOMs still escalate."

    every_k: StrictInt = Field(2, ge=1)
    "k for static_plan='every-k' (blocks)."

    budget_fraction: StrictFloat = Field(0.9, gt=0, le=1)
    "With budget=None: the budget as this fraction of the device memory not used by others at start."

    headroom: StrictFloat = Field(0.94, gt=0, le=1)
    "Plan for predicted peak <= headroom x budget at first; the margin absorbs prediction error."

    min_headroom: StrictFloat = Field(0.5, gt=0, le=1)
    "Escalation never plans for less than this fraction of the budget."

    max_headroom: StrictFloat = Field(0.97, gt=0, le=1)
    "Relaxation never plans for more than this fraction of the budget, until predictions that land where aimed earn up to 0.99."

    high_watermark: StrictFloat = Field(0.98, gt=0, le=1)
    "An observed peak above this fraction of the budget escalates at once (above the earned fill plus its margin, once earned)."

    low_watermark: StrictFloat = Field(0.94, gt=0, lt=1)
    "Observed peaks under this fraction of the budget for calm_steps steps relax the plan (under the headroom plus the margin, once a fill is earned)."

    calm_steps: StrictInt = Field(10, ge=1)
    "Steps under the low watermark before relaxing (doubles each time a relaxation had to be undone)."

    escalate_factor: StrictFloat = Field(0.9, gt=0, lt=1)
    "Headroom is multiplied by at most this on escalation."

    relax_factor: StrictFloat = Field(1.03, gt=1, le=2)
    "Headroom is multiplied by this on relaxation."

    oom_backoff: StrictFloat = Field(0.8, gt=0, lt=1)
    "Headroom is multiplied by this after an out-of-memory error."

    max_retries: StrictInt = Field(3, ge=0, le=10)
    "Times run_step retries a step after an out-of-memory error before giving up."

    prior_margin: StrictFloat = Field(1.25, ge=1, le=3)
    "Predicted bytes of a mode never yet seen on a block are inflated by this factor."

    quadratic_prior: StrictFloat = Field(0.25, ge=0, le=1)
    "Share of activation bytes assumed to grow with the input size squared (attention over a sequence) when extrapolating to a larger input than any seen."

    bucket_ratio: StrictFloat = Field(1.25, gt=1, le=4)
    "Input-size buckets (elements per sample; one cached plan each) grow geometrically by this ratio."

    sample_interval_s: StrictFloat = Field(0.05, gt=0, le=10)
    "How often the background thread reads the device (seconds)."

    emergency_margin: StrictFloat = Field(0.02, ge=0, lt=0.5)
    "Fraction of device capacity kept free when other processes take memory: the budget shrinks at once to keep it."

    host_fraction: StrictFloat = Field(0.5, gt=0, le=1)
    "Offloaded bytes may use at most this fraction of the host RAM available when planning."

    compress_codec: Literal["int8", "fp8", "bf16"] = "int8"
    "Codec for COMPRESS modes."

    compress_group_size: StrictInt = Field(64, ge=8)
    "Values sharing one scale in int8/fp8 compression (count)."

    compress_compile: Literal["auto", "on", "off", "triton"] = "auto"
    "The codec's kernels: int8 by kernels written for Triton on CUDA where Triton runs, else eager ops ('auto'); Triton's, with a warning where they cannot run on CUDA ('triton'); fused int8/fp8 kernels by torch.compile ('on'); eager ops ('off'); see docs/modes.md."

    compress_penalty: StrictFloat = Field(0.5, ge=0)
    "Planner cost of a lossy mode on a block, as a fraction of that block's forward time, on top of its time."

    accumulation_snapshot: Literal["device", "host", "off"] = "device"
    "Before an existing .grad is accumulated into, copy it (on the device or host) so an OOM retry restores it exactly; 'off' makes such an OOM an error."

    buffer_snapshot_limit: StrictInt = Field(256 * 2**20, ge=0)
    "Before each run_step the model's buffers are copied to the host, up to this many bytes in all, so a retry puts back what a failed attempt changed (bytes)."

    empty_cache_on_oom: StrictBool = True
    "After an out-of-memory error, release PyTorch's cached CUDA blocks before retrying."

    replan_tolerance: StrictFloat = Field(0.05, gt=0, le=1)
    "A cached plan is made again when its predicted peak missed the observed one by more than this fraction of the budget."

    measure_every: StrictInt = Field(10, ge=1)
    "In steady state (plan held, shapes seen, predictions on target) the step is measured block by block only every this many steps; the others read just the step's peak. 1: every step."

    try_modes: StrictBool = True
    "Measure once the modes whose figures are a guess until a block runs them (SELECTIVE, OFFLOAD): a plan the budget shapes tries one on one block where it is predicted to fit, and a plan that runs one on its guess is measured block by block. False: neither."

    planner_bins: StrictInt = Field(1024, ge=64, le=16384)
    "Resolution of the planner's byte axis (bins over the budget); every byte count is rounded up to a bin."

    @field_validator("modes")
    @classmethod
    def _known_modes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(f"must name at least one mode out of {allowed_labels()}")
        return tuple(Mode.parse(v).label for v in value)

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        if not self.low_watermark < self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        if not self.min_headroom <= self.headroom <= self.max_headroom:
            raise ValueError(
                f"headroom ({self.headroom}) must lie within [min_headroom, max_headroom] = "
                f"[{self.min_headroom}, {self.max_headroom}]"
            )
        if self.static_plan != "none" and "CHECKPOINT" not in self.modes:
            raise ValueError(f"static_plan={self.static_plan!r} checkpoints blocks, so modes must include CHECKPOINT")
        return self

    @property
    def allowed(self) -> tuple[Mode, ...]:
        return tuple(Mode.parse(m) for m in self.modes)


def load_policy(policy: str | os.PathLike | Policy | None = "balanced") -> Policy:
    """A `Policy` from a preset name, a TOML path, or a Policy; ADAPTMEM_POLICY wins over the argument."""
    if policy is not None and not isinstance(policy, (str, os.PathLike, Policy)):
        raise TypeError(
            f"policy must be a preset name ({', '.join(PRESETS)}), a path to a TOML file, or an "
            f"adaptmem.Policy; got {type(policy).__name__} {policy!r}"
        )
    env = os.environ.get(ENV_POLICY)
    if env:
        given = policy.name if isinstance(policy, Policy) else policy
        if given is not None and os.fspath(given) != env:
            log.warning("adaptmem: %s=%r overrides policy=%r given in code", ENV_POLICY, env, given)
        return _load(env, source=f"{ENV_POLICY}={env!r}")
    if policy is None:
        policy = "balanced"
    if isinstance(policy, Policy):
        return policy
    return _load(policy, source=None)


def _load(spec: str | os.PathLike, source: str | None) -> Policy:
    text_spec = os.fspath(spec)
    if text_spec in PRESETS:
        return _parse(_preset_text(text_spec), f"preset '{text_spec}.toml'")
    path = Path(text_spec)
    if path.suffix != ".toml" and not path.exists():
        where = f" (from {source})" if source else ""
        raise PolicyError(f"policy {text_spec!r}{where} is neither a preset ({', '.join(PRESETS)}) nor a TOML file")
    try:
        text = path.read_text()
    except OSError as err:
        raise PolicyError(f"policy file '{path}' cannot be read: {err.strerror or err}") from None
    return _parse(text, f"policy '{path}'")


def _parse(text: str, label: str) -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"{label}: not valid TOML ({err})") from None
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        raise PolicyError(f"{label}: " + "; ".join(_describe(e) for e in err.errors())) from None


def _describe(error: dict) -> str:
    field = ".".join(str(p) for p in error.get("loc", ())) or "(policy)"
    kind = error.get("type", "")
    got = error.get("input")
    if kind == "extra_forbidden":
        return f"unknown field `{field}`; allowed fields are {', '.join(Policy.model_fields)}"
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        return f"field `{field}` must be in {_range_text(field)}, got {got!r}"
    if kind in _TYPE_WORDS:
        return f"field `{field}` must be {_TYPE_WORDS[kind]}, got {got!r}"
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        return f"field `{field}` must be one of {allowed}, got {got!r}"
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    if field == "(policy)":
        return message
    return f"field `{field}`: {message} (got {got!r})"


_TYPE_WORDS = {
    "int_type": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list of mode names",
}


def _range_text(name: str) -> str:
    info = Policy.model_fields.get(name)
    lo, hi, lo_open, hi_open = "-inf", "inf", True, True
    for meta in getattr(info, "metadata", []):
        for attr, is_low, is_open in (
            ("gt", True, True),
            ("ge", True, False),
            ("lt", False, True),
            ("le", False, False),
        ):
            value = getattr(meta, attr, None)
            if value is not None:
                if is_low:
                    lo, lo_open = value, is_open
                else:
                    hi, hi_open = value, is_open
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _preset_text(name: str) -> str:
    try:
        return resources.files("adaptmem.policies").joinpath(f"{name}.toml").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        # a source checkout run without installing: the top-level policies/ folder
        return (Path(__file__).resolve().parents[2] / "policies" / f"{name}.toml").read_text()
