"""Idempotency-Key middleware for Starlette and FastAPI, with records in PostgreSQL.

from idempotency_mw import IdempotencyMiddleware, PostgresStore

app.add_middleware(IdempotencyMiddleware, store=PostgresStore("postgresql://…"))
"""

from idempotency_mw.context import IdempotencyContext, idempotency_context
from idempotency_mw.events import Event, Outcome
from idempotency_mw.memory import MemoryStore
from idempotency_mw.middleware import IdempotencyMiddleware
from idempotency_mw.policy import Policy, idempotent
from idempotency_mw.postgres import PostgresStore
from idempotency_mw.store import Store, StoredResponse, StoreUnavailable
from idempotency_mw.tenants import AuthorizationTenant, header_tenant

__version__ = "0.2.0"

__all__ = [
    "AuthorizationTenant",
    "Event",
    "IdempotencyContext",
    "IdempotencyMiddleware",
    "MemoryStore",
    "Outcome",
    "Policy",
    "PostgresStore",
    "Store",
    "StoreUnavailable",
    "StoredResponse",
    "header_tenant",
    "idempotency_context",
    "idempotent",
]
