"""OpenTelemetry span attributes with the real ASGI instrumentations, not a hand-made span.

``opentelemetry-instrumentation-asgi`` (on Starlette and FastAPI) and ``opentelemetry-instrumentation-fastapi`` end
the server span when the last body message goes out. The middleware must therefore report every outcome before
that message, or the attributes land on a span that no longer records.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idempotency_mw import IdempotencyMiddleware, PostgresStore, Store
from idempotency_mw.telemetry import SpanAttributes
from tests.apps import Probe, build_app

Instrument = Callable[[Any, TracerProvider], Any]


def asgi_middleware(app: Any, provider: TracerProvider) -> Any:
    return OpenTelemetryMiddleware(app, tracer_provider=provider)


def fastapi_instrumentor(app: Any, provider: TracerProvider) -> Any:
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return app


def fastapi_app(store: Store, probe: Probe, **options: Any) -> FastAPI:
    """The endpoints of tests.apps that the outcomes below need, as FastAPI path operations."""
    app = FastAPI()

    @app.post("/charge")
    async def charge(request: Request) -> Response:
        body = await request.body()
        probe.calls["charge"] += 1
        probe.entered.set()
        await probe.release.wait()
        return JSONResponse({"charge": probe.calls["charge"], "echo": body.decode()}, status_code=201)

    @app.post("/status/{code}")
    async def status(code: int) -> Response:
        return Response(f"status {code}", status_code=code)

    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app


APPS = {
    "starlette+asgi": (build_app, asgi_middleware),
    "fastapi+asgi": (fastapi_app, asgi_middleware),
    "fastapi+instrumentor": (fastapi_app, fastapi_instrumentor),
}


class Traced:
    """An app built with the middleware reporting to ``SpanAttributes``, under a real instrumentation."""

    def __init__(self, kind: str, store: Store, **options: Any) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        build, instrument = APPS[kind]
        self.probe = Probe()
        app = build(store, self.probe, on_event=SpanAttributes(), max_request_bytes=100, **options)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=instrument(app, provider)),
            base_url="http://test",
            headers={"Authorization": "Bearer sk_test_alice"},
        )

    def server_spans(self) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.kind is SpanKind.SERVER]

    def outcomes(self) -> list[str | None]:
        return [(span.attributes or {}).get("idempotency.outcome") for span in self.server_spans()]  # type: ignore[misc]


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


@pytest.mark.parametrize("kind", sorted(APPS))
async def test_every_outcome_reaches_the_server_span(kind: str, store: Store) -> None:
    traced = Traced(kind, store, required=False)
    client = traced.client
    first = key()
    assert (await client.post("/status/201", headers=first)).status_code == 201  # executed
    assert (await client.post("/status/201", headers=first)).headers["idempotent-replayed"] == "true"  # replayed
    assert (await client.post("/status/503", headers=key())).status_code == 503  # released
    reused = key()
    await client.post("/charge", content=b"a", headers=reused)  # executed
    assert (await client.post("/charge", content=b"b", headers=reused)).status_code == 422  # key_reused
    assert (await client.post("/charge", headers={"Idempotency-Key": ""})).status_code == 400  # key_invalid
    assert (await client.post("/charge", content=b"x" * 101, headers=key())).status_code == 413  # too large
    anonymous = {"Idempotency-Key": str(uuid.uuid4()), "Authorization": ""}
    assert (await client.post("/charge", headers=anonymous)).status_code == 400  # tenant_unknown
    running = key()
    traced.probe.hold()
    original = asyncio.create_task(client.post("/charge", content=b"a", headers=running))
    await asyncio.wait_for(traced.probe.entered.wait(), 5)
    assert (await client.post("/charge", content=b"a", headers=running)).status_code == 409  # in_progress
    traced.probe.release.set()
    assert (await original).status_code == 201  # executed
    assert sorted(o for o in traced.outcomes() if o is not None) == sorted(
        [
            "executed",
            "replayed",
            "released",
            "executed",
            "key_reused",
            "key_invalid",
            "request_too_large",
            "tenant_unknown",
            "in_progress",
            "executed",
        ]
    )
    assert None not in traced.outcomes()  # every server span of a keyed request carries its outcome


@pytest.mark.parametrize("kind", sorted(APPS))
async def test_a_required_key_and_a_dead_store_reach_the_server_span(kind: str) -> None:
    dead = PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.3)
    traced = Traced(kind, dead, required=True)
    assert (await traced.client.post("/charge")).status_code == 400  # key_missing
    assert (await traced.client.post("/charge", headers=key())).status_code == 503  # store_error
    assert traced.outcomes() == ["key_missing", "store_error"]


async def test_a_transactional_outcome_reaches_the_server_span(pg_store: PostgresStore) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = FastAPI()

    @app.post("/write", status_code=201)
    async def write(request: Request) -> dict[str, bool]:
        await request.state.idempotency.connection.execute("SELECT 1")
        return {"written": True}

    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True, on_event=SpanAttributes())
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://test",
        headers={"Authorization": "Bearer sk_test_alice"},
    )
    headers = key()
    for _ in range(2):
        assert (await client.post("/write", headers=headers)).status_code == 201
    spans = [span for span in exporter.get_finished_spans() if span.kind is SpanKind.SERVER]
    assert [(span.attributes or {}).get("idempotency.outcome") for span in spans] == ["executed", "replayed"]
