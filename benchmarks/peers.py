"""The benchmark venvs (``benchmarks/.work``, git-ignored): the servers' runtime and the peer libraries, and the same
runtime on Python 3.12 or later for target 14.1 with eager tasks.

Nothing of the peers is committed: they are installed from PyPI at run time, pinned to the versions compared in
docs/semantics.md ("Compared with the other Python libraries"). The server stack (Starlette, uvicorn, asyncpg,
orjson, httpx) is pinned to the versions in the project's own venv, so bare, ours and the peers run on identical
code; uvloop and httptools are added (the usual production uvicorn). A peer that fails to install or import is
reported with its error, not hidden. Known pitfalls, handled here: ``fastidempotent[postgres]`` needs
``sqlalchemy[asyncio]`` (greenlet) as well; Tortoise ORM 1.x needs ``Tortoise.init(_enable_global_fallback=True)``
(in ``benchapp.py``).

Target 14.1 is measured on a second interpreter as well, Python 3.12 or later, where asyncio starts a task eagerly
and the middleware's two tasks per fresh request cost no turn of the event loop (``idempotency_mw/_claim.py``). Its
venv (``venv-eager``) has the same packages at the same versions, and no peers. The interpreter is
``$BENCH_EAGER_PYTHON``, or else the first ``python3.12`` or ``python3.13`` that runs, on the PATH or under pyenv;
without one, the run says so and measures the benchmark's own interpreter alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from servers import WORK

VENV = WORK / "venv"
PYTHON = VENV / "bin" / "python"
SAME_AS_PROJECT = ("starlette", "uvicorn", "asyncpg", "orjson", "httpx", "psutil")
RUNTIME = ("uvloop", "httptools", "py-spy")
EAGER_VENV = WORK / "venv-eager"
EAGER_VARIABLE = "BENCH_EAGER_PYTHON"
EAGER_SINCE = (3, 12)  # asyncio.Task(..., eager_start=True)
EAGER_MINORS = (12, 13)  # the releases searched for, in this order
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


def _pip(*requirements: str, python: Path = PYTHON) -> str | None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
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


@dataclass(frozen=True)
class EagerVenv:
    """The benchmark runtime on Python 3.12 or later, for target 14.1 with eager tasks, or why there is none."""

    python: str | None  # the venv's interpreter; None when there is none
    version: str = ""  # its Python version
    missing: str = ""  # why there is none


def ensure_eager(versions: dict[str, str]) -> EagerVenv:
    """The eager venv, made or brought up to date: the project's pins of the server stack, and the main benchmark
    venv's ``versions`` of uvloop, httptools and py-spy, so both interpreters run the same packages."""
    interpreter, found = _eager_interpreter()
    if interpreter is None:
        return EagerVenv(None, missing=found)
    python = EAGER_VENV / "bin" / "python"
    core = [
        *(_pinned(name) for name in SAME_AS_PROJECT),
        *(f"{name}=={versions[name]}" if name in versions else name for name in RUNTIME),
    ]
    wanted = {"interpreter": interpreter, "version": found, "core": core}
    stamp = EAGER_VENV / "bench-requirements.json"
    if not python.exists() or not stamp.exists() or json.loads(stamp.read_text()) != wanted:
        made = subprocess.run(
            [interpreter, "-m", "venv", "--clear", str(EAGER_VENV)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines() or [f"exit status {made.returncode}"])[-1]
            return EagerVenv(None, missing=f"could not make a venv with {interpreter} (Python {found}): {why}")
        problem = _pip(*core, python=python)
        if problem:
            return EagerVenv(None, missing=f"could not install the benchmark runtime for Python {found}: {problem}")
        stamp.write_text(json.dumps(wanted))
    return EagerVenv(str(python), version=found)


def _eager_interpreter() -> tuple[str, str] | tuple[None, str]:
    """(interpreter, its version) for the eager venv, or (None, why there is none)."""
    named = os.environ.get(EAGER_VARIABLE)
    for candidate in [named] if named else _eager_candidates():
        found = _version_of(candidate)
        if found is not None and found >= EAGER_SINCE:
            return candidate, ".".join(map(str, found))
    if named:
        return None, f"{EAGER_VARIABLE}={named} is not a Python 3.12 or later that runs"
    return None, f"no Python {' or '.join(f'3.{minor}' for minor in EAGER_MINORS)} found (set {EAGER_VARIABLE} to one)"


def _eager_candidates() -> list[str]:
    """``python3.12`` and ``python3.13`` on the PATH, then pyenv's builds of them: 3.12 first, the newest patch
    release first, and only default builds (a free-threaded ``3.13.0t`` would measure another interpreter)."""
    on_path = [path for minor in EAGER_MINORS if (path := shutil.which(f"python3.{minor}"))]
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    builds: list[str] = []
    for minor in EAGER_MINORS:
        found = [build for build in versions.glob(f"3.{minor}.*") if re.fullmatch(r"3\.\d+\.\d+", build.name)]
        found.sort(key=lambda build: int(build.name.rsplit(".", 1)[1]), reverse=True)
        builds += [str(build / "bin" / "python3") for build in found]
    return [*on_path, *builds]


def _version_of(python: str) -> tuple[int, ...] | None:
    """The version of an interpreter that runs (a pyenv shim of a version that is not selected does not)."""
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    try:
        return tuple(int(part) for part in lines[-1].split())
    except ValueError:
        return None
