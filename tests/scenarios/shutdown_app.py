"""An app for the graceful-shutdown test: uvicorn serves it in a child process (``tests/scenarios/test_shutdown.py``).

Its handler sleeps as long as the ``x-sleep`` header says (headers are not part of the fingerprint, so a retry with
a shorter sleep is still the same request), and it closes its store in the lifespan's shutdown, the order the docs
give.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore

TENANT = "t-shutdown"
store = PostgresStore(os.environ["DATABASE_URL"], timeout=2.0)


async def charge(request: Request) -> Response:
    await asyncio.sleep(float(request.headers.get("x-sleep", "0")))
    return JSONResponse({"charged": True}, status_code=201)


async def ready(request: Request) -> Response:
    return JSONResponse({"ready": True})


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    await store.open()
    yield
    await store.close()  # after the server has cancelled the requests still running: their keys are released first


app = Starlette(routes=[Route("/charge", charge, methods=["POST"]), Route("/ready", ready)], lifespan=lifespan)
app.add_middleware(IdempotencyMiddleware, store=store, tenant=lambda scope: TENANT)
