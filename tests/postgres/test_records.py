"""rows.py: how the PostgreSQL stores write records and read them back: a claim's fence, the claim's answer row, a
completion's arguments, and the header list as the ``headers`` column holds it."""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
from hypothesis import given
from hypothesis import strategies as st

from idempotency_mw.postgres._records import Records, claim_from_row, new_fence
from idempotency_mw.store import Claim, ClaimOutcome, Headers, StoredResponse, decode_headers, encode_headers

HEADERS: Headers = [(b"set-cookie", b"a=1"), (b"X-Odd", b"\xff\x00 caf\xc3\xa9"), (b"set-cookie", b"b=2")]


async def answer_row(db: asyncpg.Connection, **columns: Any) -> asyncpg.Record:
    """A row shaped as the ``claim`` statement answers (sql/queries.sql), made by PostgreSQL itself."""
    values = {
        "owned": False,
        "same_request": True,
        "completed": False,
        "fence": None,
        "attempts": 2,
        "status": None,
        "headers": None,
        "body": None,
        "body_size": None,
        "sealed": None,
        "sealed_with": None,
        "unkeyed": None,
        "expires_at": None,
        "parts": None,
        **columns,
    }
    row = await db.fetchrow(
        "SELECT $1::boolean AS owned, $2::boolean AS same_request, $3::boolean AS completed, $4::bigint AS fence, "
        "$5::int AS attempts, $6::int AS status, $7::text AS headers, $8::bytea AS body, $9::int AS body_size, "
        "$10::bytea AS sealed, $11::text AS sealed_with, $12::bytea AS unkeyed, $13::float8 AS expires_at, "
        "$14::bytea AS parts",
        *values.values(),
    )
    assert row is not None
    return row


def test_headers_round_trip_byte_for_byte_in_order_and_with_repeats() -> None:
    encoded = encode_headers(HEADERS)
    assert orjson.loads(encoded)[0] == ["set-cookie", "a=1"]  # JSON [[name, value], ...]
    assert decode_headers(encoded) == HEADERS
    assert decode_headers(encoded.encode()) == HEADERS  # the column's bytes


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=40)), max_size=8))
def test_any_header_bytes_round_trip(headers: list[tuple[bytes, bytes]]) -> None:
    assert decode_headers(encode_headers(headers)) == headers


def test_fences_are_positive_63_bit_tokens() -> None:
    fences = {new_fence() for _ in range(1000)}
    assert len(fences) == 1000
    assert all(0 < fence < 2**63 for fence in fences)


def test_a_completion_carries_the_response_with_its_headers_encoded() -> None:
    response = StoredResponse(201, HEADERS, b"body", 4)
    completion = Records("public", timeout=5, cipher=None).completion("t", "k", 7, response)
    assert completion == ("t", "k", 7, 201, encode_headers(HEADERS), b"body", 4, None, None)


async def test_an_owned_claim_carries_its_fence(db: asyncpg.Connection) -> None:
    row = await answer_row(db, owned=True, fence=42, attempts=0)
    assert claim_from_row(row, "t", "k") == Claim(ClaimOutcome.OWNED, fence=42, attempts=0)


async def test_another_request_under_the_key_is_a_mismatch(db: asyncpg.Connection) -> None:
    row = await answer_row(db, same_request=False, completed=True, status=201)  # whatever its state
    assert claim_from_row(row, "t", "k") == Claim(ClaimOutcome.MISMATCH, attempts=2)
    unkeyed = await answer_row(db, same_request=False, unkeyed=bytes(32))  # a fingerprint written before keying
    assert claim_from_row(unkeyed, "t", "k") == Claim(ClaimOutcome.MISMATCH, attempts=2, unkeyed=bytes(32))
    explained = await answer_row(db, same_request=False, parts=b"parts")  # written by a route that explains
    assert claim_from_row(explained, "t", "k") == Claim(ClaimOutcome.MISMATCH, attempts=2, parts=b"parts")


async def test_the_same_request_still_running_is_in_progress(db: asyncpg.Connection) -> None:
    row = await answer_row(db, fence=9)  # the running claim's fence: what its settlement is announced by
    assert claim_from_row(row, "t", "k") == Claim(ClaimOutcome.IN_PROGRESS, fence=9, attempts=2)


async def test_the_same_request_completed_carries_its_response(db: asyncpg.Connection) -> None:
    row = await answer_row(db, completed=True, status=201, headers=encode_headers(HEADERS), body=b"done", body_size=4)
    assert claim_from_row(row, "t", "k") == Claim(
        ClaimOutcome.COMPLETED, response=StoredResponse(201, HEADERS, b"done", 4), attempts=2
    )


async def test_a_completed_response_without_its_body_keeps_its_size(db: asyncpg.Connection) -> None:
    row = await answer_row(db, completed=True, status=200, headers="[]", body=None, body_size=5000)
    claim = claim_from_row(row, "t", "k")
    assert claim.response == StoredResponse(200, [], None, 5000)  # over the cap: not replayable, size known
