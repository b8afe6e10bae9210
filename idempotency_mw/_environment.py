"""Settings an operator may give in the environment instead of in code, so that a deploy tunes them without a
release (and the command line reads what the app reads). An argument given in code always wins."""

from __future__ import annotations

import math
import os

TTL = "IDEMPOTENCY_TTL"  # the middleware's ttl, in seconds
LEASE = "IDEMPOTENCY_LEASE"  # the middleware's lease, in seconds
SCHEMA = "IDEMPOTENCY_SCHEMA"  # the PostgreSQL store's schema, and the command line's --schema
STORE_TIMEOUT = "IDEMPOTENCY_STORE_TIMEOUT"  # the PostgreSQL store's timeout, and the command line's --timeout


def seconds(variable: str, given: float | None, default: float) -> float:
    """``given`` if not None, else the environment's ``variable`` (a positive number of seconds), else ``default``.
    A value that is not one is a ValueError naming the variable, at startup."""
    if given is not None:
        return given
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{variable}={text!r}: expected a positive number of seconds")
    return value


def text(variable: str, given: str | None, default: str) -> str:
    """``given`` if not None, else the environment's ``variable`` if set and not blank, else ``default``."""
    if given is not None:
        return given
    return os.environ.get(variable, "").strip() or default
