"""The fingerprint: equal for the same request however it is spelled, different otherwise; bounded work."""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncGenerator
from decimal import Context, Decimal
from typing import Any, NoReturn
from urllib.parse import urlencode

import asyncpg
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.datastructures import FormData, Headers, QueryParams
from starlette.formparsers import FormParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, Store, StoredResponse, header_tenant
from idempotency_mw import _fingerprint as fingerprint_module
from idempotency_mw._fingerprint import (
    FingerprintKeys,
    canonical_body,
    canonical_query,
    fingerprint,
    fingerprint_key_id,
)
from idempotency_mw.store import ClaimOutcome
from tests.conftest import client_for, tenant_of

JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"


def fp(body: bytes, content_type: bytes = JSON, method: str = "POST", path: str = "/p", query: bytes = b"") -> bytes:
    return fingerprint(method, path, query, content_type, body)


@pytest.mark.parametrize(
    ("request_parts", "digest"),
    [
        (
            ("POST", "/v1/charges", b"", b"application/json", b'{"amount": 1250, "currency": "usd"}'),
            "91f001445fa8772ee0aae94c5e2d1c2e1aaad68c20a0a1b00570e3bc88accccb",
        ),
        (
            (
                "PATCH",
                "/v1/customers/cus_1",
                b"expand=a&expand=b",
                b"application/x-www-form-urlencoded",
                b"name=Jo+Doe&email=jo%40x.io",
            ),
            "031c273d71e4028d1b579701c03995d426429df7063b28ed89d274ec67392944",
        ),
        (
            ("POST", "/v1/files", b"", b"application/octet-stream", b"\x00\x01raw"),
            "54b52ca24720c9d1750020b85108565e28d20d42d3ebc93922bc773821d8d036",
        ),
    ],
)
def test_the_fingerprint_of_a_request_is_the_same_in_every_release(
    request_parts: tuple[str, str, bytes, bytes, bytes], digest: str
) -> None:
    """A retry after an upgrade must still match the record its first attempt wrote: any change to how the
    fingerprint is computed that changes a digest turns that retry into a 422."""
    assert fingerprint(*request_parts).hex() == digest


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


# -- numbers: never two different amounts under one fingerprint -----------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"-9223372036854775809", b"-9223372036854776000"),  # below int64: orjson reads both as one float
        (b"18446744073709551616", b"18446744073709551617"),  # above uint64
        (b"1180591620717411303424", b"1180591620717411303425"),  # 2**70 and 2**70 + 1
        (b"0.1", b"0.10000000000000000001"),  # more digits than a double holds
        (b"12345678901234.56", b"12345678901234.5600000001"),
        (b"1e-400", b"0.0"),  # below the smallest double: orjson reads 0.0
        (b"1e-400", b"1e-500"),
        (b"1.00000001e-320", b"1e-320"),  # subnormal doubles hold few digits
        (b"1e400", b"1e401"),  # past the largest double
    ],
)
def test_json_numbers_a_double_cannot_hold_stay_apart(first: bytes, second: bytes) -> None:
    assert fp(b'{"amount":' + first + b"}") != fp(b'{"amount":' + second + b"}")
    assert fp(b"[" + first + b"]") != fp(b"[" + second + b"]")


def test_key_order_and_whitespace_still_do_not_matter_around_long_numbers() -> None:
    assert fp(b'{"a":-9223372036854775809,"b":[1.5,0.10000000000000000001]}') == fp(
        b'{ "b" : [ 1.5 , 0.10000000000000000001 ] ,\n "a" : -9223372036854775809 }'
    )
    assert fp(b'{"card":"4242424242424242","amount":10.50}') == fp(b'{ "amount": 10.50, "card": "4242424242424242" }')


def test_a_body_read_exactly_compares_its_numbers_as_written() -> None:
    # The conservative side, as documented: equal values spelled differently are different requests (a 422).
    assert fp(b'{"amount":0.1}') != fp(b'{"amount":0.1000000000000000}')
    assert fp(b'{"card":"4242424242424242","amount":10.50}') != fp(b'{"card":"4242424242424242","amount":10.5}')
    # Without a long digit run, numbers compare by value, as before.
    assert fp(b'{"amount":10.50}') == fp(b'{"amount":10.5}')
    assert fp(b'{"amount":1e2}') == fp(b'{"amount":100.0}')


