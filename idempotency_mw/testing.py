"""A pytest plugin for apps that use idempotency_mw (installed with the package, loaded by pytest itself).

It needs the ``testing`` extra (``pip install 'idempotency-mw[testing]'``: pytest, pytest-asyncio, httpx to call the
app in process, and an embedded PostgreSQL for when ``DATABASE_URL`` is not set).

Fixtures:

- ``idempotency_database_url``: a migrated PostgreSQL for the test session (``DATABASE_URL``, else embedded).
- ``idempotency_store``: a :class:`~idempotency_mw.PostgresStore` on it, closed after each test (at once: without
  the grace ``close()`` gives claims still being settled at a server's shutdown). It is an async
  fixture declared with pytest-asyncio's own decorator, so it works in pytest-asyncio's default strict mode (mark
  the test ``@pytest.mark.asyncio``) as well as in auto mode.

Helpers: :func:`assert_idempotent` fires one request many times, concurrently, and checks that the endpoint ran
once and every answer was the first response or a 409 in-progress. :func:`run_lifespan` runs an app's lifespan
around a block, which httpx's ``ASGITransport`` does not: an app that opens its store at startup needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:
    import pytest
except ImportError as error:
    raise ImportError("idempotency_mw.testing needs pytest: pip install 'idempotency-mw[testing]'") from error

import asyncpg

from idempotency_mw._wire import PROBLEM_HEADER, ProblemCode
from idempotency_mw.devdb import local_database
from idempotency_mw.postgres._store import PostgresStore


def _async_fixture(function: Callable[..., Any]) -> Any:
    """pytest-asyncio's fixture decorator, which works in its strict mode (the default) and in auto mode.

    Without pytest-asyncio the fixture fails with the install line when a test asks for it. The plugin itself
    still loads: pytest loads it in every project that has this package installed, async tests or not.
    """
    try:
        import pytest_asyncio
    except ImportError:
        name = function.__name__

        def unavailable() -> None:
            pytest.fail(f"{name} needs pytest-asyncio: pip install 'idempotency-mw[testing]'", pytrace=False)

        unavailable.__doc__ = function.__doc__  # what `pytest --fixtures` shows
        return pytest.fixture(name=name)(unavailable)
    return pytest_asyncio.fixture(function)


@pytest.fixture(scope="session")
def idempotency_database_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a PostgreSQL with the store's tables migrated, for the whole session: $DATABASE_URL if set (in
    asyncpg's spelling), else an embedded server started for the session and removed after it.

    Under pytest-xdist every worker has a database of its own, so that one worker's records, locks and counts never
    meet another's: an embedded server is the worker's own; on $DATABASE_URL's server the worker creates a database
    named after the one in the URL and the worker (``app_test_gw0``), afresh, and drops it after the session."""
    # xdist's own word for "this is a worker" (its PYTEST_XDIST_WORKER variable would reach a pytest run in a child)
    worker = getattr(request.config, "workerinput", {}).get("workerid")
    with local_database() as url, contextlib.ExitStack() as stack:
        if worker and os.environ.get("DATABASE_URL"):
            url = stack.enter_context(_database_of_its_own(url, worker))
        asyncio.run(_migrate(url))
        yield url


@contextlib.contextmanager
def _database_of_its_own(url: str, worker: str) -> Iterator[str]:
    """A database created on ``url``'s server for ``worker`` (one a killed run left behind is dropped first), and
    dropped afterwards."""
    parts = urlsplit(url)
    name = f"{parts.path.lstrip('/') or 'postgres'}_{worker}"
    asyncio.run(_drop(url, name, then_create=True))
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        asyncio.run(_drop(url, name))


async def _drop(url: str, name: str, *, then_create: bool = False) -> None:
    """Drop database ``name`` on ``url``'s server if it is there (its sessions too); create it empty again when
    ``then_create``."""
    quoted = '"' + name.replace('"', '""') + '"'
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
        if then_create:
            await connection.execute(f"CREATE DATABASE {quoted}")
    finally:
        await connection.close()


async def _migrate(url: str) -> None:
    store = PostgresStore(url, min_size=0, max_size=1)  # not opened: open() refuses a database not migrated yet
    try:
        await store.migrate()
    finally:
        await store.close()


@_async_fixture
async def idempotency_store(idempotency_database_url: str) -> AsyncIterator[PostgresStore]:
    """A PostgresStore on idempotency_database_url, opened for the test on its event loop and closed after it
    without the shutdown grace (a claim a test leaves in progress has nothing coming to settle it)."""
    store = PostgresStore(idempotency_database_url)
    await store.open()
    try:
        yield store
    finally:
        # No shutdown grace: a test may leave a claim in progress on purpose, and nothing is coming to settle it.
        await store.close(grace=0)


