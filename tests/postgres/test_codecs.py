"""The store's statements do not depend on the connection's json and jsonb codecs: an app's pool whose ``init`` sets
asyncpg's documented JSON codec, or a handler that sets one on the connection it was lent, changes nothing of what
the store writes or reads back (the headers go as text and come back as text, sql/queries.sql). Headers a codec
encoded twice before (a JSON string in the column) still decode."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from idempotency_mw.store import decode_headers, encode_headers
from tests.conftest import client_for

# The response's own headers, in order, with a repeat and a byte outside ASCII: the replay must carry them as sent.
HEADERS = [(b"x-receipt", b"r-1"), (b"set-cookie", b"a=1"), (b"set-cookie", b"b=2"), (b"x-odd", b"caf\xe9 \xff")]
BODY = b'{"paid": true}'
REPLAY_ONLY = {b"idempotent-replayed"}  # what a replay adds to the stored response


async def _jsonb(connection: asyncpg.Connection) -> None:  # asyncpg's documented "automatic JSON conversion"
    await connection.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _json(connection: asyncpg.Connection) -> None:
    await connection.set_type_codec("json", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _both(connection: asyncpg.Connection) -> None:
    await _json(connection)
    await _jsonb(connection)


Init = Callable[[asyncpg.Connection], Coroutine[Any, Any, None]]  # a pool's init
CODECS: dict[str, Init] = {"jsonb": _jsonb, "json": _json, "both": _both}


async def pay(request: Request) -> Response:
    response = Response(BODY, status_code=201, media_type="application/json")
    response.raw_headers.extend(HEADERS)
    return response


def app_for(store: PostgresStore, *, transactional: bool, tenant: str, routes: list[Route] | None = None) -> Starlette:
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"]), *(routes or [])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, tenant=lambda scope: tenant)
    return app


def shown(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in raw if name.lower() not in REPLAY_ONLY]


async def stored_kind(url: str, tenant: str, key: str) -> str | None:
    """What the headers column holds, read on a connection without codecs: an array, as the store writes it."""
    observer = await asyncpg.connect(url)
    try:
        kind: str | None = await observer.fetchval(
            "SELECT jsonb_typeof(headers) FROM idempotency_responses WHERE tenant = $1 AND key = $2", tenant, key
        )
        return kind
    finally:
        await observer.close()


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
@pytest.mark.parametrize("codec", list(CODECS))
async def test_an_apps_pool_with_a_json_codec_completes_and_replays_byte_for_byte(
    idempotency_database_url: str, codec: str, transactional: bool
) -> None:
    tenant, key = f"t-codec-{codec}-{transactional}", str(uuid.uuid4())
    pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=2, init=CODECS[codec])
    try:
        store = PostgresStore(pool)
        client = client_for(app_for(store, transactional=transactional, tenant=tenant))
        first = await client.post("/pay", headers={"Idempotency-Key": key})
        assert first.status_code == 201, first.text
        assert first.headers.get("idempotent-replayed") is None
        assert await stored_kind(idempotency_database_url, tenant, key) == "array"
        again = await client.post("/pay", headers={"Idempotency-Key": key})  # on the app's pool, with its codec
        assert again.status_code == 201, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert (again.content, shown(again.headers.raw)) == (first.content, shown(first.headers.raw))
        record = await store.inspect(tenant, key)  # inspect reads the headers on the app's pool too
        assert record is not None
        assert record.response is not None
        assert [pair for pair in record.response.headers if pair in HEADERS] == HEADERS
        await store.close()
    finally:
        await pool.close()
    async with PostgresStore(idempotency_database_url, max_size=2) as plain:  # same database, no codec (e.g. the CLI)
        other = await client_for(app_for(plain, transactional=transactional, tenant=tenant)).post(
            "/pay", headers={"Idempotency-Key": key}
        )
    assert other.status_code == 201, other.text
    assert other.headers.get("idempotent-replayed") == "true"
    assert (other.content, shown(other.headers.raw)) == (first.content, shown(first.headers.raw))


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_a_handler_that_sets_a_jsonb_codec_on_its_connection_changes_nothing_later_requests_store(
    idempotency_database_url: str, pool: str
) -> None:
    async def codec(request: Request) -> Response:  # for the handler's own queries, on the connection it was lent
        connection = idempotency_context(request).connection  # type: ignore[union-attr]
        assert connection is not None
        await _jsonb(connection)
        return Response(b"{}", status_code=201, media_type="application/json")

    tenant = f"t-lent-codec-{pool}"
    # One connection: the next requests run on the connection the handler set its codec on.
    app_pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=1) if pool == "app" else None
    store = (
        PostgresStore(app_pool)
        if app_pool is not None
        else PostgresStore(idempotency_database_url, min_size=1, max_size=1)
    )
    keys = [str(uuid.uuid4()) for _ in range(2)]
    try:
        routes = [Route("/codec", codec, methods=["POST"])]
        client = client_for(app_for(store, transactional=True, tenant=tenant, routes=routes))
        assert (await client.post("/codec", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        plain_client = client_for(app_for(store, transactional=False, tenant=tenant))
        firsts = [
            await client.post("/pay", headers={"Idempotency-Key": keys[0]}),
            await plain_client.post("/pay", headers={"Idempotency-Key": keys[1]}),
        ]
        assert [first.status_code for first in firsts] == [201, 201]
        for key in keys:
            assert await stored_kind(idempotency_database_url, tenant, key) == "array"
        for key, first in zip(keys, firsts, strict=True):  # on the same connection, its codec still set
            again = await client.post("/pay", headers={"Idempotency-Key": key})
            assert again.status_code == 201, again.text
            assert again.headers.get("idempotent-replayed") == "true"
            assert (again.content, shown(again.headers.raw)) == (first.content, shown(first.headers.raw))
    finally:
        await store.close()
        if app_pool is not None:
            await app_pool.close()
    async with PostgresStore(idempotency_database_url, max_size=2) as other:  # another instance, fresh connections
        other_client = client_for(app_for(other, transactional=True, tenant=tenant))
        for key, first in zip(keys, firsts, strict=True):
            replay = await other_client.post("/pay", headers={"Idempotency-Key": key})
            assert replay.status_code == 201, replay.text
            assert replay.headers.get("idempotent-replayed") == "true"
            assert (replay.content, shown(replay.headers.raw)) == (first.content, shown(first.headers.raw))


def test_headers_encoded_twice_decode_as_the_list() -> None:
    encoded = encode_headers(HEADERS)
    assert decode_headers(orjson.dumps(encoded)) == HEADERS  # what a jsonb codec made of the JSON text
    assert decode_headers(orjson.dumps(encoded).decode()) == HEADERS


async def test_a_response_stored_by_a_codec_before_the_fix_replays(idempotency_database_url: str) -> None:
    """A record whose headers a connection's codec encoded twice (a JSON string, as the statements stored them
    when they passed the headers as a jsonb value) replays, and reencrypt can read it: it does not fail until it
    expires."""
    tenant, key = "t-codec-stored-before", str(uuid.uuid4())
    async with PostgresStore(idempotency_database_url, max_size=2) as store:
        client = client_for(app_for(store, transactional=False, tenant=tenant))
        first = await client.post("/pay", headers={"Idempotency-Key": key})
        assert first.status_code == 201, first.text
        observer = await asyncpg.connect(idempotency_database_url)
        try:
            await observer.execute(
                "UPDATE idempotency_responses SET headers = to_jsonb(headers::text) WHERE tenant = $1 AND key = $2",
                tenant,
                key,
            )
        finally:
            await observer.close()
        assert await stored_kind(idempotency_database_url, tenant, key) == "string"
        again = await client.post("/pay", headers={"Idempotency-Key": key})
        assert again.status_code == 201, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert (again.content, shown(again.headers.raw)) == (first.content, shown(first.headers.raw))
        record = await store.inspect(tenant, key)
        assert record is not None
        assert record.response is not None
        assert [pair for pair in record.response.headers if pair in HEADERS] == HEADERS
