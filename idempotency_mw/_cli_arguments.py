"""The command line's argument types: each turns text into a value, or into argparse's usage error saying why."""

from __future__ import annotations

import argparse
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
