"""A small Starlette app with one endpoint per behaviour the middleware must keep intact, and what tests watch it
with: a probe that counts and holds handler runs, a background task held on cue, a metrics registry per test."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, Store
from idempotency_mw.metrics import PrometheusMetrics


class Probe:
    """Counts handler runs and lets a test hold a handler mid-flight."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.release.set()

    def hold(self) -> None:
        self.release.clear()
        self.entered.clear()


def build_app(store: Store, probe: Probe, **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        body = await request.body()
        probe.calls["charge"] += 1
        probe.entered.set()
        await probe.release.wait()
        return JSONResponse({"charge": probe.calls["charge"], "echo": body.decode()}, status_code=201)

    async def status(request: Request) -> Response:
        probe.calls["status"] += 1
        code = int(request.path_params["code"])
        return Response(f"status {code} run {probe.calls['status']}", status_code=code)

    async def boom(request: Request) -> Response:
        probe.calls["boom"] += 1
        if probe.calls["boom"] == 1:
            raise RuntimeError("the handler failed")
        return JSONResponse({"ok": True}, status_code=201)

    async def stream(request: Request) -> Response:
        probe.calls["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for part in (b"first,", b"second,", b"third"):
                yield part

        return StreamingResponse(chunks(), media_type="text/csv", headers={"x-run": str(probe.calls["stream"])})

    async def binary(request: Request) -> Response:
        probe.calls["binary"] += 1
        return Response(
            bytes(range(256)) * 4 + probe.calls["binary"].to_bytes(2, "big"), media_type="application/octet-stream"
        )

    async def raw_json(request: Request) -> Response:
        probe.calls["raw_json"] += 1
        body = b'{ "b" : 1,\n  "a":[1, 2.50],  "run": %d }' % probe.calls["raw_json"]
        return Response(body, status_code=201, media_type="application/json")

    async def cookies(request: Request) -> Response:
        probe.calls["cookies"] += 1
        response = Response("ok", headers={"x-first": "1"})
        response.raw_headers.append((b"set-cookie", b"a=1; Path=/"))
        response.raw_headers.append((b"x-between", b"2"))
        response.raw_headers.append((b"set-cookie", b"b=2; Path=/"))
        return response

    async def big(request: Request) -> Response:
        probe.calls["big"] += 1
        size = int(request.query_params["size"])
        return Response(b"x" * size, media_type="application/octet-stream")

    async def read_only(request: Request) -> Response:
        probe.calls["get"] += 1
        return JSONResponse({"run": probe.calls["get"]})

    routes = [
        Route("/charge", charge, methods=["POST", "PATCH", "PUT"]),
        Route("/status/{code:int}", status, methods=["POST"]),
        Route("/boom", boom, methods=["POST"]),
        Route("/stream", stream, methods=["POST"]),
        Route("/binary", binary, methods=["POST"]),
        Route("/raw-json", raw_json, methods=["POST"]),
        Route("/cookies", cookies, methods=["POST"]),
        Route("/big", big, methods=["POST"]),
        Route("/read", read_only, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app


class Background:
    """A background task the test holds until it lets it go, optionally failing."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.go = asyncio.Event()
        self.fail = False

    async def __call__(self) -> None:
        self.started.set()
        await self.go.wait()
        if self.fail:
            raise RuntimeError("the background task failed")


class Registry:
    """A fresh registry per test, read back by metric name and labels."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = PrometheusMetrics(self.registry)

    def count(self, route: str, outcome: str, method: str = "POST") -> float | None:
        labels = {"method": method, "route": route, "outcome": outcome}
        return self.registry.get_sample_value("idempotency_requests_total", labels)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def routes(self) -> set[str]:
        """Every route label of every metric."""
        return {
            sample.labels["route"]
            for metric in self.registry.collect()
            for sample in metric.samples
            if "route" in sample.labels
        }
