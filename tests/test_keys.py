"""Key parsing (docs/design.md §3): sf-string and bare token, refused rather than repaired."""

from __future__ import annotations

import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idempotency_mw._keys import InvalidKey, MissingKey, key_from_headers, parse_key, uuid7_time


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b"abc", "abc"),
        (b'"abc"', "abc"),
        (b"  abc\t", "abc"),
        (b'"a\\"b\\\\c"', 'a"b\\c'),
        (b'"a,b"', "a,b"),
        (b"k" * 255, "k" * 255),
        (b"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (b"!#$%&'*+-.^_`|~:/", "!#$%&'*+-.^_`|~:/"),
    ],
)
def test_valid_keys(raw: bytes, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty"),
        (b'""', "1 to 255"),
        (b"k" * 256, "1 to 255"),
        (b"a b", "spaces"),
        (b'"a b"', "spaces"),
        (b"a\x7fb", "ASCII"),
        (b"a\x00b", "control"),
        (b'"a\x1fb"', "control"),
        ("ключ".encode(), "ASCII"),
        (b'"abc', "closing quote"),
        (b'"abc"x', "after"),
        (b'"abc";p=1', "after"),
        (b'"a\\nb"', "escape"),
        (b"a,b", "comma"),
    ],
)
def test_invalid_keys_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidKey, match=reason):
        parse_key(raw)


def test_header_lookup() -> None:
    with pytest.raises(MissingKey):
        key_from_headers([(b"x", b"y")])
    with pytest.raises(InvalidKey, match="exactly once"):
        key_from_headers([(b"idempotency-key", b"a"), (b"idempotency-key", b"a")])
    assert key_from_headers([(b"idempotency-key", b"a")]) == "a"


@given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255))
def test_every_visible_ascii_key_round_trips_through_quoting(key: str) -> None:
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert parse_key(quoted.encode()) == key
    if "," not in key and not key.startswith('"'):
        assert parse_key(key.encode()) == key


@given(st.binary(max_size=300))
def test_arbitrary_bytes_parse_or_raise_invalid(raw: bytes) -> None:
    try:
        key = parse_key(raw)
    except InvalidKey:
        return
    assert 1 <= len(key) <= 255
    assert all(0x21 <= ord(c) <= 0x7E for c in key)


def test_uuid7_time() -> None:
    now_ms = int(time.time() * 1000)
    v7 = uuid.UUID(int=(now_ms << 80) | (0x7 << 76) | (0b10 << 62) | 12345)
    assert uuid7_time(str(v7)) == pytest.approx(now_ms / 1000)
    assert uuid7_time(str(uuid.uuid4())) is None
    assert uuid7_time("not-a-uuid") is None
