"""A pytest plugin for apps that use idempotency_mw (installed with the package, loaded by pytest itself).

It needs the ``testing`` extra (``pip install 'idempotency-mw[testing]'``: pytest, pytest-asyncio, and an embedded
PostgreSQL for when ``DATABASE_URL`` is not set).

Fixtures:

- ``idempotency_database_url``: a migrated PostgreSQL for the test session (``DATABASE_URL``, else embedded).
- ``idempotency_store``: a :class:`~idempotency_mw.PostgresStore` on it, closed after each test (at once: without
  the grace ``close()`` gives claims still being settled at a server's shutdown). It is an async
  fixture declared with pytest-asyncio's own decorator, so it works in pytest-asyncio's default strict mode (mark
  the test ``@pytest.mark.asyncio``) as well as in auto mode.

Helper: :func:`assert_idempotent` fires one request many times, concurrently, and checks that the endpoint ran
once and every answer was the first response or a 409 in-progress.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

try:
    import pytest
except ImportError as error:
    raise ImportError("idempotency_mw.testing needs pytest: pip install 'idempotency-mw[testing]'") from error

from idempotency_mw.devdb import local_database
from idempotency_mw.postgres import PostgresStore


def _async_fixture(function: Callable[..., Any]) -> Any:
    """pytest-asyncio's fixture decorator, which works in its strict mode (the default) and in auto mode.

    Without pytest-asyncio the fixture fails with the install line when a test asks for it. The plugin itself
    still loads: pytest loads it in every project that has this package installed, async tests or not.
    """
    try:
        import pytest_asyncio
    except ImportError:
        name = function.__name__

        @pytest.fixture(name=name)
        def unavailable() -> None:
            pytest.fail(f"{name} needs pytest-asyncio: pip install 'idempotency-mw[testing]'", pytrace=False)

        return unavailable
    return pytest_asyncio.fixture(function)


@pytest.fixture(scope="session")
def idempotency_database_url() -> Iterator[str]:
    with local_database() as url:
        asyncio.run(_migrate(url))
        yield url


async def _migrate(url: str) -> None:
    store = PostgresStore(url, min_size=0, max_size=1)  # not opened: open() refuses a database not migrated yet
    try:
        await store.migrate()
    finally:
        await store.close()


@_async_fixture
async def idempotency_store(idempotency_database_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(idempotency_database_url)
    await store.open()
    try:
        yield store
    finally:
        # No shutdown grace: a test may leave a claim in progress on purpose, and nothing is coming to settle it.
        await store.close(grace=0)


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
    one answer came from running the endpoint, every replay is byte-identical to it, and the rest were 409s.
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
    originals = [r for r in responses if r.status_code != 409 and "idempotent-replayed" not in r.headers]
    replays = [r for r in responses if "idempotent-replayed" in r.headers]
    conflicts = [r for r in responses if r.status_code == 409 and "idempotent-replayed" not in r.headers]
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
