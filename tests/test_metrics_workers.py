"""Metrics under several workers (gunicorn, ``uvicorn --workers``): every worker's counters in one scrape, the
table's gauges refreshed by one worker at a time, and ``/metrics`` served at its own path."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette

from faults.server import ServerProcess
from idempotency_mw import PostgresStore
from idempotency_mw.metrics import metrics_route
from tests.apps import Registry
from tests.test_cli import Database, db, empty_db  # noqa: F401  (fixtures: a store of our own)
from tests.test_docs import page_snippets

# -- /metrics at its own path ---------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", [Starlette, FastAPI])
async def test_metrics_are_served_at_metrics_not_redirected(framework: type[Starlette]) -> None:
    """The documented ``app.mount("/metrics", make_asgi_app())`` answered ``/metrics`` with a 307 to
    ``/metrics/``: a probe or a scraper that does not follow redirects saw no metrics."""
    m = Registry()
    app = framework()
    app.routes.append(metrics_route(registry=m.registry))
    m.metrics.in_flight.set(3)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        answer = await client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    assert "idempotency_in_flight 3.0" in answer.text


# -- the table's gauges: up, fresh, and refreshed by one worker -------------------------------------------------


async def test_store_up_and_last_refresh_say_when_the_table_gauges_froze(db: Database) -> None:  # noqa: F811
    """During an outage the table gauges keep their last values: ``store_up`` drops to 0 and the refresh time
    stops, so a dashboard can tell a frozen number from a quiet table."""
    m = Registry()
    store = PostgresStore(db.url, min_size=1, max_size=1, schema=db.schema)
    await store.open()
    await m.metrics.update_from_store(store)
    assert m.value("idempotency_store_up") == 1
    refreshed = m.value("idempotency_stats_updated_timestamp_seconds")
    assert refreshed is not None
    assert abs(refreshed - time.time()) < 60
    await store.close()  # a closed store answers as an unreachable one would
    with pytest.raises(Exception, match="clos"):
        await m.metrics.update_from_store(store)
    assert m.value("idempotency_store_up") == 0
    assert m.value("idempotency_stats_updated_timestamp_seconds") == refreshed
    assert m.value("idempotency_records", {"state": "completed"}) == 0  # kept, not reset


class Counted:
    """A real store whose stats() calls are counted."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.calls = 0

    async def stats(self) -> Any:
        self.calls += 1
        return await self.store.stats()


async def test_one_worker_refreshes_the_gauges_and_another_takes_over(
    db: Database,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two workers refreshing with one lock file: one scans the table, the other waits; when the first stops,
    the second takes over within a period."""
    lock = tmp_path / "idempotency-refresh.lock"
    async with PostgresStore(db.url, min_size=1, max_size=2, schema=db.schema) as store:
        first, second = Counted(store), Counted(store)
        one = asyncio.create_task(Registry().metrics.refresh_from_store(first, every=0.02, lock=lock))
        await asyncio.sleep(0.01)
        other = asyncio.create_task(Registry().metrics.refresh_from_store(second, every=0.02, lock=lock))
        for _ in range(200):
            if first.calls >= 5:
                break
            await asyncio.sleep(0.02)
        assert first.calls >= 5
        assert second.calls == 0
        one.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await one
        for _ in range(200):
            if second.calls >= 2:
                break
            await asyncio.sleep(0.02)
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other
    assert second.calls >= 2


# -- every worker's counters in one scrape ----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_scrape_of_any_worker_counts_every_workers_requests(
    tmp_path: Path, idempotency_database_url: str
) -> None:
    """docs/operations.md's multi-worker app, served by two worker processes on one PROMETHEUS_MULTIPROC_DIR (as
    gunicorn or ``uvicorn --workers`` run it): a scrape reaches one worker, and counts the requests of both."""
    shared = tmp_path / "multiproc"
    shared.mkdir()
    (tmp_path / "metrics_workers.py").write_text(page_snippets()["metrics_workers"])
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(shared),
        "DATABASE_URL": idempotency_database_url,
        "PYTHONPATH": str(tmp_path),
    }
    async with (
        ServerProcess("metrics_workers:app", env=env) as first,
        ServerProcess("metrics_workers:app", env=env) as second,
        httpx.AsyncClient(timeout=30, headers={"Authorization": "Bearer sk_test_workers"}) as client,
    ):
        for server, requests in ((first, 3), (second, 2)):
            for _ in range(requests):
                answer = await client.post(
                    server.base_url + "/v1/charges", headers={"Idempotency-Key": uuid.uuid4().hex}
                )
                assert answer.status_code == 201
        scrapes = [(await client.get(server.base_url + "/metrics")).text for server in (first, second)]
    for scrape in scrapes:
        assert 'idempotency_requests_total{method="POST",outcome="executed",route="/v1/charges"} 5.0' in scrape
        assert "idempotency_store_up 1.0" in scrape  # refreshed by whichever worker holds the lock
    assert (shared / "idempotency-refresh.lock").exists()
