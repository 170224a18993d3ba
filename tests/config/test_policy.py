"""Policies: presets, files, environment overrides, and errors that name what is wrong."""

from importlib import resources

import pytest
from pydantic import ValidationError

from adaptmem import Mode, Policy, PolicyError, load_policy
from adaptmem.config.policy import PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name):
    policy = load_policy(name)
    assert policy.name == name
    assert Mode.NONE in policy.allowed


def test_presets_ship_inside_the_package():
    names = {p.name for p in resources.files("adaptmem.policies").iterdir() if p.name.endswith(".toml")}
    assert names == {f"{n}.toml" for n in PRESETS}


def test_preset_character():
    assert all(m.lossless for m in load_policy("balanced").allowed)
    assert Mode.COMPRESS in load_policy("max-savings").allowed
    assert load_policy("long-context").bucket_ratio < load_policy("balanced").bucket_ratio
    assert load_policy("every-2").static_plan == "every-k"
    assert load_policy("sqrt-n").static_plan == "sqrt-n"


def test_policy_is_frozen_and_forbids_extra_fields():
    policy = load_policy()
    with pytest.raises(ValidationError):
        policy.headroom = 0.5
    with pytest.raises(ValidationError):
        Policy(colour="red")


def test_every_field_is_documented():
    for name, field in Policy.model_fields.items():
        assert field.description, f"field {name} has no description"


def write(tmp_path, text, name="mine.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_loads(tmp_path):
    policy = load_policy(write(tmp_path, 'name = "mine"\ncalm_steps = 3\nmodes = ["none", "checkpoint"]\n'))
    assert policy.calm_steps == 3 and policy.allowed == (Mode.NONE, Mode.CHECKPOINT)


@pytest.mark.parametrize(
    "text,message",
    [
        ("high_watermark = 1.3", r"mine.toml': field `high_watermark` must be in \(0, 1\], got 1.3"),
        ("calm_steps = 0", r"field `calm_steps` must be in \[1, inf\), got 0"),
        ('compress_codec = "int4"', r"field `compress_codec` must be one of 'int8', 'fp8' or 'bf16', got 'int4'"),
        ("colour = 1", r"unknown field `colour`; allowed fields are name, modes"),
        ('modes = ["NONE", "FAST"]', r"field `modes`: unknown mode 'FAST': expected one of NONE"),
        ("low_watermark = 0.99", r"low_watermark \(0.99\) must be below high_watermark \(0.98\)"),
        ("x = [", r"not valid TOML"),
        ('static_plan = "every-k"\nmodes = ["NONE", "OFFLOAD"]', r"modes must include CHECKPOINT"),
    ],
)
def test_bad_files_name_the_file_field_and_allowed_values(tmp_path, text, message):
    with pytest.raises(PolicyError, match=message):
        load_policy(write(tmp_path, text))


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read"):
        load_policy(tmp_path / "absent.toml")
    with pytest.raises(PolicyError, match=r"'balanzed' is neither a preset \(balanced, max-savings"):
        load_policy("balanzed")


def test_environment_overrides_the_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTMEM_POLICY", "max-savings")
    assert load_policy("balanced").name == "max-savings"
    monkeypatch.setenv("ADAPTMEM_POLICY", str(write(tmp_path, "headroom = 0.6\nmin_headroom = 0.5")))
    assert load_policy(Policy()).headroom == 0.6
    monkeypatch.setenv("ADAPTMEM_POLICY", "nope")
    with pytest.raises(PolicyError, match=r"from ADAPTMEM_POLICY='nope'"):
        load_policy()


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_retries = true", "field `max_retries` must be a whole number, got True"),
        ("calm_steps = 2.5", "field `calm_steps` must be a whole number, got 2.5"),
        ("empty_cache_on_oom = 1", "field `empty_cache_on_oom` must be true or false, got 1"),
        ("headroom = true", "field `headroom` must be a number, got True"),
    ],
)
def test_wrong_types_in_a_file_are_named(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text + "\n")
    with pytest.raises(PolicyError, match=f"policy '{path}': {message}".replace("(", r"\(").replace(")", r"\)")):
        load_policy(str(path))


def test_a_policy_of_the_wrong_kind_is_named():
    with pytest.raises(
        TypeError,
        match=r"policy must be a preset name \(balanced, .*\), a path to a TOML file, "
        r"or an adaptmem.Policy; got int 3",
    ):
        load_policy(3)
