"""``python -m idempotency_mw.demo``: the same as ``idempotency-mw demo``."""

from idempotency_mw.demo.run import main

raise SystemExit(main())
