"""A peer's text made safe to show: control characters visible, length bounded."""

import json
import re

import pytest

from hybridps.common.text import MAX_DATA_DEPTH, MAX_PEER_TEXT_CHARS, safe_data, safe_text

HOSTILE = "\x1b[2J\x1b]0;title\x07red\x1b[31m\r\n\x00\x08\t\x7f\x9b6n\u202eevil\u2028"

#: Every character a terminal or a log reader could take as something else than text.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def test_control_characters_become_visible_escapes():
    shown = safe_text(HOSTILE)
    assert not CONTROL.search(shown) and shown.isprintable()
    assert shown == (r"\x1b[2J\x1b]0;title\x07red\x1b[31m\r\n\x00\x08\t\x7f\x9b6n\u202eevil\u2028"), (
        "each character shown as repr would escape it"
    )


def test_printable_text_non_ascii_included_is_left_as_it_is():
    for text in ("r0-p51234-1a2b3c4d", "nœud-é.exämple", "ノード", "a \\x1b is four characters", ""):
        assert safe_text(text) == text


def test_a_megabyte_is_cut_to_the_bound_with_a_marker_saying_how_much_was_cut():
    text = "A" * 1_000_000
    shown = safe_text(text)
    assert len(shown) <= MAX_PEER_TEXT_CHARS
    kept, cut = re.fullmatch(r"(A+)\.\.\. \[\+(\d+) chars\]", shown).groups()
    assert len(kept) + int(cut) == len(text)
    assert len(safe_text(text, 100)) <= 100


def test_a_cut_never_splits_an_escape_and_counts_the_characters_of_the_original():
    text = "\x1b" * 10_000
    shown = safe_text(text, 1000)
    kept, cut = re.fullmatch(r"((?:\\x1b)+)\.\.\. \[\+(\d+) chars\]", shown).groups()
    assert len(shown) <= 1000 and len(kept) // 4 + int(cut) == len(text)


def test_text_made_safe_once_is_unchanged_when_made_safe_again():
    for text in (HOSTILE, "\x1b" * 50_000, "x" * 50_000, "plain"):
        once = safe_text(text)
        assert safe_text(once) == once


def test_anything_not_a_string_is_shown_as_its_str():
    assert safe_text(ValueError("bad\x1b[0m")) == r"bad\x1b[0m"
    assert safe_text(12) == "12"


def test_a_bound_too_small_for_the_marker_is_refused():
    with pytest.raises(ValueError, match="max_chars=5"):
        safe_text("x", 5)


def test_every_string_of_a_structure_keys_included_is_made_safe_and_json_can_hold_the_result():
    data = {
        "host\x1b[1m": ["nœud\r", 1, 2.5, None, True, {"inner": "\x00" * 10_000}],
        "nan": float("nan"),
        "inf": float("-inf"),
        "raw": b"\x1b[2J",
        "tuple": ("a\n", 3),
    }
    safe = safe_data(data)
    assert safe == {
        r"host\x1b[1m": [r"nœud\r", 1, 2.5, None, True, {"inner": safe["host\\x1b[1m"][5]["inner"]}],
        "nan": "nan",
        "inf": "-inf",
        "raw": r"b'\x1b[2J'",
        "tuple": [r"a\n", 3],
    }
    assert len(safe["host\\x1b[1m"][5]["inner"]) <= 256
    text = json.dumps(safe, allow_nan=False, ensure_ascii=False)
    assert not CONTROL.search(text) and json.loads(text) == safe


def test_a_structure_nested_deeper_than_the_limit_is_described_not_copied():
    deep: list = []
    inner = deep
    for _ in range(2000):  # deeper than Python's recursion limit
        inner.append([])
        inner = inner[0]
    safe = safe_data(deep)
    for _ in range(MAX_DATA_DEPTH):
        (safe,) = safe
    assert safe == f"<list nested deeper than {MAX_DATA_DEPTH} levels>"