def test_json_floats_and_integers_are_different_requests() -> None:
    assert fp(b'{"a":1}') != fp(b'{"a":1.0}')
    assert fp(b'{"a":100000000000000000000}') != fp(b'{"a":100000000000000000000.0}')


@given(st.integers(min_value=-(2**80), max_value=2**80), st.integers(min_value=-(2**80), max_value=2**80))
def test_different_integers_never_share_a_fingerprint(first: int, second: int) -> None:
    assume(first != second)
    assert fp(b'{"n":%d}' % first) != fp(b'{"n":%d}' % second)


def decimal_literals() -> st.SearchStrategy[str]:
    digits = st.text("0123456789", min_size=1, max_size=30)
    return st.builds(
        lambda whole, fraction, exponent: f"{int(whole)}.{fraction}e{exponent}", digits, digits, st.integers(-330, 330)
    )


@given(decimal_literals(), decimal_literals())
def test_different_decimal_values_never_share_a_fingerprint(first: str, second: str) -> None:
    assume(Decimal(first) != Decimal(second))
    assert fp(b'{"x":%s}' % first.encode()) != fp(b'{"x":%s}' % second.encode())


@given(st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=16, max_value=40))
def test_a_nudge_past_what_a_double_holds_is_a_different_request(value: float, place: int) -> None:
    written = Decimal(repr(value))
    nudged = Context(prec=100).add(written, Decimal(1).scaleb(written.adjusted() - place))  # exact, no rounding
    assert fp(b"[%s]" % str(written).encode()) != fp(b"[%s]" % str(nudged).encode())


@given(st.dictionaries(st.text(max_size=8), decimal_literals() | st.integers().map(str), min_size=1, max_size=6))
def test_key_order_and_whitespace_never_matter_even_when_read_exactly(members: dict[str, str]) -> None:
    def body(items: list[tuple[str, str]], space: str) -> bytes:
        inner = f",{space}".join(f"{json.dumps(name)}{space}:{space}{number}" for name, number in items)
        return f"{{{space}{inner}{space}}}".encode()

    items = list(members.items())
    assert fp(body(items, "")) == fp(body(items[::-1], " \n\t"))


def test_json_nested_too_deep_to_re_serialise_is_hashed_as_sent() -> None:
    deep = b"[" * 300 + b"]" * 300
    assert canonical_body(JSON, deep) == (b"raw;" + JSON, deep)


# -- bounded work: a body that would be costly to canonicalise is hashed as sent -------------------------------


def test_a_form_with_more_fields_than_starlette_reads_is_hashed_as_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    within = b"&".join([b"a=1"] * 1000)
    assert canonical_body(FORM, within)[0] == b"form"
    monkeypatch.setattr(fingerprint_module, "parse_qsl", refuse_to_parse)  # past the cap the parser is never run
    beyond = b"&".join([b"a"] * 1001)
    assert canonical_body(FORM, beyond) == (b"raw;" + FORM, beyond)
    huge = b"&".join([b"a"] * (1 << 19))  # the 1 MiB body of the report
    assert canonical_body(FORM, huge) == (b"raw;" + FORM, huge)
    assert fp(huge, FORM) == fp(huge, FORM)
    assert fp(huge, FORM) != fp(huge + b"&a", FORM)


def test_a_form_full_of_escapes_is_hashed_as_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    escaped = b"name=" + b"%41" * 100_000
    assert fp(escaped, FORM) != fp(b"name=" + b"A" * 100_000, FORM)  # the conservative side: a 422, never a replay
    monkeypatch.setattr(fingerprint_module, "parse_qsl", refuse_to_parse)
    assert canonical_body(FORM, escaped) == (b"raw;" + FORM, escaped)


def test_an_ordinary_form_with_escapes_is_still_canonical() -> None:
    text = "Grüße aus Köln, 5 % Rabatt & mehr " * 20  # 9 escapes per copy: well within the allowance
    encoded = urlencode({"note": text, "amount": "10"}).encode()
    assert canonical_body(FORM, encoded)[0] == b"form"
    assert fp(encoded, FORM) == fp(urlencode({"amount": "10", "note": text}).encode(), FORM)


def test_a_costly_query_string_is_hashed_as_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint_module, "parse_qsl", refuse_to_parse)
    many = b"&".join([b"a"] * 5000)
    assert fp(b"", query=many) == fp(b"", query=many)
    assert fp(b"", query=many) != fp(b"", query=many + b"&a")


