"""The app that tests/scenarios/test_servers.py serves under uvicorn, Hypercorn and Granian, each in a child process.

The test steers it over HTTP, since it runs in another process:

- every handler run writes a row to ``server_effects`` (the test counts the runs of a key there);
- a request names a probe in its ``X-Probe`` header (not part of the fingerprint, so a retry can name another). A
  held probe stops its handler at a checkpoint until the test opens it (``/probe/{name}/hold``, ``/open``), and
  ``/probe/{name}/entered`` answers once the checkpoint is reached;
- a spy outside everything else records which ASGI messages the response went out as (to see
  ``http.response.pathsend``), whether the server offered that extension, and how the app finished with the
  request; ``/probe/{name}`` answers with that once the app is done.

``create_app`` reads ``DATABASE_URL`` and ``SERVER_APP_FILE`` (the file ``/file`` serves). ``misdeclared`` and
``misconfigured`` are apps with a bad route declaration and a bad app-wide setting, to see what each server does
with them at startup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, idempotency_context, idempotent

PROBE_HEADER = b"x-probe"
PATIENCE = 15.0  # how long a control request waits for the app before answering 504 (the test's own timeout is longer)
STREAM_CHUNKS = (b"chunk 1\n", b"chunk 2\n", b"chunk 3\n", b"chunk 4\n")
EFFECTS_TABLE = "CREATE TABLE IF NOT EXISTS server_effects (key text NOT NULL, route text NOT NULL)"


@dataclass
class Probe:
    held: bool = False
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    messages: list[str] = field(default_factory=list)
    offered_pathsend: bool = False
    outcome: str = ""
    background: str = ""

    async def checkpoint(self) -> None:
        self.entered.set()
        if self.held:
            await self.opened.wait()


PROBES: defaultdict[str, Probe] = defaultdict(Probe)


def probe_of(request: Request) -> Probe:
    return PROBES[request.headers.get("x-probe", "")]


class Spy:
    """Outermost: what the server saw of the response, and how the app ended, for requests that name a probe."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = dict(scope.get("headers", ())).get(PROBE_HEADER) if scope["type"] == "http" else None
        if name is None:
            return await self.app(scope, receive, send)
        probe = PROBES[name.decode()]
        probe.offered_pathsend = "http.response.pathsend" in scope.get("extensions", {})

        async def spied(message: Message) -> None:
            probe.messages.append(message["type"])
            await send(message)

        try:
            await self.app(scope, receive, spied)
            probe.outcome = "returned"
        except BaseException as error:  # CancelledError included: a server that cancels the request
            probe.outcome = f"raised {type(error).__name__}"
            raise
        finally:
            probe.finished.set()


async def record_effect(request: Request, route: str) -> int:
    """One row per run; returns how many runs this key has had, counting this one."""
    context = idempotency_context(request)
    key = context.key if context is not None and context.key is not None else "-"
    writer = context.connection if context is not None and context.connection is not None else request.app.state.pool
    await writer.execute("INSERT INTO server_effects (key, route) VALUES ($1, $2)", key, route)
    return int(await writer.fetchval("SELECT count(*) FROM server_effects WHERE key = $1", key))


async def charge(request: Request) -> Response:
    """A final answer with a header list worth keeping byte for byte: two Set-Cookie with a header between."""
    body = await request.body()
    await probe_of(request).checkpoint()
    run = await record_effect(request, "charge")
    response = Response(orjson.dumps({"run": run, "echo": body.decode()}), 201, media_type="application/json")
    response.raw_headers += [
        (b"set-cookie", b"a=1; Path=/"),
        (b"x-between", b"kept in place"),
        (b"set-cookie", b"b=2; Path=/"),
    ]
    return response


