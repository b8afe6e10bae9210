"""A key's status for its client (``key_status_route``): absent, in progress or completed, with its status and
expiry, read by the key's own tenant only; on both stores and in both modes."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, key_status_route
from idempotency_mw.store import Store
from tests.conftest import client_for
from tests.test_docs import recipe


async def test_a_client_learns_whether_its_request_took_effect(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    started, release = asyncio.Event(), asyncio.Event()

    async def order(request: Request) -> Response:
        if request.headers["idempotency-key"].startswith("slow"):
            started.set()
            await release.wait()
        if request.headers["idempotency-key"].startswith("fail"):
            return JSONResponse({"error": "upstream"}, status_code=502)
        return JSONResponse({"id": "or_1"}, status_code=201)

    app = Starlette(routes=[Route("/orders", order, methods=["POST"]), key_status_route(store)])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional)
    unique = uuid.uuid4().hex
    async with client_for(app, token="sk_test_status") as alice, client_for(app, token="sk_test_other") as eve:

        async def status(client: httpx.AsyncClient, key: str) -> dict[str, object]:
            answer = await client.get(f"/idempotency-keys/{key}")
            assert answer.status_code == 200
            assert answer.headers["cache-control"] == "no-store"
            found: dict[str, object] = answer.json()
            return found

        assert (await status(alice, f"done-{unique}"))["state"] == "absent"  # never seen
        await alice.post("/orders", headers={"Idempotency-Key": f"done-{unique}"})
        done = await status(alice, f"done-{unique}")
        assert (done["state"], done["status"]) == ("completed", 201)
        assert done["first_seen"] is not None
        assert done["expires"] is not None
        assert str(done["expires"]) > str(done["first_seen"])
        assert (await status(eve, f"done-{unique}"))["state"] == "absent"  # another tenant's: absent to it
        running = asyncio.create_task(alice.post("/orders", headers={"Idempotency-Key": f"slow-{unique}"}))
        await started.wait()
        assert (await status(alice, f"slow-{unique}"))["state"] == "in_progress"
        release.set()
        await running
        await alice.post("/orders", headers={"Idempotency-Key": f"fail-{unique}"})
        assert (await status(alice, f"fail-{unique}"))["state"] == "absent"  # released: it leaves no record
        bad = await alice.get("/idempotency-keys/" + "x" * 300)
        assert (bad.status_code, bad.json()["code"]) == (400, "idempotency_key_invalid")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as nobody:
            anonymous = await nobody.get(f"/idempotency-keys/done-{unique}")
        assert (anonymous.status_code, anonymous.json()["code"]) == (400, "idempotency_tenant_unknown")


def test_the_path_names_the_key() -> None:
    with pytest.raises(ValueError, match="with \\{key\\} in it"):
        key_status_route(MemoryStore(), "/idempotency-keys")


async def test_the_guides_status_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("key_status", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as module:
        key = str(uuid.uuid4())
        async with client_for(module.app, token="sk_test_guide_status") as client:
            await client.post("/v1/uploads", headers={"Idempotency-Key": key})
            found = (await client.get(f"/idempotency-keys/{key}")).json()
        await module.store.close()
    assert (found["state"], found["status"]) == ("completed", 201)


@pytest.mark.parametrize("key", ["orders/2024/7", "100%", "a?b#c"])
async def test_a_key_with_a_slash_or_a_reserved_character_reads_its_status(key: str) -> None:
    """Any key the middleware takes has a status: one with a ``/`` (percent-encoded by the client, decoded by the
    server) still reaches the route, where a path segment would not."""
    store = MemoryStore()

    async def order(request: Request) -> Response:
        return JSONResponse({"id": "or_1"}, status_code=201)

    app = Starlette(routes=[Route("/orders", order, methods=["POST"]), key_status_route(store)])
    app.add_middleware(IdempotencyMiddleware, store=store)
    async with client_for(app, token="sk_test_slash") as client:
        await client.post("/orders", headers={"Idempotency-Key": key})
        found = await client.get("/idempotency-keys/" + quote(key, safe=""))
    assert found.status_code == 200
    assert (found.json()["key"], found.json()["state"]) == (key, "completed")
