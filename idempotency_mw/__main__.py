"""``python -m idempotency_mw``: the ``idempotency-mw`` command line, for where the console script is not on PATH."""

import sys

from idempotency_mw.cli import main

sys.exit(main())
