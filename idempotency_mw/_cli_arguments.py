"""The command line's argument types: each turns text into a value, or into argparse's usage error saying why."""

from __future__ import annotations

import argparse
import datetime
import math
import re
import time
from collections.abc import Callable
from typing import Any

from idempotency_mw.postgres._sql import check_schema


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return at_least(kind, zero=False)


def non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return at_least(kind, zero=True)


def at_least(kind: Callable[[str], Any], *, zero: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not math.isfinite(value):  # float("nan") passes every comparison below, and inf waits for ever
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must {'not be negative' if zero else 'be positive'}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def schema_name(text: str) -> str:
    try:
        return check_schema(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_FIRST = datetime.datetime.min.replace(tzinfo=datetime.UTC).timestamp()  # the times a listing can show, in UTC
_LAST = datetime.datetime.max.replace(tzinfo=datetime.UTC).timestamp()


def moment(text: str) -> float:
    """A time as epoch seconds: ISO 8601 (``2026-11-28T06:00:00Z``; without a zone, UTC) or an age (``90s``, ``30m``,
    ``2h``, ``7d``: that long before now); between the years 1 and 9999 in UTC, which the listing shows."""
    ago = _AGO.fullmatch(text.strip())
    if ago is not None:
        seconds = time.time() - float(ago[1]) * _UNIT_SECONDS[ago[2]]
    else:
        try:
            when = datetime.datetime.fromisoformat(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an ISO 8601 time (2026-11-28T06:00:00Z) or an age (90s, 30m, 2h, 7d), got {text!r}"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp()
    if not _FIRST <= seconds <= _LAST:
        raise argparse.ArgumentTypeError(f"{text!r} is outside the years 1 to 9999 (UTC)")
    return seconds


def utf8_text(text: str) -> str:
    """Text the database can be sent: Python keeps an argument's bytes that are not UTF-8 as surrogates
    (surrogateescape), which asyncpg refuses, and that is bad input, not a database error."""
    try:
        text.encode()
    except UnicodeEncodeError:
        try:
            given = text.encode(errors="surrogateescape")  # the bytes as typed
        except UnicodeEncodeError:  # a lone surrogate that no command line decoded (a caller of main())
            given = text.encode(errors="backslashreplace")
        raise argparse.ArgumentTypeError(f"must be UTF-8 text, got the bytes {given!r}") from None
    return text


def tenant_tag_text(text: str) -> str:
    """A tenant's tag as the log lines show it: 8 hex digits."""
    if not re.fullmatch(r"[0-9a-f]{8}", text):
        raise argparse.ArgumentTypeError(f"a tenant tag is 8 hex digits, as the log lines show it; got {text!r}")
    return text
