"""The payments example: a Stripe-style API whose every write runs in transactional mode.

- ``app``: the FastAPI app (``uvicorn examples.payments.app:app`` with ``DATABASE_URL`` set) and ``create_app``;
- ``wire``, ``objects``, ``ledger``: Stripe's v1 wire conventions, the API objects, the ledger in PostgreSQL
  (``schema.sql``);
- ``edge``: ``Request-Id``, the ``Idempotency-Key`` echo, and the middleware's own answers as Stripe gives them;
- ``expansion``, ``lists``: ``expand[]`` and Stripe's paged lists.

Importing the package checks that everything the app needs is installed (``examples.dependencies``): without
python-multipart, say, it would start and then answer every write with a 500.
"""

from examples.dependencies import EXAMPLE, require

require(EXAMPLE, what="the payments example", extra="example")
