"""Big bodies (issue 4): responses near and over the storage cap, request bodies over the request cap.

In-process on the real PostgreSQL, in both modes, with small caps so the suite stays fast; the soak command
(``python -m faults.soak``) runs the same against a worker process with megabyte bodies and records its memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from faults.bigbodies import run_big_bodies
from faults.ledger_app import create_app

CAP = 64 * 1024


@pytest.fixture(params=[True, False], ids=["transactional", "plain"])
async def client(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        idempotency_database_url, transactional=request.param, max_response_bytes=CAP, max_request_bytes=CAP
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://faults") as http:
            yield http


async def effects(dsn: str, key: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        return int(await connection.fetchval("SELECT count(*) FROM faults_effects WHERE key = $1", key))
    finally:
        await connection.close()


@pytest.mark.parametrize("size", [CAP - 1, CAP], ids=["under", "at"])
async def test_response_at_or_under_the_cap_is_replayed_byte_for_byte(
    client: httpx.AsyncClient, idempotency_database_url: str, key: str, size: int
) -> None:
    first = await client.post(f"/big?size={size}", headers={"Idempotency-Key": key})
    again = await client.post(f"/big?size={size}", headers={"Idempotency-Key": key})
    assert first.status_code == 200
    assert len(first.content) == size
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await effects(idempotency_database_url, key) == 1


@pytest.mark.parametrize("size", [CAP + 1, 20 * CAP], ids=["just-over", "far-over"])
async def test_response_over_the_cap_arrives_whole_once_and_is_never_rerun(
    client: httpx.AsyncClient, idempotency_database_url: str, key: str, size: int
) -> None:
    first = await client.post(f"/big?size={size}", headers={"Idempotency-Key": key})
    again = await client.post(f"/big?size={size}", headers={"Idempotency-Key": key})
    assert first.status_code == 200
    assert first.content == b"x" * size
    assert again.status_code == 409
    assert again.json()["code"] == "idempotency_response_not_replayable"
    assert await effects(idempotency_database_url, key) == 1


async def test_request_at_the_cap_runs(client: httpx.AsyncClient, idempotency_database_url: str, key: str) -> None:
    response = await client.post("/effects", content=b"a" * CAP, headers={"Idempotency-Key": key})
    assert response.status_code == 201
    assert await effects(idempotency_database_url, key) == 1


async def test_request_over_the_cap_is_413_before_anything_runs(
    client: httpx.AsyncClient, idempotency_database_url: str, key: str
) -> None:
    declared = await client.post("/effects", content=b"a" * (CAP + 1), headers={"Idempotency-Key": key})

    async def unannounced() -> AsyncIterator[bytes]:
        for _ in range(40):  # 40 x 4 KiB: no Content-Length, over the cap after 17 chunks
            yield b"b" * 4096

    streamed = await client.post("/effects", content=unannounced(), headers={"Idempotency-Key": key})
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["code"] == "request_too_large"
    assert await effects(idempotency_database_url, key) == 0
    fits = await client.post("/effects", content=b"a" * CAP, headers={"Idempotency-Key": key})
    assert fits.status_code == 201, "a refused request must leave its key free"


@pytest.mark.slow
async def test_big_bodies_through_a_worker_process(idempotency_database_url: str) -> None:
    """The soak's big-body round, small: correctness only (the soak records the memory)."""
    result, seen = await run_big_bodies(idempotency_database_url, cap=256 * 1024, large=4 * 1024 * 1024, parallel=4)
    assert result.duplicates == 0
    assert result.lost == 0
    assert seen["whole"] == 3 + 4
    assert seen["replayed identically"] == 2
    assert seen["over the cap: refused, not rerun"] == 1 + 4
    assert seen["413"] + sum(n for label, n in seen.items() if label.startswith("streamed request ended")) == 2
