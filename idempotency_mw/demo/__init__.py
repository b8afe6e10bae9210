"""The payments demo: a Stripe-style API in transactional mode, a lossy proxy, and a driver that retries through it.

- ``payments``: the FastAPI app (``uvicorn idempotency_mw.demo.payments:app`` with ``DATABASE_URL`` set);
- ``wire``, ``objects``, ``ledger``: Stripe's v1 wire conventions, the API objects, the ledger in PostgreSQL;
- ``proxy``: a loopback TCP proxy that loses responses and resets connections on purpose;
- ``server``: serve an ASGI app on loopback (in this process or in a child process) and stop it again;
- ``run``: ``idempotency-mw demo``, which puts all of that together and checks that nothing ran twice.
"""