def test_a_costly_query_never_meets_the_canonical_pairs_of_another() -> None:
    escaped = b"a=" + b"%2C" * 20_000
    assert canonical_query(escaped).startswith(b"as sent:")
    assert canonical_query(b"b=1&a=2") == canonical_query(b"a=2&b=1")
    assert canonical_query(b"b=1&a=2").startswith(b"[")


def test_json_needing_exact_numbers_with_too_many_values_is_hashed_as_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    dense = b"[" + b",".join([b"1"] * 200_000) + b",12345678901234567890]"  # one long number, then many values
    monkeypatch.setattr(json, "loads", refuse_to_parse)  # the exact reader (json.loads) is never run
    assert canonical_body(JSON, dense) == (b"raw;" + JSON, dense)


def test_json_with_a_few_exact_numbers_among_long_text_is_canonical() -> None:
    body = b'{"note":"' + b"x" * 100_000 + b'","amount":12345678901234567890}'
    assert canonical_body(JSON, body)[0] == b"json"


def refuse_to_parse(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("this body should not have been parsed")


def test_raw_bodies_under_other_content_type_parameters_are_other_requests() -> None:
    """The same bytes read under another boundary or charset are another request to the app."""
    body = b"--b1\r\nContent-Disposition: form-data; name=amount\r\n\r\n10\r\n--b1--\r\n"
    assert fp(body, b"multipart/form-data; boundary=b1") != fp(body, b"multipart/form-data; boundary=b2")
    assert fp(b"caf\xe9", b"text/plain; charset=latin-1") != fp(b"caf\xe9", b"text/plain; charset=utf-8")
    assert fp(b"x", b"Text/Plain;  charset=UTF-8") == fp(b"x", b"text/plain; charset=utf-8")  # spelling only


# -- forms and query strings read as Starlette reads them -----------------------------------------------------


def test_escapes_are_read_as_utf_8_and_raw_bytes_as_latin_1_as_starlette_reads_them() -> None:
    """``%C3%A9`` is 'é' to the app, the raw bytes ``\\xc3\\xa9`` are 'Ã©': two requests, never one replay."""
    assert fp(b"to=%C3%A9ric", FORM) != fp(b"to=\xc3\xa9ric", FORM)
    assert fp(b"", query=b"to=%C3%A9ric") != fp(b"", query=b"to=\xc3\xa9ric")
    # The raw latin-1 byte is 'é' too: the same request however it is spelled.
    assert fp(b"to=%C3%A9ric", FORM) == fp(b"to=\xe9ric", FORM) == fp(b"to=%c3%a9ric", FORM)
    assert fp(b"", query=b"to=%C3%A9ric") == fp(b"", query=b"to=\xe9ric")


def test_invalid_utf_8_escapes_stay_apart() -> None:
    """Starlette reads each as U+FFFD; kept apart, a retry of either still matches and nothing merges."""
    assert len({fp(b"a=" + escape, FORM) for escape in (b"%FF", b"%FE", b"%EF%BF%BD", b"%ED%A0%80")}) == 4
    assert len({fp(b"", query=b"a=" + escape) for escape in (b"%FF", b"%FE", b"%EF%BF%BD", b"\xff")}) == 4
    assert fp(b"a=%FF&b=%C3", FORM) == fp(b"b=%C3&a=%ff", FORM)  # still canonical: pair order does not count
    assert canonical_query(b"a=%FF").startswith(b"[")  # canonical pairs, never the "as sent:" fallback


def test_raw_non_ascii_forms_hash_as_before() -> None:
    """Bytes sent raw were read as latin-1 before and still are: their digests did not change."""
    assert canonical_body(FORM, b"name=Jos\xe9&city=K\xf6ln") == (b"form", '[["city","Köln"],["name","José"]]'.encode())


def starlette_query(query: bytes) -> list[tuple[str, str]]:
    """What the app reads: Starlette's QueryParams, each name's values in order (pairs of different names in any
    order are the same request)."""
    return sorted(QueryParams(query).multi_items(), key=lambda pair: pair[0])


def starlette_form(body: bytes) -> list[tuple[str, str]]:
    """What ``request.form()`` reads from an urlencoded body, as :func:`starlette_query` orders it."""

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    async def parse() -> FormData:
        return await FormParser(Headers({"content-type": FORM.decode()}), stream()).parse()

    return sorted(((name, str(value)) for name, value in asyncio.run(parse()).multi_items()), key=lambda p: p[0])


# One run of bytes spelled twice, each byte raw or as an upper- or lower-case escape: the app reads some such pairs
# alike (an ASCII letter) and others apart (a non-ASCII byte, "+", "&", "=").
SPELLINGS = (lambda byte: bytes([byte]), lambda byte: b"%%%02X" % byte, lambda byte: b"%%%02x" % byte)
spelled_twice = st.lists(
    st.tuples(
        st.sampled_from(b"a=&+% \x00\x7f\xc3\xa9\xe9\xff\xed\xa0\x80\xe2\x82\xac"),
        st.sampled_from(SPELLINGS),
        st.sampled_from(SPELLINGS),
    ),
    max_size=12,
).map(lambda run: (b"".join(first(byte) for byte, first, _ in run), b"".join(second(byte) for byte, _, second in run)))


@given(spelled_twice)
def test_queries_the_app_reads_differently_never_share_a_fingerprint(queries: tuple[bytes, bytes]) -> None:
    first, second = queries
    assume(starlette_query(first) != starlette_query(second))
    assert fp(b"", query=first) != fp(b"", query=second)


@given(spelled_twice)
def test_forms_the_app_reads_differently_never_share_a_fingerprint(bodies: tuple[bytes, bytes]) -> None:
    first, second = bodies
    assume(starlette_form(first) != starlette_form(second))
    assert fp(first, FORM) != fp(second, FORM)


def test_excluded_fields_leave_the_fingerprint_and_nothing_else_does() -> None:
    exclude = frozenset({"sent_at", "meta.attempt"})
    base = fingerprint("POST", "/p", b"", JSON, b'{"a": 1, "sent_at": 1, "meta": {"attempt": 1, "b": 2}}', exclude)
    same = fingerprint("POST", "/p", b"", JSON, b'{"meta": {"b": 2, "attempt": 9}, "a": 1, "sent_at": 7}', exclude)
    other = fingerprint("POST", "/p", b"", JSON, b'{"a": 1, "sent_at": 1, "meta": {"attempt": 1, "b": 3}}', exclude)
    assert base == same
    assert base != other
    # Without exclusions the digest is what it always was.
    assert fp(b'{"a": 1}') == fingerprint("POST", "/p", b"", JSON, b'{"a": 1}', frozenset())


def test_exclusions_reach_objects_only_and_keep_exact_numbers() -> None:
    exclude = frozenset({"items.id", "x.y.z"})
    body = b'{"items": [{"id": 1}], "x": 5}'
    assert fingerprint("POST", "/p", b"", JSON, body, exclude) != fingerprint(
        "POST", "/p", b"", JSON, b'{"items": [{"id": 2}], "x": 5}', exclude
    )  # arrays are not reached into
    long_a = b'{"amount": 12345678901234567890, "t": 1}'
    long_b = b'{"amount": 12345678901234567891, "t": 2}'
    assert fingerprint("POST", "/p", b"", JSON, long_a, frozenset({"t"})) != fingerprint(
        "POST", "/p", b"", JSON, long_b, frozenset({"t"})
    )


def test_exclusions_do_not_apply_to_raw_bodies() -> None:
    exclude = frozenset({"t"})
    raw = b"application/octet-stream"
    assert fingerprint("POST", "/p", b"", raw, b"t=1", exclude) != fingerprint("POST", "/p", b"", raw, b"t=2", exclude)


async def test_form_typed_bodies_the_app_reads_as_json_keep_different_fingerprints(pg_store: PostgresStore) -> None:
    """A body sent as ``application/x-www-form-urlencoded`` that the app reads as JSON anyway (Starlette's
    ``request.json()`` reads a body whatever its content type; ``curl -d '{...}'`` sends JSON with that form type):
    bodies that differ as bytes in ways form decoding would erase (``+`` and a space, ``%25`` and ``%``) are two
    requests to the app and keep two fingerprints, so a key reused for the second gets 422, not the first one's
    response."""

    async def notify(request: Request) -> Response:
        return JSONResponse(await request.json(), status_code=201)

    app = Starlette(routes=[Route("/notify", notify, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store)
    key = str(uuid.uuid4())
    form = "application/x-www-form-urlencoded"
    async with client_for(app) as client:
        first = await client.post(
            "/notify",
            content=b'{"to": "jane+shop@example.com"}',
            headers={"Idempotency-Key": key, "content-type": form},
        )
        second = await client.post(
            "/notify",
            content=b'{"to": "jane shop@example.com"}',
            headers={"Idempotency-Key": key, "content-type": form},
        )
    assert first.json() == {"to": "jane+shop@example.com"}
    assert second.status_code == 422, (
        f"answered {second.json()} (replayed: {second.headers.get('idempotent-replayed')})"
    )


# -- keyed fingerprints: what the table holds gives a dictionary nothing --------------------------------------------


def charge_app(store: Store, **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        return JSONResponse({"charged": (await request.json())["amount"]}, status_code=201)

    app = Starlette(routes=[Route("/v1/charges", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app


def charge_digest(amount: int, cvc: str) -> bytes:
    """What 0.2 stored for a charge: the bare SHA-256 fingerprint, which anyone can compute."""
    return fp(json.dumps({"amount": amount, "card": {"cvc": cvc}}).encode(), path="/v1/charges")


CHARGES = ((4_217, "073"), (99_999, "915"))  # (amount, CVC)


@functools.cache
def dictionary() -> dict[bytes, tuple[int, str]]:
    """The attacker's dictionary for :data:`CHARGES`: every amount with the CVC known, every CVC with the amount
    known (built once: the same for every source of keys)."""
    guesses = {charge_digest(amount, cvc): (amount, cvc) for amount, cvc in CHARGES}
    for amount_, cvc_ in CHARGES:
        guesses.update({charge_digest(amount, cvc_): (amount, cvc_) for amount in range(100_001)})
        guesses.update({charge_digest(amount_, f"{n:03}"): (amount_, f"{n:03}") for n in range(1000)})
    return guesses


async def stored_fingerprints(url: str, keys: list[str]) -> list[bytes]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT fingerprint FROM idempotency_records WHERE key = ANY($1)", keys)
    finally:
        await connection.close()
    return [bytes(row["fingerprint"]) for row in rows]


@pytest.mark.parametrize("source", ["tenant secret", "fingerprint keys", "response keys"])
async def test_a_dictionary_recovers_nothing_from_stored_fingerprints(
    source: str, idempotency_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack of the review: amounts in 0..100000 and CVCs in 000..999 are recovered from unkeyed fingerprints in
    about a second, by a process that holds none of the server's secrets. Keyed, every guess misses."""
    cipher = None
    options: dict[str, Any] = {}
    if source == "fingerprint keys":
        monkeypatch.setenv("IDEMPOTENCY_FINGERPRINT_KEYS", "2026-11:" + "k" * 40)
    elif source == "response keys":
        from idempotency_mw.encryption import ResponseCipher

        monkeypatch.delenv("IDEMPOTENCY_TENANT_SECRET")
        cipher = ResponseCipher({"2026-11": bytes(range(32))})
        options["tenant"] = header_tenant("x-account")
    charges = {f"dict-{uuid.uuid4().hex}": charge for charge in CHARGES}
    async with PostgresStore(idempotency_database_url, cipher=cipher) as store:
        app = charge_app(store, **options)
        async with client_for(app) as client:
            for key, (amount, cvc) in charges.items():
                body = {"amount": amount, "card": {"cvc": cvc}}
                response = await client.post(
                    "/v1/charges", json=body, headers={"Idempotency-Key": key, "x-account": "acct_1"}
                )
                assert response.status_code == 201
    stored = await stored_fingerprints(idempotency_database_url, list(charges))
    assert len(stored) == 2
    digests = {digest for fingerprint in stored for digest in (fingerprint, fingerprint[-32:])}
    guesses = dictionary()
    assert len(guesses) > 100_000
    assert [guesses[digest] for digest in digests if digest in guesses] == []
    # Where the keys came from is named in each fingerprint, never the key itself.
    expected = {"tenant secret": "tenant-secret.", "fingerprint keys": "2026-11", "response keys": "response-key."}
    assert all(fingerprint_key_id(f).startswith(expected[source]) for f in stored)  # type: ignore[union-attr]


def test_a_middleware_with_no_secret_to_key_fingerprints_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEMPOTENCY_TENANT_SECRET")
    monkeypatch.delenv("IDEMPOTENCY_FINGERPRINT_KEYS", raising=False)
    app = Starlette()
    with pytest.raises(ValueError, match=r"IDEMPOTENCY_FINGERPRINT_KEYS.*IDEMPOTENCY_TENANT_SECRET.*cipher"):
        IdempotencyMiddleware(app, MemoryStore(), tenant=header_tenant("x-account"))
    with pytest.raises(ValueError, match="at least 32"):
        IdempotencyMiddleware(app, MemoryStore(), tenant=header_tenant("x-account"), fingerprint_keys="k1:short")
    built = IdempotencyMiddleware(
        app, MemoryStore(), tenant=header_tenant("x-account"), fingerprint_keys="k1:" + "x" * 32
    )
    assert built.fingerprint_keys.current == "k1"


async def test_a_rotation_of_the_fingerprint_keys_turns_no_retry_into_a_422(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"rot-{uuid.uuid4().hex}"
    old, new = "2026-06:" + "o" * 40, "2026-11:" + "n" * 40
    body = {"amount": 5, "card": {"cvc": "123"}}
    async with client_for(charge_app(store, fingerprint_keys=old)) as client:
        first = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key})
    async with client_for(charge_app(store, fingerprint_keys=f"{new},{old}")) as client:
        replay = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key})
        other = await client.post("/v1/charges", json={**body, "amount": 6}, headers={"Idempotency-Key": key})
        fresh = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key + "-new"})
    assert (first.status_code, replay.status_code, replay.headers.get("idempotent-replayed")) == (201, 201, "true")
    assert other.status_code == 422
    assert fresh.status_code == 201
    async with client_for(charge_app(store, fingerprint_keys=new)) as client:  # the old key dropped too soon
        assert (await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key})).status_code == 422
        again = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key + "-new"})
        assert again.headers.get("idempotent-replayed") == "true"  # written under the new key


