import pytest

from adaptmem.config.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text,expected",
    [
        (123, 123),
        ("12GiB", 12 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2k", 2000),
        ("2KB", 2000),
        ("2KiB", 2048),
        ("100", 100),
        ("0.5 TiB", 2**39),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["twelve", "12 parsecs", "", "GiB"])
def test_parse_bytes_rejects_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="is not a size: write bytes as an int"):
        parse_bytes(bad, what="budget")


def test_parse_bytes_rejects_negative_and_bool():
    with pytest.raises(ValueError, match="must not be negative"):
        parse_bytes(-1)
    with pytest.raises(TypeError):
        parse_bytes(True)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(-(2**20)) == "-1.00 MiB"
