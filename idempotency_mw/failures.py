"""Store failures in the log: the first one in full, then a summary now and then, until the store answers again.

A database that is down fails every request. One traceback per request would bury the log (200 requests made
12,600 lines) and say nothing new after the first; the metrics already count every failure. So a
:class:`FailureLog` logs the first failure with its traceback and the store's own explanation (unreachable, pool
exhausted: raise ``max_size``, not migrated: run ``idempotency-mw migrate``), then one line per ``interval``
with how many more failed, and one line when the store answers again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable


class FailureLog:
    def __init__(
        self, logger: logging.Logger, *, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._failing_since: float | None = None
        self._summary_due = 0.0
        self._total = 0  # failures since the first one of this outage
        self._recent: Counter[str] = Counter()  # failures since the last line, by what failed and why

    def failed(self, what: str, error: BaseException) -> None:
        """The store failed to ``what`` ("claim a key", "renew a lease", ...) with ``error``."""
        now = self._clock()
        self._total += 1
        if self._failing_since is None:
            self._failing_since, self._summary_due = now, now + self._interval
            self._logger.error(
                "idempotency store failed to %s: %s (further failures are summarised every %gs until it recovers)",
                what,
                _explain(error),
                self._interval,
                exc_info=error,
            )
            return
        self._recent[f"{what}: {_explain(error)}"] += 1
        if now >= self._summary_due:
            self._summary_due = now + self._interval
            recent, self._recent = self._recent, Counter()
            self._logger.warning(
                "idempotency store still failing after %.1fs: %d more failure(s) in the last %gs (%s)",
                now - self._failing_since,
                sum(recent.values()),
                self._interval,
                "; ".join(f"{count} x {kind}" for kind, count in recent.most_common(3)),
            )

    def succeeded(self) -> None:
        """A store call went through: if the store was failing, say it recovered."""
        if self._failing_since is None:
            return
        self._logger.warning(
            "idempotency store answers again after %.1fs and %d failure(s)",
            self._clock() - self._failing_since,
            self._total,
        )
        self._failing_since, self._total, self._recent = None, 0, Counter()


def _explain(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