async def attentive(request: Request) -> Response:
    """A handler that gives up when its client leaves before the work starts (and has done nothing by then)."""
    left = asyncio.ensure_future(_client_left(request.receive))
    ready = asyncio.ensure_future(probe_of(request).checkpoint())
    try:
        done, _ = await asyncio.wait({left, ready}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        ready.cancel()
    if left in done:
        raise ClientDisconnect
    run = await record_effect(request, "attentive")
    return JSONResponse({"run": run}, status_code=201)


async def _client_left(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream(request: Request) -> Response:
    """Charge first, then stream a receipt in several chunks, stopping at the checkpoint halfway."""
    probe = probe_of(request)
    run = await record_effect(request, "stream")

    async def receipt() -> AsyncIterator[bytes]:
        yield STREAM_CHUNKS[0]
        yield STREAM_CHUNKS[1]
        await probe.checkpoint()
        yield STREAM_CHUNKS[2]
        yield STREAM_CHUNKS[3]

    return StreamingResponse(receipt(), media_type="text/plain", headers={"x-run": str(run)})


async def background(request: Request) -> Response:
    """Answer, then keep working: the background task stops at the checkpoint."""
    probe = probe_of(request)
    run = await record_effect(request, "background")

    async def after() -> None:
        probe.background = "running"
        await probe.checkpoint()
        probe.background = "done"

    return JSONResponse({"run": run}, status_code=201, background=BackgroundTask(after))


async def file(request: Request) -> Response:
    if request.method == "POST":
        await record_effect(request, "file")
    return FileResponse(os.environ["SERVER_APP_FILE"], media_type="application/octet-stream")


@idempotent(transactional=True)
async def transactional(request: Request) -> Response:
    """The effect and the record commit in one transaction (the policy is read at lifespan startup)."""
    context = idempotency_context(request)
    connection = context.connection if context is not None else None
    if connection is None or not connection.is_in_transaction():
        raise RuntimeError("a transactional route runs in the middleware's transaction")
    run = await record_effect(request, "transactional")
    return JSONResponse({"run": run}, status_code=201)


async def hold(request: Request) -> Response:
    PROBES[request.path_params["name"]].held = True
    return Response(status_code=204)


async def open_gate(request: Request) -> Response:
    PROBES[request.path_params["name"]].opened.set()
    return Response(status_code=204)


async def entered(request: Request) -> Response:
    if not await _reached(PROBES[request.path_params["name"]].entered):
        return Response("the handler did not reach its checkpoint", status_code=504)
    return Response(status_code=204)


async def report(request: Request) -> Response:
    probe = PROBES[request.path_params["name"]]
    if not await _reached(probe.finished):
        return Response("the app is not done with the request", status_code=504)
    fields = ("messages", "offered_pathsend", "outcome", "background")
    return JSONResponse({name: getattr(probe, name) for name in fields})


async def _reached(event: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(event.wait(), PATIENCE)
    except TimeoutError:
        return False
    return True


def create_app() -> ASGIApp:
    dsn = os.environ["DATABASE_URL"]
    store = PostgresStore(dsn)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with store, asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            app.state.pool = pool
            yield

    routes = [
        Route("/charge", charge, methods=["POST"]),
        Route("/attentive", attentive, methods=["POST"]),
        Route("/stream", stream, methods=["POST"]),
        Route("/background", background, methods=["POST"]),
        Route("/file", file, methods=["GET", "POST"]),
        Route("/transactional", transactional, methods=["POST"]),
        Route("/probe/{name}/hold", hold),
        Route("/probe/{name}/open", open_gate),
        Route("/probe/{name}/entered", entered),
        Route("/probe/{name}", report),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=store)
    return Spy(app)


def misdeclared() -> ASGIApp:
    """A transactional route on a store without transactions: refused at lifespan startup."""
    app = Starlette(routes=[Route("/transactional", transactional, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    return app


def misconfigured() -> ASGIApp:
    """A bad app-wide setting: raised when Starlette builds its middleware stack, on the first ASGI message."""
    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), fail_open=True, transactional=True)
    return app
