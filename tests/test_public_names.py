"""The names users import: every one the docs show exists where they say, from a public module, without a warning;
and every one 0.2's docs showed still works from where they put it. A name whose module became private in 0.3
comes with a DeprecationWarning that says where it lives now (CHANGELOG.md lists them)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "examples" / "README.md"])
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)

# What 0.2's README and docs told users to import (its code blocks and inline code), and its package root.
DOCUMENTED_IN_0_2 = [
    ("idempotency_mw", "IdempotencyMiddleware"),
    ("idempotency_mw", "PostgresStore"),
    ("idempotency_mw", "MemoryStore"),
    ("idempotency_mw", "Policy"),
    ("idempotency_mw", "idempotent"),
    ("idempotency_mw", "Event"),
    ("idempotency_mw", "Outcome"),
    ("idempotency_mw", "AuthorizationTenant"),
    ("idempotency_mw", "header_tenant"),
    ("idempotency_mw", "IdempotencyContext"),
    ("idempotency_mw", "idempotency_context"),
    ("idempotency_mw", "Store"),
    ("idempotency_mw", "StoredResponse"),
    ("idempotency_mw", "StoreUnavailable"),
    ("idempotency_mw.context", "mark_not_executed"),
    ("idempotency_mw.context", "idempotency_context"),
    ("idempotency_mw.context", "claim"),
    ("idempotency_mw.events", "log_event"),
    ("idempotency_mw.events", "Event"),
    ("idempotency_mw.tenants", "legacy_sha256_fallback"),
    ("idempotency_mw.tenants", "AuthorizationTenant"),
    ("idempotency_mw.tenants", "header_tenant"),
    ("idempotency_mw.urls", "postgres_url"),
    ("idempotency_mw.keys", "parse_key"),
    ("idempotency_mw.client", "AsyncIdempotentClient"),
    ("idempotency_mw.client", "IdempotentClient"),
    ("idempotency_mw.client", "Retry"),
    ("idempotency_mw.encryption", "ResponseCipher"),
    ("idempotency_mw.fastapi", "IdempotencyConnection"),
    ("idempotency_mw.fastapi", "TenantDependency"),
    ("idempotency_mw.fastapi", "setup"),
    ("idempotency_mw.metrics", "PrometheusMetrics"),
    ("idempotency_mw.sqlalchemy", "IdempotencySession"),
    ("idempotency_mw.sqlalchemy", "SQLAlchemyStore"),
    ("idempotency_mw.telemetry", "SpanAttributes"),
    ("idempotency_mw.testing", "assert_idempotent"),
    ("idempotency_mw.testing", "run_lifespan"),
    ("idempotency_mw.store", "Store"),
    ("idempotency_mw.cli", "main"),
]
# 0.2's public modules that became private, and where their documented names live now.
MOVED = {
    "idempotency_mw.context": "idempotency_mw",
    "idempotency_mw.events": "idempotency_mw",
    "idempotency_mw.tenants": "idempotency_mw",
    "idempotency_mw.urls": "idempotency_mw.postgres",
}
MOVED_OUT = {"idempotency_mw.keys"}  # its documented name is internal now: it still imports, with a warning
OPTIONAL = {"idempotency_mw.encryption": "cryptography", "idempotency_mw.metrics": "prometheus_client"}


def _import(module: str, name: str) -> tuple[object, list[warnings.WarningMessage]]:
    pytest.importorskip(OPTIONAL.get(module, "idempotency_mw"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(module), name)
    return value, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("module", "name"), DOCUMENTED_IN_0_2, ids=[f"{m}.{n}" for m, n in DOCUMENTED_IN_0_2])
def test_what_0_2_documented_still_imports(module: str, name: str) -> None:
    value, deprecations = _import(module, name)
    if module in MOVED:
        home = MOVED[module]
        assert [str(w.message) for w in deprecations] == [f"{module}.{name} moved: import it from {home}"]
        assert value is getattr(importlib.import_module(home), name)
    elif module in MOVED_OUT:
        assert len(deprecations) == 1
        assert "internal of the package" in str(deprecations[0].message)
    else:
        assert deprecations == []


def documented_now() -> list[tuple[str, str]]:
    """``(module, name)`` of every import the README and the docs show: in Python code blocks, and in inline code
    (``from idempotency_mw.x import Y``, or a dotted ``idempotency_mw.x.Y``)."""
    found: set[tuple[str, str]] = set()
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(2) != "python":
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(match.group(3)))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("idempotency_mw"):
                    found.update((node.module, alias.name) for alias in node.names)
        for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", text)):
            imported = re.fullmatch(r"from (idempotency_mw[\w.]*) import ([\w, ]+)", span.strip())
            if imported:
                found.update((imported.group(1), name.strip()) for name in imported.group(2).split(","))
            for dotted in re.findall(r"\bidempotency_mw(?:\.\w+)+", span):
                module, _, name = dotted.rpartition(".")
                if not _is_module(dotted):
                    found.add((module, name))
    return sorted(found)


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # a name in a module, not a module
        return False


DOCUMENTED = documented_now()


def test_the_docs_show_imports_at_all() -> None:
    assert len(DOCUMENTED) > 20


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_what_the_docs_show_imports_from_a_public_module_without_a_warning(module: str, name: str) -> None:
    assert not any(part.startswith("_") for part in module.split(".")), f"{module} is private"
    _, deprecations = _import(module, name)
    assert deprecations == [], f"{module}.{name}: the docs show the old home"


@pytest.mark.parametrize("module", ["idempotency_mw", "idempotency_mw.cli", "idempotency_mw.devdb"])
def test_the_documented_modules_run(module: str) -> None:
    """``python -m idempotency_mw`` (and ``.cli``) is the command line; ``.devdb`` serves a PostgreSQL."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
