"""A client that hangs up while a streamed response is on its way, after the handler's effect has happened.

This is the "response lost" case the middleware exists for, without any crash: the effect ran, the client never
got the whole answer, and it retries. Under ASGI spec 2.3 (uvicorn) Starlette's ``StreamingResponse`` stops
streaming when it hears ``http.disconnect``; under spec 2.4 the server's ``send`` raises ``OSError``. Either way
the retry must not run the effect a second time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from tests.faults import asgi

CHUNKS = 8


@pytest.fixture
async def db(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(idempotency_database_url)
    await connection.execute("CREATE TABLE IF NOT EXISTS faults_hangup_effects (key text NOT NULL)")
    yield connection
    await connection.close()


def build(store: PostgresStore, pool: asyncpg.Pool, *, transactional: bool, max_response_bytes: int) -> Starlette:
    async def download(request: Request) -> Response:
        """Charge first, then stream a receipt: the effect is done before the first byte goes out."""
        await request.body()
        context = idempotency_context(request)
        assert context is not None
        writer = context.connection or pool
        await writer.execute("INSERT INTO faults_hangup_effects (key) VALUES ($1)", context.key)

        async def receipt() -> AsyncIterator[bytes]:
            for part in range(CHUNKS):
                yield b"line %d\n" % part
                await asyncio.sleep(0.01)  # a slow download: the hang-up arrives mid-stream

        return StreamingResponse(receipt(), media_type="text/plain")

    app = Starlette(routes=[Route("/download", download, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        transactional=transactional,
        max_response_bytes=max_response_bytes,
        on_event=None,
    )
    return app


async def hang_up_then_retry(app: Starlette, db: asyncpg.Connection, spec_version: str) -> tuple[int, asgi.Reply]:
    key = f"hangup-{uuid.uuid4().hex}"
    headers = [(b"authorization", b"Bearer hangup"), (b"idempotency-key", key.encode())]
    first = await asgi.call(app, "POST", "/download", headers, hang_up_after=2, spec_version=spec_version)
    assert first.status == 200  # the client saw the answer start, then left
    retry = await asgi.call(app, "POST", "/download", headers, spec_version=spec_version)
    effects = int(await db.fetchval("SELECT count(*) FROM faults_hangup_effects WHERE key = $1", key))
    return effects, retry


@pytest.fixture
async def pool(idempotency_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=2) as created:
        yield created


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("cap", [64 * 1024, 16], ids=["held-until-commit", "over-the-storage-cap"])
async def test_transactional_hang_up_mid_stream_takes_effect_once(
    idempotency_store: PostgresStore, pool: asyncpg.Pool, db: asyncpg.Connection, spec_version: str, cap: int
) -> None:
    app = build(idempotency_store, pool, transactional=True, max_response_bytes=cap)
    effects, retry = await hang_up_then_retry(app, db, spec_version)
    assert effects == 1
    assert retry.status in (200, 409)  # a replay, or "completed but too large to replay": never a second run
    assert retry.status == 409 or retry.replayed


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_plain_hang_up_mid_stream_takes_effect_once(
    idempotency_store: PostgresStore, pool: asyncpg.Pool, db: asyncpg.Connection, spec_version: str
) -> None:
    app = build(idempotency_store, pool, transactional=False, max_response_bytes=64 * 1024)
    effects, retry = await hang_up_then_retry(app, db, spec_version)
    assert effects == 1, f"the effect ran {effects} times for one key (retry answered {retry.status})"
