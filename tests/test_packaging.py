"""What ``pip install idempotency-mw`` gets: the wheel built from this repository holds the library alone."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel, built the way a release would build it (hatchling, from the checkout)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."],
        cwd=REPOSITORY,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("idempotency_mw-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def outside_the_library(names: list[str]) -> list[str]:
    """Files of a wheel that are neither the ``idempotency_mw`` package nor the wheel's own metadata."""
    return [
        name
        for name in names
        if not name.startswith("idempotency_mw/")
        and not (name.startswith("idempotency_mw-") and name.split("/")[0].endswith(".dist-info"))
    ]


@pytest.mark.slow
def test_the_wheel_holds_the_library_alone(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert outside_the_library(names) == []
    assert not [name for name in names if name.startswith("idempotency_mw/demo")]
    assert {
        "idempotency_mw/py.typed",
        "idempotency_mw/postgres/sql/queries.sql",
        "idempotency_mw/postgres/sql/session.sql",
        "idempotency_mw/postgres/sql/migrations/0001_initial.sql",
        "idempotency_mw/postgres/sql/migrations/0002_responses.sql",
        "idempotency_mw/postgres/sql/migrations/0003_request_line.sql",
        "idempotency_mw/postgres/sql/migrations/0005_recovery_points.sql",
        "idempotency_mw/postgres/sql/migrations/0004_request_parts.sql",
        "idempotency_mw/postgres/sql/migrations/0006_response_life.sql",
        "idempotency_mw/postgres/sql/migrations/0007_replays.sql",
        "idempotency_mw/postgres/sql/contract/0008_no_foreign_keys.sql",
    } <= set(names)


@pytest.mark.slow
def test_the_wheel_declares_the_command_line_and_the_pytest_plugin(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "idempotency-mw = idempotency_mw.cli:main" in text
    assert "idempotency_mw = idempotency_mw.testing" in text


@pytest.mark.slow
def test_the_wheel_names_the_python_versions_it_supports(wheel: zipfile.ZipFile) -> None:
    """Trove classifiers for each Python version from ``requires-python``'s up to the newest the suite runs on, so an
    index and a dependency bot show what is supported."""
    (metadata,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    versions = re.findall(r"^Classifier: Programming Language :: Python :: (3\.\d+)$", text, re.MULTILINE)
    assert versions == ["3.11", "3.12", "3.13"]
    assert "Requires-Python: >=3.11" in text
    assert "Classifier: Typing :: Typed" in text  # py.typed ships in the wheel


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0] for requirement in requirements]


def test_the_readme_lists_every_library_extra_with_what_it_brings() -> None:
    """The Install table in README.md cannot drift from pyproject.toml."""
    extras = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (REPOSITORY / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Use it")]
    documented = {
        match["extra"]: match["brings"].split(", ")
        for match in re.finditer(r"^\| `(?P<extra>[a-z]+)` \| (?P<brings>[^|]+?) \|", install, re.MULTILINE)
    }
    repository_only = {"example", "demo", "dev"}
    assert set(documented) == set(extras) - repository_only
    for extra, brings in documented.items():
        assert brings == _names(extras[extra]), extra
    assert "idempotency-mw migrate --database-url" in install
