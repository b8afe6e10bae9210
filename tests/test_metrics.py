"""Observability: the Prometheus hook, OpenTelemetry span attributes and the hook combinator, driven through the
real middleware on a Starlette (or FastAPI) app."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import sys
import uuid
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from idempotency_mw import Event, MemoryStore, Outcome, PostgresStore, StoreUnavailable
from idempotency_mw._events import hash_key, log_event, tenant_tag
from idempotency_mw.metrics import PrometheusMetrics
from idempotency_mw.telemetry import SpanAttributes, hooks
from tests.apps import Probe, Registry, build_app
from tests.conftest import client_for, tenant_of
from tests.test_cli import Database, db, empty_db, seed_table  # noqa: F401  (fixtures: a store of our own)


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


async def test_outcomes_are_counted_by_route_template() -> None:
    m = Registry()
    probe = Probe()
    client = client_for(build_app(MemoryStore(), probe, on_event=m.metrics, max_request_bytes=100))
    first = key()
    assert (await client.post("/status/201", headers=first)).status_code == 201
    assert (await client.post("/status/201", headers=first)).headers["idempotent-replayed"] == "true"
    assert (await client.post("/status/202", headers=key())).status_code == 202  # another id, the same route
    assert (await client.post("/status/503", headers=key())).status_code == 503  # transient: released
    assert (await client.post("/status/201", headers={"Idempotency-Key": ""})).status_code == 400
    assert (await client.post("/status/201", content=b"x" * 101, headers=key())).status_code == 413
    reused = key()
    await client.post("/charge", content=b"a", headers=reused)
    assert (await client.post("/charge", content=b"b", headers=reused)).status_code == 422

    assert m.count("/status/{code}", "executed") == 2
    assert m.count("/status/{code}", "replayed") == 1
    assert m.count("/status/{code}", "released") == 1
    assert m.count("/status/{code}", "key_invalid") == 1
    assert m.count("/status/{code}", "request_too_large") == 1
    assert m.count("/charge", "executed") == 1
    assert m.count("/charge", "key_reused") == 1
    # Every outcome of a seen route exists from the start, at 0 (so an alert on its increase can fire).
    for outcome in Outcome:
        assert m.count("/status/{code}", outcome.value) is not None
    assert m.count("/status/{code}", "fenced_out") == 0
    assert m.value("idempotency_in_flight") == 0
    # The store was reached by 6 of the 8 keyed requests (not the invalid key, not the oversized body).
    assert m.value("idempotency_store_duration_seconds_count", {"outcome": "executed"}) == 3
    assert m.value("idempotency_store_duration_seconds_count", {"outcome": "key_invalid"}) is None
    durations = m.value(
        "idempotency_request_duration_seconds_count",
        {"method": "POST", "route": "/status/{code}", "outcome": "replayed"},
    )
    assert durations == 1


async def test_in_flight_gauge_follows_requests_and_returns_to_zero() -> None:
    m = Registry()
    probe = Probe()
    client = client_for(build_app(MemoryStore(), probe, on_event=m.metrics))
    probe.hold()
    held_key = key()
    held = [asyncio.create_task(client.post("/charge", content=b"a", headers=held_key))]
    await asyncio.wait_for(probe.entered.wait(), 5)
    assert m.value("idempotency_in_flight") == 1
    conflict = await client.post("/charge", content=b"a", headers=held_key)
    assert conflict.status_code == 409
    assert m.count("/charge", "in_progress") == 1
    assert m.value("idempotency_in_flight") == 1  # the 409 came and went; the held request is still running
    held.append(asyncio.create_task(client.post("/charge", content=b"b", headers=key())))
    for _ in range(200):  # bounded: wait for the second request to reach the handler
        if m.value("idempotency_in_flight") == 2:
            break
        await asyncio.sleep(0.01)
    assert m.value("idempotency_in_flight") == 2
    probe.release.set()
    await asyncio.gather(*held)
    assert m.value("idempotency_in_flight") == 0
    assert m.count("/charge", "executed") == 2


class BrokenStore(MemoryStore):
    """A store that is down: every claim fails the way PostgresStore does when the server is gone."""

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")


async def test_store_errors_are_counted_and_leave_nothing_in_flight(caplog: pytest.LogCaptureFixture) -> None:
    m = Registry()
    client = client_for(build_app(BrokenStore(), Probe(), on_event=m.metrics))
    with caplog.at_level(logging.CRITICAL, logger="idempotency_mw"):  # the middleware logs the failure: expected
        for _ in range(3):
            assert (await client.post("/charge", headers=key())).status_code == 503
    assert m.count("/charge", "store_error") == 3
    assert m.value("idempotency_store_duration_seconds_count", {"outcome": "store_error"}) == 3
    assert m.value("idempotency_in_flight") == 0


class MisconfiguredStore(MemoryStore):
    """A store set up wrong: every claim says so (as SQLAlchemyStore does for an engine in AUTOCOMMIT)."""

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("the engine is in AUTOCOMMIT")


async def test_a_store_set_up_wrong_is_counted_and_leaves_nothing_in_flight() -> None:
    """Its error goes on as itself (500), not as an outage; the request is reported as a store error all the same,
    so the in-flight gauge comes down (it stayed up by one per request, and nothing counted them)."""
    m = Registry()
    client = client_for(build_app(MisconfiguredStore(), Probe(), on_event=m.metrics))
    for _ in range(3):
        with pytest.raises(ValueError, match="AUTOCOMMIT"):
            await client.post("/charge", headers=key())
    assert m.count("/charge", "store_error") == 3
    assert m.value("idempotency_in_flight") == 0


async def test_attempts_per_key_are_observed_by_route_and_outcome() -> None:
    m = Registry()
    client = client_for(build_app(MemoryStore(), Probe(), on_event=m.metrics))
    same = key()
    assert (await client.post("/status/201", headers=same)).status_code == 201
    for n in range(3):  # a different request each time: 422s that saw 1, 2 and 3 earlier requests
        assert (await client.post("/status/201", headers=same, content=f"other {n}")).status_code == 422
    for _ in range(2):  # replays, which read the count (3) without adding to it
        assert (await client.post("/status/201", headers=same)).status_code == 201
    reused = {"method": "POST", "route": "/status/{code}", "outcome": "key_reused"}
    replayed = {"method": "POST", "route": "/status/{code}", "outcome": "replayed"}
    executed = {"method": "POST", "route": "/status/{code}", "outcome": "executed"}
    assert m.value("idempotency_key_attempts_count", reused) == 3
    assert m.value("idempotency_key_attempts_sum", reused) == 1 + 2 + 3
    assert m.value("idempotency_key_attempts_bucket", {**reused, "le": "1.0"}) == 1
    assert m.value("idempotency_key_attempts_count", replayed) == 2
    assert m.value("idempotency_key_attempts_sum", replayed) == 3 + 3
    assert m.value("idempotency_key_attempts_sum", executed) == 0


async def test_custom_route_label() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry, prefix="payments_idem", route_label=lambda event: event.path.split("/")[1])
    client = client_for(build_app(MemoryStore(), Probe(), on_event=metrics))
    await client.post("/status/201", headers=key())
    labels = {"method": "POST", "route": "status", "outcome": "executed"}
    assert registry.get_sample_value("payments_idem_requests_total", labels) == 1


async def test_store_gauges_come_from_the_store_stats(db: Database) -> None:  # noqa: F811
    await asyncio.to_thread(seed_table, db)
    m = Registry()
    async with PostgresStore(db.url, min_size=1, max_size=1, schema=db.schema) as store:
        await m.metrics.update_from_store(store)
    assert m.value("idempotency_records", {"state": "in_progress"}) == 2
    assert m.value("idempotency_records", {"state": "completed"}) == 2
    assert m.value("idempotency_records", {"state": "expired"}) == 25
    assert m.value("idempotency_records_past_lease") == 1
    assert m.value("idempotency_record_attempts") == 3
    oldest = m.value("idempotency_oldest_in_progress_seconds")
    assert oldest is not None
    assert 3600 <= oldest < 3660


class Flaky:
    """A store whose stats() fails: first as a database would, then as a bug would."""

    def __init__(self) -> None:
        self.calls = 0

    async def stats(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            raise StoreUnavailable("connection refused")
        if self.calls == 2:
            raise KeyError("in_progress")
        return {
            "in_progress": 1,
            "completed": 2,
            "expired": 3,
            "past_lease": 0,
            "oldest_in_progress_seconds": None,
            "attempts": 4,
        }


async def test_the_refresh_loop_logs_what_fails_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """The documented loop suppressed every exception: with a store that had no stats() the gauges never moved and
    nothing said why. A database blip is a warning, anything else an error with its traceback; the loop goes on."""
    m = Registry()
    store = Flaky()
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        refresh = asyncio.create_task(m.metrics.refresh_from_store(store, every=0.01))
        for _ in range(500):
            if store.calls >= 3:
                break
            await asyncio.sleep(0.01)
        refresh.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresh
    assert m.value("idempotency_records", {"state": "completed"}) == 2
    failures = [record for record in caplog.records if record.name == "idempotency_mw"]
    assert [record.levelno for record in failures[:2]] == [logging.WARNING, logging.ERROR]
    assert "connection refused" in failures[0].getMessage()
    assert failures[0].exc_info is None  # a blip: one line
    assert failures[1].exc_info is not None  # a bug: its traceback


async def test_updating_from_a_store_without_stats_says_which_stores_have_them() -> None:
    with pytest.raises(TypeError, match="PostgresStore or SQLAlchemyStore"):
        await Registry().metrics.update_from_store(MemoryStore())  # type: ignore[arg-type]


def test_importing_without_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # None in sys.modules: "not installed"
    monkeypatch.delitem(sys.modules, "idempotency_mw.metrics")
    with pytest.raises(ImportError, match=r"pip install 'idempotency-mw\[metrics\]'"):
        importlib.import_module("idempotency_mw.metrics")


# -- OpenTelemetry and the combinator ---------------------------------------------------------------------------


async def test_span_attributes_on_the_current_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    m = Registry()
    client = client_for(build_app(MemoryStore(), Probe(), on_event=hooks(m.metrics, SpanAttributes())))
    headers = {"Idempotency-Key": "order-17"}
    for name in ("first", "retry"):
        with tracer.start_as_current_span(name):  # stands in for the server span of an ASGI instrumentation
            await client.post("/status/201", headers=headers)
    first, retry = (span.attributes or {} for span in exporter.get_finished_spans())
    tenant_hash = hash_key(tenant_of())
    assert first["idempotency.outcome"] == "executed"
    assert first["idempotency.replayed"] is False
    assert retry["idempotency.outcome"] == "replayed"
    assert retry["idempotency.replayed"] is True
    assert first["idempotency.key_hash"] == retry["idempotency.key_hash"] == hash_key("order-17")
    assert first["idempotency.tenant_hash"] == retry["idempotency.tenant_hash"] == tenant_hash
    assert all("order-17" not in str(value) for value in first.values())
    assert m.count("/status/{code}", "replayed") == 1  # the metrics hook ran alongside
    assert m.value("idempotency_in_flight") == 0  # started() was forwarded through the combinator


def test_span_attributes_without_opentelemetry_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ImportError, match=r"pip install 'idempotency-mw\[otel\]'"):
        SpanAttributes()


async def test_a_failing_hook_does_not_silence_the_others(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("hook bug")

    client = client_for(build_app(MemoryStore(), Probe(), on_event=hooks(broken, seen.append, log_event)))
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        await client.post("/status/201", headers={"Idempotency-Key": "k-1"})
    assert [event.outcome for event in seen] == [Outcome.EXECUTED]
    messages = [record.getMessage() for record in caplog.records]
    assert any("on_event hook" in message and "broken" in message for message in messages)
    logged = [m for m in messages if m.startswith("idempotency executed")]
    assert len(logged) == 1
    assert f"POST /status/201 tenant={tenant_tag(tenant_of())} key={hash_key('k-1')} status=201" in logged[0]
    assert "k-1 " not in logged[0]
