"""The docs cannot drift from the code: every snippet parses, imports what exists and calls with real keywords;
every ``idempotency-mw`` command line parses; every local link leads somewhere; nothing cites a file outside the
repository; the testing guide's examples run as a user's test files. (The README's snippets are run as written by
tests/test_readme_snippets.py.)"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, Policy, PostgresStore, header_tenant
from idempotency_mw.cli import build_parser
from idempotency_mw.client import AsyncIdempotentClient, IdempotentClient, Retry
from idempotency_mw.testing import run_lifespan
from tests.conftest import tenant_of

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "examples" / "README.md"])
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[tuple[str, str]]:
    """``(where, code)`` of every fenced block in the given language ("" for unlabelled)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(2) == language:
                line = text[: match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(match.group(3))))
    return found


PYTHON = blocks("python")


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=[where for where, _ in PYTHON])
def test_python_snippets_parse(where: str, code: str) -> None:
    ast.parse(code, filename=where)


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=[where for where, _ in PYTHON])
def test_python_snippets_import_what_exists(where: str, code: str) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("idempotency_mw"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"


# What a snippet may pass to each of these, by name: their real parameters.
CALLABLES: dict[str, set[str]] = {
    "IdempotencyMiddleware": set(inspect.signature(IdempotencyMiddleware).parameters),
    "PostgresStore": set(inspect.signature(PostgresStore).parameters),
    "idempotent": {field.name for field in dataclasses.fields(Policy) if field.init},
    "Policy": {field.name for field in dataclasses.fields(Policy) if field.init},
    "AuthorizationTenant": set(inspect.signature(AuthorizationTenant).parameters),
    "header_tenant": set(inspect.signature(header_tenant).parameters),
    "Retry": {field.name for field in dataclasses.fields(Retry)},
    "IdempotentClient": set(inspect.signature(IdempotentClient).parameters) | {"auth", "follow_redirects"},
    "AsyncIdempotentClient": set(inspect.signature(AsyncIdempotentClient).parameters) | {"auth", "follow_redirects"},
}


def called(node: ast.Call) -> str | None:
    """The name a call is about: ``f(...)``, ``x.f(...)``, or the class given to ``add_middleware(Class, ...)``."""
    func: Any = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name == "add_middleware" and node.args and isinstance(node.args[0], ast.Name):
        return str(node.args[0].id)
    return name


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=[where for where, _ in PYTHON])
def test_python_snippets_call_with_real_keywords(where: str, code: str) -> None:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and (name := called(node)) in CALLABLES:
            known = CALLABLES[name] | ({"app"} if name == "IdempotencyMiddleware" else set())
            unknown = {k.arg for k in node.keywords if k.arg is not None} - known
            assert not unknown, f"{where}: {name}() has no parameter {sorted(unknown)}"


def command_lines() -> list[tuple[str, list[str]]]:
    """Every ``idempotency-mw`` invocation the docs show (in shell blocks and inline code), as arguments."""
    found = []
    for page in PAGES:
        text = page.read_text()
        candidates = [m.group(1) for m in re.finditer(r"`(idempotency-mw [^`]+)`", text)]
        for match in FENCE.finditer(text):
            if match.group(2) in ("", "sh", "console"):
                candidates += [line.strip() for line in match.group(3).splitlines()]
        for line in candidates:
            line = line.removeprefix("$ ")
            if not line.startswith("idempotency-mw ") or re.search(r"\[|COMMAND|: error:", line):
                continue  # a usage synopsis or an error message, not a command line
            line = line.replace("…", "postgresql://app@db/app")
            found.append((f"{page.relative_to(ROOT)}: {line}", shlex.split(line, comments=True)[1:]))
    return found


COMMANDS = command_lines()


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_command_lines_in_the_docs_parse(where: str, argv: list[str]) -> None:
    if argv == ["--version"]:  # argparse prints it and exits 0 (tests/test_cli.py checks what it prints)
        with pytest.raises(SystemExit, match=r"^0$"):
            build_parser().parse_args(argv)
        return
    build_parser().parse_args(argv)  # argparse exits (SystemExit) on anything it does not accept


