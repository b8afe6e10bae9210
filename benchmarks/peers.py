"""The benchmark venv (``benchmarks/.work/venv``, git-ignored): the servers' runtime and the peer libraries.

Nothing of the peers is committed: they are installed from PyPI at run time, pinned to the versions compared in
docs/semantics.md ("Compared with the other Python libraries"). The server stack (Starlette, uvicorn, asyncpg,
orjson, httpx) is pinned to the versions in the project's own venv, so bare, ours and the peers run on identical
code; uvloop and httptools are added (the usual production uvicorn). A peer that fails to install or import is
reported with its error, not hidden. Known pitfalls, handled here: ``fastidempotent[postgres]`` needs
``sqlalchemy[asyncio]`` (greenlet) as well; Tortoise ORM 1.x needs ``Tortoise.init(_enable_global_fallback=True)``
(in ``benchapp.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

from servers import WORK

VENV = WORK / "venv"
PYTHON = VENV / "bin" / "python"
SAME_AS_PROJECT = ("starlette", "uvicorn", "asyncpg", "orjson", "httpx", "psutil")
RUNTIME = ("uvloop", "httptools", "py-spy")
PEERS = {
    "fastidempotent": (["fastidempotent[postgres]==0.1.0", "sqlalchemy[asyncio]"], "fastidempotent.backends.postgres"),
    "fastapi-idempotency": (
        ["fastapi-idempotency==0.1.1", "tortoise-orm[asyncpg]"],
        "fastapi_idempotency.stores.tortoise",
    ),
}


def _pinned(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def _pip(*requirements: str) -> str | None:
    done = subprocess.run(
        [str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        return " / ".join(lines[-3:]) or f"pip exited {done.returncode}"
    return None


def _imports(module: str) -> str | None:
    done = subprocess.run([str(PYTHON), "-c", f"import {module}"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["import failed"])[-1]


def ensure() -> tuple[str, dict[str, str | None], dict[str, str]]:
    """(venv python, {peer: None or why it cannot run}, {package: version}), installing what is missing."""
    core = [*(_pinned(name) for name in SAME_AS_PROJECT), *RUNTIME]
    wanted = {"core": core, "peers": {name: reqs for name, (reqs, _) in PEERS.items()}}
    stamp = VENV / "bench-requirements.json"
    if not PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
    fresh = not stamp.exists() or json.loads(stamp.read_text()) != wanted
    if fresh:
        problem = _pip(*core)
        if problem:
            raise SystemExit(f"could not install the benchmark runtime into {VENV}: {problem}")
    status: dict[str, str | None] = {}
    for name, (requirements, module) in PEERS.items():
        status[name] = (_pip(*requirements) if fresh else None) or _imports(module)
    if fresh:
        stamp.write_text(json.dumps(wanted))
    freeze = subprocess.run(
        [str(PYTHON), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=False,
    )
    versions = {p["name"].lower(): p["version"] for p in json.loads(freeze.stdout or "[]")}
    return str(PYTHON), status, versions
