"""Modules that were importable before the package's internals became private: each still answers for the names it
had, with a ``DeprecationWarning`` that says where they live now (the package root, or a public module)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old: str, private: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: a name of ``homes`` comes from the public module it names, with a
    warning that says so; any other name of the private module ``private`` it moved to comes with a warning that it
    is no longer public."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        source = home or private
        try:
            value = getattr(importlib.import_module(source), name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
        where = f"import it from {home}" if home else "it is an internal of the package now, not part of its API"
        warnings.warn(f"{old}.{name} moved: {where}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
