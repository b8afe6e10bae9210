"""Idempotency-Key middleware for Starlette and FastAPI, with records in PostgreSQL.

from idempotency_mw import IdempotencyMiddleware, PostgresStore

app.add_middleware(IdempotencyMiddleware, store=PostgresStore("postgresql://…"))

The package's public faces are the names below and the modules without a leading underscore: ``fastapi``,
``sqlalchemy``, ``client``, ``testing``, ``metrics``, ``telemetry``, ``encryption``, ``cutover``, ``postgres``,
``store`` (the store contract), ``cli`` and ``devdb``. Everything else (``_middleware`` and the rest) may change in
any release.
"""

from idempotency_mw._context import IdempotencyContext, claim, idempotency_context, mark_not_executed
from idempotency_mw._events import Event, Outcome, log_event
from idempotency_mw._fingerprint import FingerprintKeys
from idempotency_mw._keys import AuthorizationTenant, CookieTenant, header_tenant, legacy_sha256_fallback
from idempotency_mw._memory import MemoryStore
from idempotency_mw._middleware import IdempotencyMiddleware
from idempotency_mw._policy import Policy, idempotent
from idempotency_mw._problems import Problem
from idempotency_mw._status import key_status_route
from idempotency_mw._wire import ProblemCode
from idempotency_mw.postgres import PostgresStore
from idempotency_mw.store import Store, StoredResponse, StoreUnavailable

__version__ = "0.2.0"

__all__ = [
    "AuthorizationTenant",
    "CookieTenant",
    "Event",
    "FingerprintKeys",
    "IdempotencyContext",
    "IdempotencyMiddleware",
    "MemoryStore",
    "Outcome",
    "Policy",
    "PostgresStore",
    "Problem",
    "ProblemCode",
    "Store",
    "StoreUnavailable",
    "StoredResponse",
    "claim",
    "header_tenant",
    "idempotency_context",
    "idempotent",
    "key_status_route",
    "legacy_sha256_fallback",
    "log_event",
    "mark_not_executed",
]
