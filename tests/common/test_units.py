import pytest

from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("160B", 160),
        ("1KiB", 1024),
        ("256MiB", 256 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2 gib", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("3k", 3000),
    ],
)
def test_byte_quantities_parse_in_binary_and_decimal_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "MiB", "", "1..2GiB", "-5MiB", -1, None, True, float("nan")])
def test_an_unreadable_byte_quantity_is_refused_with_the_value_and_the_accepted_forms(bad):
    with pytest.raises(ConfigError) as e:
        parse_bytes(bad, what="capacity of cuda:0")
    msg = str(e.value)
    assert "capacity of cuda:0" in msg and repr(bad) in msg and "256MiB" in msg


def test_byte_counts_print_in_binary_units():
    assert format_bytes(160) == "160 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
