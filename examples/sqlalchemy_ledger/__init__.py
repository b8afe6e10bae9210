"""A small ledger written with SQLAlchemy models: accounts, and transfers between them that are idempotent and
transactional through ``IdempotencySession``.

- ``models``: the ORM models (``Account``, ``Transfer``) in the ``sqlalchemy_ledger`` schema;
- ``app``: the FastAPI app (``uvicorn examples.sqlalchemy_ledger.app:app`` with ``DATABASE_URL`` set) and
  ``create_app``.
"""

from examples.dependencies import EXAMPLE, require

SQLALCHEMY = (("sqlalchemy", "sqlalchemy"), ("greenlet", "greenlet"))

require((*EXAMPLE, *SQLALCHEMY), what="the SQLAlchemy ledger example", extra="example,sqlalchemy")
