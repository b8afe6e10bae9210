"""SQL kept in ``.sql`` files and loaded by name, so every statement the store runs can be read in one place."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def queries() -> dict[str, str]:
    """``queries.sql`` split on its ``-- name: x`` lines."""
    text = resources.files(__package__).joinpath("queries.sql").read_text()
    parts = _NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def migrations() -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` for every file in ``migrations/``, in order."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)