async def test_a_retry_in_flight_across_the_upgrade_still_matches_its_unkeyed_record(store: Store) -> None:
    """A record written before fingerprints were keyed holds the bare SHA-256: a retry after the upgrade is still
    the same request (a replay, or 409 while it runs), and a different request is still 422."""
    body = {"amount": 5, "card": {"cvc": "123"}}
    digest = charge_digest(5, "123")
    done, running = f"up-{uuid.uuid4().hex}", f"up-{uuid.uuid4().hex}"
    claim = await store.claim(tenant_of(), done, digest, lease=30, ttl=3600)
    assert await store.complete(tenant_of(), done, claim.fence, StoredResponse(201, [], b'{"charged":5}', 13))
    assert (await store.claim(tenant_of(), running, digest, lease=30, ttl=3600)).outcome is ClaimOutcome.OWNED
    async with client_for(charge_app(store)) as client:
        replay = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": done})
        conflict = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": running})
        other = await client.post("/v1/charges", json={**body, "amount": 6}, headers={"Idempotency-Key": done})
    assert (replay.status_code, replay.headers.get("idempotent-replayed"), replay.content) == (
        201,
        "true",
        b'{"charged":5}',
    )
    assert conflict.status_code == 409
    assert other.status_code == 422


def test_fingerprint_keys_are_checked_and_never_shown() -> None:
    keys = FingerprintKeys.parse("2026-11:" + "a" * 32 + ", 2026-06:" + "b" * 32)
    assert (keys.current, keys.key_ids) == ("2026-11", ("2026-11", "2026-06"))
    digest = fp(b"{}")
    current, previous = keys.digests(digest)
    assert current.startswith(b"2026-11:")
    assert previous.startswith(b"2026-06:")
    assert (fingerprint_key_id(current), fingerprint_key_id(previous), fingerprint_key_id(digest)) == (
        "2026-11",
        "2026-06",
        None,
    )
    assert "a" * 32 not in repr(keys)
    for text, message in (
        ("", "at least one key"),
        ("k:" + "x" * 31, "at least 32"),
        ("bad id:" + "x" * 32, "id:key"),
        ("k:" + "x" * 32 + ",k:" + "y" * 32, "given twice"),
    ):
        with pytest.raises(ValueError, match=message):
            FingerprintKeys.parse(text)


def test_a_fingerprint_key_written_before_its_id_is_never_in_the_error() -> None:
    key = bytes(range(32)).hex()
    with pytest.raises(ValueError, match="the 1st fingerprint key") as raised:
        FingerprintKeys.parse(f"{key}:2026-11")
    assert key not in str(raised.value)
