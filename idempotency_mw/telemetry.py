"""Event hooks beyond metrics: OpenTelemetry span attributes, and :func:`hooks` to run several hooks at once.

The middleware takes one ``on_event`` hook; ``hooks(metrics, SpanAttributes(), log_event)`` makes one of many.
Only :class:`SpanAttributes` needs OpenTelemetry (``pip install 'idempotency-mw[otel]'``).
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope

from idempotency_mw._events import Event, EventHook, Outcome, hash_key, logger


class Hooks:
    """Several ``on_event`` hooks as one: each is called in order, and one failing does not silence the rest.

    ``started(scope)`` is forwarded to the hooks that have it (the Prometheus in-flight gauge needs it).
    """

    def __init__(self, *hooks: EventHook) -> None:
        self.hooks = hooks
        self._starters = [start for start in (getattr(hook, "started", None) for hook in hooks) if start is not None]

    def started(self, scope: Scope) -> None:
        for start in self._starters:
            try:
                start(scope)
            except Exception:
                logger.exception("idempotency hook %r failed in started()", start)

    def __call__(self, event: Event) -> None:
        for hook in self.hooks:
            try:
                hook(event)
            except Exception:
                logger.exception("idempotency on_event hook %r failed", hook)


def hooks(*hooks: EventHook) -> Hooks:
    """``on_event=hooks(metrics, SpanAttributes(), log_event)``: keep the default log line alongside others."""
    return Hooks(*hooks)


class SpanAttributes:
    """An ``on_event`` hook that annotates the current OpenTelemetry span (the server span, when an ASGI
    instrumentation wraps the app) with what the middleware did. Never the key itself, nor the tenant: hashes.

    Attributes: ``idempotency.outcome``, ``idempotency.replayed``, ``idempotency.key_hash``,
    ``idempotency.tenant_hash`` (absent for the tenant ``""``), ``idempotency.store_seconds``; and
    ``idempotency.observed`` (true) on a route that only observes, whose outcome is what enforcing would have done
    (``idempotency.replayed`` is false there: nothing was replayed).
    """

    def __init__(self) -> None:
        try:
            from opentelemetry import trace
        except ImportError as error:
            raise ImportError(
                "idempotency_mw.telemetry.SpanAttributes needs opentelemetry-api: pip install 'idempotency-mw[otel]'"
            ) from error
        self._current_span = trace.get_current_span

    def __call__(self, event: Event) -> None:
        span = self._current_span()
        if not span.is_recording():
            return
        attributes: dict[str, Any] = {
            "idempotency.outcome": event.outcome.value,
            "idempotency.replayed": event.outcome is Outcome.REPLAYED and not event.observed,
            "idempotency.store_seconds": event.store_seconds,
        }
        if event.observed:
            attributes["idempotency.observed"] = True
        if event.key_hash:
            attributes["idempotency.key_hash"] = event.key_hash
        if event.tenant:
            attributes["idempotency.tenant_hash"] = hash_key(event.tenant)
        span.set_attributes(attributes)
