"""Programs that use idempotency_mw: not part of the installed package (the wheel holds ``idempotency_mw`` alone).

- ``payments``: a Stripe-style payments API in transactional mode (``uvicorn examples.payments.app:app``);
- ``demo``: drives that API through a lossy network with a retrying client and audits the ledger
  (``./dev demo``, or ``python -m examples.demo`` from the repository root).
"""
