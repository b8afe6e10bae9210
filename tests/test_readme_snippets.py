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


async def test_the_use_it_snippet_opens_the_store_at_startup_and_closes_it_at_shutdown(
    idempotency_database_url: str,
) -> None:
    snippet = use_it_snippet()
    assert "await store.close()" in snippet
    code = snippet.replace('"postgresql://app@db/app"', repr(idempotency_database_url)).replace(
        "routes=...", "routes=ROUTES"
    )
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def charge(request: Any) -> JSONResponse:
        return JSONResponse({"charged": True}, status_code=201)

    namespace: dict[str, Any] = {"ROUTES": [Route("/charges", charge, methods=["POST"])]}
    exec(compile(code, str(README), "exec"), namespace)
    app, store = namespace["app"], namespace["store"]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4()), "Authorization": "Bearer sk_test_readme"}
            first = await client.post("/charges", headers=headers)
            again = await client.post("/charges", headers=headers)
        assert (first.status_code, again.headers.get("idempotent-replayed")) == (201, "true")
    with pytest.raises(StoreUnavailable):
        await store.inspect("", "any")  # closed at shutdown
