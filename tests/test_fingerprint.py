"""The fingerprint (DESIGN.md §2.3): equal for the same request however it is spelled, different otherwise."""

from __future__ import annotations

from idempotency_mw.fingerprint import fingerprint

JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"


def fp(body: bytes, content_type: bytes = JSON, method: str = "POST", path: str = "/p", query: bytes = b"") -> bytes:
    return fingerprint(method, path, query, content_type, body)


def test_json_is_canonical() -> None:
    assert fp(b'{"a":1,"b":{"d":2,"c":3}}') == fp(b'{ "b": {"c": 3, "d": 2},\n "a": 1 }')
    assert fp(b'{"a":1}', b"application/vnd.api+json; charset=utf-8") == fp(b'{ "a" : 1 }', b"application/vnd.api+json")
    assert fp(b'{"a":1}') != fp(b'{"a":2}')
    assert fp(b'{"a":[1,2]}') != fp(b'{"a":[2,1]}')


def test_invalid_json_falls_back_to_raw_bytes() -> None:
    assert fp(b"{not json") == fp(b"{not json")
    assert fp(b"{not json") != fp(b"{not  json")


def test_form_pairs_are_sorted_by_name_keeping_repeats_in_order() -> None:
    assert fp(b"a=1&b=2", FORM) == fp(b"b=2&a=1", FORM)
    assert fp(b"a=1&a=2", FORM) != fp(b"a=2&a=1", FORM)
    assert fp(b"m%5Bk%5D=v", FORM) == fp(b"m[k]=v", FORM)


def test_every_part_counts() -> None:
    base = fp(b"x", b"text/plain")
    assert base != fp(b"x", b"text/plain", method="PATCH")
    assert base != fp(b"x", b"text/plain", path="/q")
    assert base != fp(b"x", b"text/plain", query=b"a=1")
    assert base != fp(b"y", b"text/plain")
    # A JSON body and the same bytes sent as plain text are different requests.
    assert fp(b"{}", JSON) != fp(b"{}", b"text/plain")


def test_query_order_does_not_matter_but_values_do() -> None:
    assert fp(b"", query=b"a=1&b=2") == fp(b"", query=b"b=2&a=1")
    assert fp(b"", query=b"a=1") != fp(b"", query=b"a=2")


def test_length_prefixes_keep_parts_apart() -> None:
    assert fp(b"", b"text/plain", path="/ab", query=b"") != fp(b"", b"text/plain", path="/a", query=b"b")


def test_binary_bodies_are_hashed_as_sent() -> None:
    assert fp(bytes(range(256)), b"application/octet-stream") == fp(bytes(range(256)), b"application/octet-stream")
    assert len(fp(b"", b"")) == 32
