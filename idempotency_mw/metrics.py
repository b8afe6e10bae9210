"""Prometheus metrics for the middleware (the ``metrics`` extra): pass one instance as its ``on_event`` hook.

    metrics = PrometheusMetrics()
    app.add_middleware(IdempotencyMiddleware, store=store, on_event=metrics)
    app.routes.append(metrics_route())

``metrics_route()`` serves this process's metrics or, under prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set: gunicorn, ``uvicorn --workers``), every worker's; ``refresh_from_store(...,
lock=path)`` keeps the table's gauges to one scan per period however many workers run it.

Requests are labelled by route *template* (``/v1/charges/{id}``, ``Event.route``), never by raw path: a label per
resource id, or per path a scanner invents, would grow without bound. The middleware finds the template by
matching the request against the app's own route table (Mounts and FastAPI routers included), the same way for
every outcome (a replay or a 409 never reaches the router), whether it was added with ``add_middleware`` or wraps
the app directly. Requests no route matches, and every request of an app without a route table, share the label
``<unmatched>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any, Protocol

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app, multiprocess
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "idempotency_mw.metrics needs prometheus-client: pip install 'idempotency-mw[metrics]'"
    ) from error
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idempotency_mw._events import Event, Outcome
from idempotency_mw._policy import UNMATCHED
from idempotency_mw.store import StoreUnavailable

__all__ = ["UNMATCHED", "PrometheusMetrics", "StatsSource", "metrics_route"]

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

# Time spent waiting on the store: a claim, then a complete or release; one to a few round trips.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ATTEMPT_BUCKETS = (0, 1, 2, 3, 5, 10, 25, 100)
# Whole requests: a replay takes about a store round trip, an execution whatever the handler takes.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

logger = logging.getLogger("idempotency_mw")


class StatsSource(Protocol):
    """A store that can summarise its table (:meth:`idempotency_mw.PostgresStore.stats`)."""

    async def stats(self) -> Mapping[str, Any]: ...


class PrometheusMetrics:
    """An ``on_event`` hook that counts outcomes and times requests, plus gauges of the store's table.

    ``registry``: where the metrics live (default: prometheus_client's global registry, which
    :func:`metrics_route` serves). ``prefix`` starts every metric name. ``route_label(event)`` replaces the
    default route label (``event.route``: the matched template, or ``<unmatched>``): return a small, fixed set of
    values.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        prefix: str = "idempotency",
        route_label: Callable[[Event], str] | None = None,
        store_buckets: Iterable[float] = STORE_BUCKETS,
        duration_buckets: Iterable[float] = DURATION_BUCKETS,
    ) -> None:
        registry = REGISTRY if registry is None else registry
        self.route_label = route_label
        self.requests = Counter(
            f"{prefix}_requests",
            "Requests with an Idempotency-Key (or missing a required one), by route and outcome.",
            ["method", "route", "outcome"],
            registry=registry,
        )
        self.request_duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "Time from the middleware receiving a keyed request to its end, handler included.",
            ["method", "route", "outcome"],
            buckets=tuple(duration_buckets),
            registry=registry,
        )
        self.store_duration = Histogram(
            f"{prefix}_store_duration_seconds",
            "Time one request spent waiting on the store (claim, then complete or release).",
            ["outcome"],
            buckets=tuple(store_buckets),
            registry=registry,
        )
        self.key_attempts = Histogram(
            f"{prefix}_key_attempts",
            "Earlier requests the key had already seen when this one reached the store, by route and outcome: "
            "replays with many attempts show a retry layer (or several) re-sending more than it should.",
            ["method", "route", "outcome"],
            buckets=ATTEMPT_BUCKETS,
            registry=registry,
        )
        self.resumed = Counter(
            f"{prefix}_resumed_requests",
            "Requests whose handler runs in steps that resumed after an earlier attempt's last recovery point, by "
            "route and that step.",
            ["method", "route", "step"],
            registry=registry,
        )
        self.observed_requests = Counter(
            f"{prefix}_observed_requests",
            "Requests on routes that only observe (observe=True), by route and what enforcing would have done: each "
            "ran and was answered as without the middleware, and none is counted in the other request metrics.",
            ["method", "route", "outcome"],
            registry=registry,
        )
        self.in_flight = Gauge(
            f"{prefix}_in_flight",
            "Keyed requests that reached the store and have not finished.",
            registry=registry,
            multiprocess_mode="livesum",  # under prometheus_client's multiprocess mode: summed over live workers
        )
        self.records = Gauge(
            f"{prefix}_records",
            "Records in the store by state (expired: awaiting gc). Updated by update_from_store().",
            ["state"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.records_past_lease = Gauge(
            f"{prefix}_records_past_lease",
            "In-progress records whose lease lapsed: their worker died or stalled. Updated by update_from_store().",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.oldest_in_progress = Gauge(
            f"{prefix}_oldest_in_progress_seconds",
            "Age of the oldest live in-progress record (0 when there is none). Updated by update_from_store().",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.record_attempts = Gauge(
            f"{prefix}_record_attempts",
            "Claims after the first, summed over the stored records: retries that found a record. "
            "Updated by update_from_store().",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.stalled = Gauge(
            f"{prefix}_stalled_requests",
            "Requests stopped at a recovery point (a step committed, then the attempt failed) whose lease lapsed and "
            "that no retry has resumed: finish them (idempotency-mw stalled). Updated by update_from_store().",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.store_up = Gauge(
            f"{prefix}_store_up",
            "1 when the last update_from_store() read the store's stats, 0 when the store could not be reached "
            "(the table gauges then keep their last values).",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.stats_updated = Gauge(
            f"{prefix}_stats_updated_timestamp_seconds",
            "Unix time of the last update_from_store() that read the store's stats: alert when it falls behind.",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self._seen_routes: set[tuple[str, str]] = set()  # bounded: methods the middleware covers x routes
        self._seen_observed: set[tuple[str, str]] = set()  # the same, of observed requests

    def started(self, scope: Scope) -> None:
        """Called by the middleware when a request reaches the store."""
        self.in_flight.inc()

    def __call__(self, event: Event) -> None:
        """Called by the middleware when a keyed request ends."""
        if event.reached_store:
            self.in_flight.dec()
        route = self.route_label(event) if self.route_label is not None else event.route
        outcome = event.outcome.value
        if event.observed:
            return self._observed(event.method, route, outcome)
        if (event.method, route) not in self._seen_routes:
            # Every outcome of a route starts at 0, so `increase(...) > 0` alerts fire on the first fenced-out.
            self._seen_routes.add((event.method, route))
            for each in Outcome:
                self.requests.labels(event.method, route, each.value)
        self.requests.labels(event.method, route, outcome).inc()
        if event.resumed_from is not None:
            self.resumed.labels(event.method, route, event.resumed_from).inc()
        self.request_duration.labels(event.method, route, outcome).observe(event.duration)
        if event.reached_store:  # earlier refusals spent no store time and saw no attempts
            self.store_duration.labels(outcome).observe(event.store_seconds)
            self.key_attempts.labels(event.method, route, outcome).observe(event.attempts)

    def _observed(self, method: str, route: str, outcome: str) -> None:
        """An observed request: what enforcing would have done, counted apart, so that a dashboard of what the
        middleware did never counts a would-be replay (or 409, or 422) as one."""
        if (method, route) not in self._seen_observed:
            self._seen_observed.add((method, route))  # every outcome at 0, as for enforced requests
            for each in Outcome:
                self.observed_requests.labels(method, route, each.value)
        self.observed_requests.labels(method, route, outcome).inc()

    async def update_from_store(self, store: StatsSource) -> None:
        """Refresh the record gauges from ``store.stats()`` (one scan of the table: call it every minute or so,
        from one process, not per request). A store without ``stats()`` is a ``TypeError`` that says which have
        it: a loop that keeps calling this must not fail the same way unseen."""
        if not callable(getattr(store, "stats", None)):
            raise TypeError(
                f"update_from_store needs a store that can summarise its table (a PostgresStore or SQLAlchemyStore), "
                f"not {type(store).__name__}"
            )
        try:
            stats = await store.stats()
        except StoreUnavailable:
            self.store_up.set(0)
            raise
        for state in ("in_progress", "completed", "expired"):
            self.records.labels(state).set(stats[state])
        self.records_past_lease.set(stats["past_lease"])
        self.oldest_in_progress.set(stats["oldest_in_progress_seconds"] or 0.0)
        self.record_attempts.set(stats["attempts"])
        self.stalled.set(stats.get("stalled", 0))  # a store of another kind may keep no recovery points
        self.store_up.set(1)
        self.stats_updated.set(time.time())

    async def refresh_from_store(
        self, store: StatsSource, *, every: float = 60.0, lock: str | os.PathLike[str] | None = None
    ) -> None:
        """Run :meth:`update_from_store` every ``every`` seconds until cancelled: start it as a task from the
        lifespan. A store that cannot be reached is logged as a warning, in one line; any other error (a bug, a
        store without ``stats()``) with its traceback, each time, so that gauges that stopped moving always say why.
        The loop goes on after both.

        ``lock``: a file that the workers of one host share (in ``PROMETHEUS_MULTIPROC_DIR``, say). Only the process
        holding an exclusive lock on it refreshes; the others try to take it each period, so one that exits (or is
        killed: the kernel releases its lock) is replaced within a period, and N workers scan the table once per
        period, not N times."""
        held: IO[bytes] | None = None
        try:
            while True:
                if lock is None or held is not None or (held := _try_lock(lock)) is not None:
                    try:
                        await self.update_from_store(store)
                    except StoreUnavailable as error:
                        logger.warning("idempotency: the metrics could not read the store's stats: %s", error)
                    except Exception:
                        logger.exception("idempotency: refreshing the metrics from the store failed")
                await asyncio.sleep(every)
        finally:
            if held is not None:
                held.close()  # releases the lock: another worker takes over within a period


def _try_lock(path: str | os.PathLike[str]) -> IO[bytes] | None:
    """The file at ``path``, opened and exclusively locked by this process; None when another holds it."""
    import fcntl  # POSIX: the lock is for workers of one host (gunicorn, uvicorn --workers)

    file = open(path, "ab")  # noqa: SIM115 - held open for as long as the lock is
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    return file


class _MetricsApp:
    """prometheus_client's ASGI exposition as an object, so that a ``Route`` serves it at the path itself (a plain
    function would be taken for a request handler, and ``mount("/metrics", ...)`` answers ``/metrics`` with a 307
    to ``/metrics/``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._app = make_asgi_app(registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


def metrics_route(path: str = "/metrics", registry: CollectorRegistry | None = None) -> Route:
    """The metrics endpoint as a route: ``app.routes.append(metrics_route())``, or in ``routes=[...]``.

    Serves ``registry`` (default: the global one); under prometheus_client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set, as gunicorn or ``uvicorn --workers`` need), with no registry given, every
    worker's metrics combined, whichever worker the scrape reaches."""
    if registry is None and os.environ.get(MULTIPROCESS_VARIABLE):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return Route(path, _MetricsApp(REGISTRY if registry is None else registry), methods=["GET"])