def test_the_docs_show_command_lines_at_all() -> None:
    assert len(COMMANDS) >= 20


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(match.group(1)) for match in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_local_links_lead_somewhere(page: Path) -> None:
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to a missing file {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: link to a missing heading {target}"


def test_nothing_cites_files_outside_the_repository() -> None:
    """The design lives in docs/design.md; research notes and articles outside the repository are not cited."""
    tracked = [*PAGES, *ROOT.glob("idempotency_mw/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("faults/*.py")]
    tracked += [*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    pattern = re.compile(r"DESIGN\.md|shared/(research|seeds)|\bpeers\.md|\banchors\.md")
    offenders = [
        str(path.relative_to(ROOT)) for path in tracked if path != Path(__file__) and pattern.search(path.read_text())
    ]
    assert offenders == []


# -- the testing guide's examples, run as a user's project runs them ---------------------------------------------

GUIDE = ROOT / "docs" / "guide.md"

# The app the examples test, as the guide names it: ``myapp.create_app(store=...)`` (a factory), and ``myapp.main``,
# the README's shape: a module-level store built from DATABASE_URL, opened and closed by the app's lifespan.
MYAPP = {
    "myapp/__init__.py": """
from typing import Any

from fastapi import FastAPI
from sqlalchemy import text

from idempotency_mw import IdempotencyMiddleware, idempotent
from idempotency_mw.fastapi import setup
from idempotency_mw.sqlalchemy import IdempotencySession


def create_app(store: Any, **options: Any) -> FastAPI:
    app = FastAPI(**options)
    app.add_middleware(IdempotencyMiddleware, store=store)
    setup(app)
    charges: list[int] = []

    @app.post("/v1/charges", status_code=201)
    async def create_charge(charge: dict[str, int]) -> dict[str, Any]:
        charges.append(charge["amount"])
        return {"id": f"ch_{len(charges)}", **charge}

    @app.post("/v1/transfers", status_code=201)
    @idempotent(transactional=True)
    async def transfer(body: dict[str, int], session: IdempotencySession) -> dict[str, Any]:
        return {"id": (await session.execute(text("SELECT txid_current()"))).scalar_one(), **body}

    return app
""",
    "myapp/main.py": """
import contextlib
import os

from idempotency_mw import PostgresStore
from myapp import create_app

store = PostgresStore(os.environ["DATABASE_URL"])


@contextlib.asynccontextmanager
async def lifespan(app):
    await store.open()
    try:
        yield
    finally:
        await store.close()


app = create_app(store, lifespan=lifespan)
""",
}


def guide_testing_files() -> dict[str, str]:
    """The python blocks of the guide's testing section that open with ``# <file>.py``, by file name."""
    text = GUIDE.read_text()
    section = text[text.index("## 6. Testing your app") :]
    files = {}
    for match in FENCE.finditer(section):
        code = textwrap.dedent(match.group(3))
        first = code.splitlines()[0] if code else ""
        if match.group(2) == "python" and re.fullmatch(r"# [\w/]+\.py", first):
            files[first[2:]] = code
    return files


def guide_pytest_configuration() -> str:
    """The guide's ``# pyproject.toml`` block (its pytest configuration)."""
    (block,) = [code for _, code in blocks("toml") if code.startswith("# pyproject.toml")]
    return block


@pytest.mark.slow
def test_the_testing_guides_examples_run(tmp_path: Path, idempotency_database_url: str) -> None:
    """The guide's tests, its conftest.py and an app of the shape they expect, in a project of their own with the
    guide's pytest configuration (pytest-asyncio's default strict mode), the plugin as installed, deprecation
    warnings as errors. The snippet once used httpx without importing it; the configuration once left out the
    fixtures' loop scope, which pytest-asyncio warns about at every run."""
    files = guide_testing_files()
    assert {"conftest.py", "test_charges.py", "test_lifespan.py", "test_transfers.py"} <= set(files)
    for name, code in {**MYAPP, **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    (tmp_path / "pyproject.toml").write_text(guide_pytest_configuration())  # without it pytest-asyncio warns
    env = {**os.environ, "DATABASE_URL": idempotency_database_url, "PYTHONPATH": str(tmp_path)}
    del env["IDEMPOTENCY_TENANT_SECRET"]  # the guide's conftest.py sets it
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-W", "error::DeprecationWarning"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    tests = sum(code.count("\nasync def test_") + code.count("\ndef test_") for code in files.values())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{tests} passed" in done.stdout, done.stdout


# -- the guide's recipes, run as the apps they are -------------------------------------------------------------


def named_snippets(text: str) -> dict[str, str]:
    """The python blocks of ``text`` that open with ``# <name>.py``, by module name: the ones a test runs."""
    snippets = {}
    for match in FENCE.finditer(text):
        code = textwrap.dedent(match.group(3))
        first = code.splitlines()[0] if code else ""
        if match.group(2) == "python" and re.fullmatch(r"# \w+\.py", first):
            snippets[first[2:-3]] = code
    return snippets


def guide_recipes() -> dict[str, str]:
    """The python blocks of the guide's recipes (each opens with ``# <name>.py``), by module name."""
    text = GUIDE.read_text()
    return named_snippets(text[text.index("## 7. Recipes") :])


def page_snippets() -> dict[str, str]:
    """The named python blocks of every page but the guide's recipes (operations, configuration, ...)."""
    found: dict[str, str] = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page != GUIDE:
            found.update(named_snippets(page.read_text()))
    return found


@contextlib.contextmanager
def recipe(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[Any]:
    """The recipe (or named snippet) ``name`` imported as a module, with ``env`` in its environment."""
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    path = tmp_path / f"{name}.py"
    path.write_text(guide_recipes().get(name) or page_snippets().get(name) or named_snippets(GUIDE.read_text())[name])
    spec = importlib.util.spec_from_file_location(f"guide_recipe_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


@contextlib.asynccontextmanager
async def serving(app: Any, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    async with run_lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
            yield client


def test_the_guide_has_its_recipes() -> None:
    assert set(guide_recipes()) == {"shop", "webhooks", "stamped", "explained", "impatient"}


async def test_recipe_fastapi_sqlalchemy_and_your_own_authentication(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    url = idempotency_database_url.replace("postgresql://", "postgresql+asyncpg://", 1)
    with recipe("shop", tmp_path, monkeypatch, DATABASE_URL=url) as shop:
        async with serving(shop.app) as client:

            async def orders() -> int:
                async with shop.engine.connect() as connection:
                    return int((await connection.exec_driver_sql("SELECT count(*) FROM shop_orders")).scalar_one())

            key = str(uuid.uuid4())
            before = await orders()
            anonymous = await client.post("/v1/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
            assert anonymous.status_code == 401
            assert await shop.store.inspect("acct_alice", key) is None

            alice = {"Idempotency-Key": key, "X-API-Key": "sk_alice"}
            first = await client.post("/v1/orders", json={"amount": 5}, headers=alice)
            assert first.status_code == 201, first.text
            again = await client.post("/v1/orders", json={"amount": 5}, headers=alice)
            assert (again.status_code, again.content) == (201, first.content)
            assert again.headers["idempotent-replayed"] == "true"
            bob = await client.post("/v1/orders", json={"amount": 5}, headers={**alice, "X-API-Key": "sk_bob"})
            assert bob.status_code == 201
            assert bob.json()["id"] != first.json()["id"]
            assert await orders() == before + 2

            keyless = await client.post("/v1/orders", json={"amount": 5}, headers={"X-API-Key": "sk_alice"})
            assert keyless.json()["code"] == "idempotency_key_missing"

            over = {"Idempotency-Key": str(uuid.uuid4()), "X-API-Key": "sk_alice"}
            for _ in range(2):
                refused = await client.post("/v1/orders", json={"amount": 5000}, headers=over)
                assert refused.status_code == 402
            assert refused.headers["idempotent-replayed"] == "true"
            assert await orders() == before + 2

            corrected = {"Idempotency-Key": str(uuid.uuid4()), "X-API-Key": "sk_alice"}
            assert (await client.post("/v1/orders", json={"amount": "x"}, headers=corrected)).status_code == 422
            assert (await client.post("/v1/orders", json={"amount": 7}, headers=corrected)).status_code == 201


async def test_recipe_webhooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str) -> None:
    secret = "whsec_test"
    with recipe(
        "webhooks", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url, WEBHOOK_SECRET=secret
    ) as hooks:
        async with serving(hooks.app) as client:
            event_id = f"evt_{uuid.uuid4().hex}"
            body = json.dumps({"id": event_id, "type": "payment.succeeded"}).encode()
            signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
            forged = await client.post("/webhooks/payments", content=body, headers={"X-Signature": "0" * 64})
            assert forged.status_code == 401
            deliveries = [
                await client.post("/webhooks/payments", content=body, headers={"X-Signature": signature})
                for _ in range(3)
            ]
            assert {d.status_code for d in deliveries} == {200}
            assert deliveries[0].json() == {"received": event_id}
            assert [d.headers.get("idempotent-replayed") for d in deliveries] == [None, "true", "true"]
            assert hooks.handled == [event_id]
            no_id = await client.post("/webhooks/payments", json={"type": "ping"})
            assert no_id.json()["code"] == "idempotency_key_missing"


async def test_recipe_clients_that_stamp_each_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("stamped", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as stamped:
        async with serving(stamped.app, authorization="Bearer sk_test_recipes") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4())}
            first = await client.post(
                "/v1/payments", json={"amount": 5, "sent_at": 1, "client": {"attempt": 1}}, headers=headers
            )
            retry = await client.post(
                "/v1/payments", json={"amount": 5, "sent_at": 2, "client": {"attempt": 2}}, headers=headers
            )
            assert (first.status_code, retry.content) == (201, first.content)
            assert retry.json()["first_sent_at"] == 1
            other = await client.post("/v1/payments", json={"amount": 6, "sent_at": 3}, headers=headers)
            assert other.json()["code"] == "idempotency_key_reused"


async def test_recipe_say_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("explained", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as explained:
        async with serving(explained.app, authorization="Bearer sk_test_recipes") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4())}
            first = await client.post(
                "/v1/charges", json={"amount": 500, "currency": "eur", "sent_at": 1}, headers=headers
            )
            assert first.status_code == 201
            retry = await client.post("/v1/charges", json={"amount": 501, "sent_at": 2}, headers=headers)
            assert retry.status_code == 422
            changed = {"method": False, "path": False, "query": False, "body": True, "fields": ["/amount"]}
            assert retry.json()["changed"] == {**changed, "missing_fields": 1, "compared": "fields"}
            snippet = [code for _, code in PYTHON if "def why_refused" in code]
            namespace: dict[str, Any] = {}
            exec(snippet[0], namespace)  # the guide's client snippet, on the answer it describes
            assert namespace["why_refused"](retry) == "/amount, 1 field(s) no longer sent"
            assert namespace["why_refused"](first) is None
            record = await explained.store.inspect(tenant_of("sk_test_recipes"), headers["Idempotency-Key"])
            assert record is not None
            assert record.parts is not None  # sent_at left out: 2 fields; its derived key's id has 26 characters
            assert len(record.parts) == 51 + (26 - 7) + 2 * 16


async def test_recipe_wait_for_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("impatient", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as impatient:
        async with serving(impatient.app, authorization="Bearer sk_test_recipes") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4())}
            original = asyncio.create_task(client.post("/v1/charges", json={"amount": 5}, headers=headers))
            await asyncio.sleep(0.1)  # the original is running
            retry = await client.post("/v1/charges", json={"amount": 5}, headers=headers)
            assert retry.status_code == 201  # not 409: it waited for the original, and got its answer
            assert retry.headers["idempotent-replayed"] == "true"
            assert retry.content == (await original).content
            assert impatient.replays["/v1/charges"] == 1


async def test_operations_a_pool_made_in_the_lifespan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    """operations.md: a store built without a pool is bound to the one the app makes in its lifespan; each
    lifespan binds its own (a test runs two), and a request before any is answered 503, never run."""
    with recipe("lifespan_pool", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as module:

        async def charge(request: Any) -> Any:
            from starlette.responses import JSONResponse

            count = await request.app.state.pool.fetchval("SELECT 1")
            return JSONResponse({"charged": count}, status_code=201)

        module.app.add_route("/charges", charge, methods=["POST"])
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        transport = httpx.ASGITransport(app=module.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers={"Authorization": "Bearer sk_test_pool"}
        ) as unbound:
            early = await unbound.post("/charges", json={}, headers=headers)
            assert (early.status_code, early.json()["code"]) == (503, "idempotency_store_unavailable")
        for _ in range(2):
            async with serving(module.app, authorization="Bearer sk_test_pool") as client:
                first = await client.post("/charges", json={}, headers=headers)
                again = await client.post("/charges", json={}, headers=headers)
                assert first.status_code == 201  # run in the first lifespan, replayed in the second
                assert again.headers.get("idempotent-replayed") == "true"


async def test_operations_extending_live_records_to_a_raised_ttl(idempotency_database_url: str) -> None:
    """operations.md, "Retention sizing": the statement that gives live records a raised ttl, run as it is on a
    schema of its own (search_path), beside an expired record it must leave to gc."""
    (statement,) = [code for _, code in blocks("sql") if code.startswith("-- extend the live records")]
    schema = f"imw_ttl_{uuid.uuid4().hex[:10]}"
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=1, schema=schema)
    await store.migrate()
    try:
        async with store:
            for key in ("live", "expired"):
                claim = await store.claim("t", key, b"\x00" * 32, lease=5, ttl=60)
                assert claim.fence is not None
            connection = await asyncpg.connect(idempotency_database_url)
            try:
                await connection.execute(
                    f"UPDATE {schema}.idempotency_records SET created_at = now() - interval '2 hours', "
                    "expires_at = now() - interval '1 hour', lease_expires_at = NULL WHERE key = 'expired'"
                )
                await connection.execute(f"SET search_path = {schema}")
                assert await connection.execute(statement) == "UPDATE 1"
                assert await connection.execute(statement) == "UPDATE 0"  # once is enough
            finally:
                await connection.close()
            live = await store.inspect("t", "live")
            assert live is not None
            assert live.expires_at - live.created_at == pytest.approx(48 * 3600, abs=1)
            expired = await store.inspect("t", "expired")
            assert expired is not None
            assert expired.expires_at < time.time()  # still expired: left to gc
    finally:
        admin = await asyncpg.connect(idempotency_database_url)
        try:
            await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        finally:
            await admin.close()
