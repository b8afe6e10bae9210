"""The README's "Use it" snippet runs as written (with a real database URL and real routes filled in)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from idempotency_mw import StoreUnavailable

README = Path(__file__).resolve().parents[1] / "README.md"


def use_it_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use it") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


def run_use_it_snippet(database_url: str) -> tuple[Any, Any]:
    """The snippet's ``app`` and ``store``, on ``database_url``, with one route that answers 201."""
    snippet = use_it_snippet()
    assert "await store.close()" in snippet
    code = snippet.replace('"postgresql://app@db/app"', repr(database_url)).replace("routes=...", "routes=ROUTES")
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def charge(request: Any) -> JSONResponse:
        return JSONResponse({"charged": True}, status_code=201)

    namespace: dict[str, Any] = {"ROUTES": [Route("/charges", charge, methods=["POST"])]}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace["app"], namespace["store"]


async def test_the_use_it_snippet_opens_the_store_at_startup_and_closes_it_at_shutdown(
    idempotency_database_url: str,
) -> None:
    app, store = run_use_it_snippet(idempotency_database_url)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4()), "Authorization": "Bearer sk_test_readme"}
            first = await client.post("/charges", headers=headers)
            again = await client.post("/charges", headers=headers)
        assert (first.status_code, again.headers.get("idempotent-replayed")) == (201, "true")
    with pytest.raises(StoreUnavailable):
        await store.inspect("", "any")  # closed at shutdown


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient` is deprecated")
def test_the_use_it_snippet_serves_one_test_client_after_another(idempotency_database_url: str) -> None:
    """The README's module-level store, opened and closed by the lifespan once per test (``with TestClient(app):``,
    each on an event loop of its own): the second startup failed with "the idempotency store's pool is closed"."""
    from starlette.testclient import TestClient

    app, _ = run_use_it_snippet(idempotency_database_url)
    for _ in range(2):
        with TestClient(app) as client:
            headers = {"Idempotency-Key": str(uuid.uuid4()), "Authorization": "Bearer sk_test_readme"}
            assert client.post("/charges", headers=headers).status_code == 201
            assert client.post("/charges", headers=headers).headers.get("idempotent-replayed") == "true"
