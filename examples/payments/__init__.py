"""The payments example: a Stripe-style API whose every write runs in transactional mode.

- ``app``: the FastAPI app (``uvicorn examples.payments.app:app`` with ``DATABASE_URL`` set) and ``create_app``;
- ``wire``, ``objects``, ``ledger``: Stripe's v1 wire conventions, the API objects, the ledger in PostgreSQL
  (``schema.sql``).
"""
