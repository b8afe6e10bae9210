"""The app the hostile-input properties attack: endpoints whose answers reveal who ran them, and how often.

Every answer carries the tenant and key the middleware resolved and a per-(tenant, key, path) run counter, so a
replay of another tenant's record, a second run of one key, or a mixed-up replay shows up in the response itself.
The handlers never fail on their own: any 500 is the middleware's.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, Store, idempotency_context

METHODS = ["POST", "PATCH", "PUT"]
MAX_REQUEST_BYTES = 2048


class Runs(Counter[tuple[str, str | None, str]]):
    """Handler runs per (tenant, key, path)."""


def build(store: Store, runs: Runs, **options: Any) -> Starlette:
    def count(request: Request) -> tuple[dict[str, Any], int]:
        context = idempotency_context(request)
        tenant = context.tenant if context else ""
        key = context.key if context else None
        runs[(tenant, key, request.scope["path"])] += 1
        run = runs[(tenant, key, request.scope["path"])]
        return {"tenant": tenant, "key": key, "run": run}, run

    async def echo(request: Request) -> Response:
        body = await request.body()
        seen, _ = count(request)
        seen["sha256"] = hashlib.sha256(body).hexdigest()
        seen["body"] = body[:200].decode("latin-1")
        return JSONResponse(seen, status_code=201)

    async def status(request: Request) -> Response:
        await request.body()
        seen, _ = count(request)
        return JSONResponse(seen, status_code=int(request.path_params["code"]))

    async def stream(request: Request) -> Response:
        await request.body()
        seen, run = count(request)

        async def chunks() -> AsyncIterator[bytes]:
            yield b"run=%d;" % run
            yield repr(seen).encode()

        return StreamingResponse(chunks(), media_type="text/plain", headers={"x-run": str(run), "set-cookie": "a=1"})

    app = Starlette(
        routes=[
            Route("/echo", echo, methods=METHODS),
            Route("/status/{code:int}", status, methods=METHODS),
            Route("/stream", stream, methods=METHODS),
        ]
    )
    options.setdefault("max_request_bytes", MAX_REQUEST_BYTES)
    options.setdefault("on_event", None)
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app