@contextlib.asynccontextmanager
async def run_lifespan(app: Any) -> AsyncIterator[None]:
    """Run ``app``'s lifespan around the block as a server does: startup before it, shutdown after it, through the
    whole ASGI app (its middleware see both, as under uvicorn). httpx's ``ASGITransport`` sends no lifespan
    events, so an app that opens its store at startup would have none. A startup or shutdown that fails raises
    ``RuntimeError`` with the app's message."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    running = asyncio.create_task(app(scope, inbox.get, outbox.put))
    try:
        await _lifespan_step(running, inbox, outbox, "startup")
        yield
        await _lifespan_step(running, inbox, outbox, "shutdown")
    finally:
        if not running.done():
            running.cancel()
        with contextlib.suppress(BaseException):  # its error, if any, was raised above
            await running


async def _lifespan_step(
    running: asyncio.Task[Any], inbox: asyncio.Queue[dict[str, Any]], outbox: asyncio.Queue[dict[str, Any]], step: str
) -> None:
    """Send ``lifespan.<step>`` and wait for the app's answer; a failure, or an app that ended without answering,
    raises."""
    await inbox.put({"type": f"lifespan.{step}"})
    answer = asyncio.ensure_future(outbox.get())
    await asyncio.wait({answer, running}, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.cancel()
        error = running.exception()
        raise RuntimeError(f"the app's lifespan ended without answering lifespan.{step}: {error!r}") from error
    message = answer.result()
    if message["type"] == f"lifespan.{step}.failed":
        raise RuntimeError(f"the app's lifespan {step} failed: {message.get('message', '')}")
    if message["type"] != f"lifespan.{step}.complete":
        raise RuntimeError(f"the app answered lifespan.{step} with {message['type']}")


@dataclass(frozen=True)
class IdempotencyReport:
    statuses: list[int]
    executed: int  # answers that were not replays or conflicts
    replayed: int
    in_progress: int


async def assert_idempotent(
    client: Any,
    method: str,
    url: str,
    *,
    times: int = 10,
    key: str | None = None,
    **request: Any,
) -> IdempotencyReport:
    """Send the same request ``times`` times at once with one key, then once more after they settle.

    ``client`` is an ``httpx.AsyncClient`` (for example over ``httpx.ASGITransport(app)``). Passes when exactly
    one answer came from running the endpoint (a 409 of its own included), every replay is byte-identical to it, and
    the rest were the middleware's 409s (request in progress).
    """
    key = key or str(uuid.uuid4())
    headers = {**request.pop("headers", {}), "Idempotency-Key": key}

    async def once() -> Any:
        return await client.request(method, url, headers=headers, **request)

    responses = list(await asyncio.gather(*(once() for _ in range(times))))
    responses.append(await once())  # everything has settled: this one must be a replay
    assert not any(_problem_code(r) == "idempotency_tenant_unknown" for r in responses), (
        "the middleware could not tell whose key this is (400 idempotency_tenant_unknown): send the credentials "
        "the app's tenant resolver reads (for the default resolver, one Authorization header)"
    )
    replays = [r for r in responses if "idempotent-replayed" in r.headers]
    # A conflict is the middleware's 409, which says so (Idempotency-Problem), or, where an envelope of the app's own
    # drops that header, a 409 unlike the answer replayed: the endpoint's own final answer may be a 409 too.
    answer = (replays[0].status_code, replays[0].content) if replays else None
    conflicts = [
        r
        for r in responses
        if r not in replays
        and (
            r.headers.get(PROBLEM_HEADER) == ProblemCode.IN_PROGRESS
            or (r.status_code == 409 and PROBLEM_HEADER not in r.headers and (r.status_code, r.content) != answer)
        )
    ]
    originals = [r for r in responses if r not in replays and r not in conflicts]
    assert len(originals) == 1, f"expected the endpoint to answer once, it answered {len(originals)} times"
    first = originals[0]
    for replay in replays:
        assert replay.status_code == first.status_code, "a replay's status differs from the original's"
        assert replay.content == first.content, "a replay's body differs from the original's"
    assert replays, "the final request was not answered with a replay"
    assert "idempotent-replayed" in responses[-1].headers
    return IdempotencyReport([r.status_code for r in responses], len(originals), len(replays), len(conflicts))


def _problem_code(response: Any) -> str | None:
    if response.headers.get("content-type") != "application/problem+json":
        return None
    code = response.json().get("code")
    return code if isinstance(code, str) else None
