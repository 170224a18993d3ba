import pytest

from adaptmem import ALLOWED_MODES, LOSSLESS_MODES, Mode


def test_labels_are_stable_text():
    assert [m.label for m in ALLOWED_MODES] == [
        "NONE",
        "SELECTIVE",
        "CHECKPOINT",
        "OFFLOAD",
        "COMPRESS",
        "CHECKPOINT+OFFLOAD",
        "COMPRESS+OFFLOAD",
    ]


@pytest.mark.parametrize(
    "text,mode",
    [
        ("none", Mode.NONE),
        ("Checkpoint", Mode.CHECKPOINT),
        ("checkpoint+offload", Mode.CHECKPOINT | Mode.OFFLOAD),
        ("OFFLOAD|COMPRESS", Mode.COMPRESS | Mode.OFFLOAD),
        (" selective ", Mode.SELECTIVE),
    ],
)
def test_parse_accepts_names_and_combinations(text, mode):
    assert Mode.parse(text) is mode


def test_parse_round_trips_every_label():
    for mode in ALLOWED_MODES:
        assert Mode.parse(mode.label) is mode


def test_unknown_mode_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown mode 'chekpoint': expected one of NONE, SELECTIVE, CHECKPOINT"):
        Mode.parse("chekpoint")


def test_unsupported_combination_is_refused():
    with pytest.raises(ValueError, match="SELECTIVE\\+OFFLOAD is not supported"):
        Mode.parse(Mode.SELECTIVE | Mode.OFFLOAD)
    with pytest.raises(ValueError, match="not supported"):
        Mode.parse("checkpoint+compress")


def test_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="mode must be an adaptmem.Mode"):
        Mode.parse(3)


def test_lossless_and_recompute_flags():
    assert set(LOSSLESS_MODES) == {
        Mode.NONE,
        Mode.SELECTIVE,
        Mode.CHECKPOINT,
        Mode.OFFLOAD,
        Mode.CHECKPOINT | Mode.OFFLOAD,
    }
    assert (Mode.CHECKPOINT | Mode.OFFLOAD).recomputes
    assert not Mode.OFFLOAD.recomputes
    assert not (Mode.COMPRESS | Mode.OFFLOAD).lossless
