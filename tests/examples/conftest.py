"""Fixtures for the examples' tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest


def with_database(url: str, database: str) -> str:
    """The same server and credentials, another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


@pytest.fixture
async def fresh_database_url(idempotency_database_url: str) -> AsyncIterator[str]:
    """An empty database of its own on the suite's server (dropped afterwards): nothing migrated, no schema."""
    name = f"imw_example_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield with_database(idempotency_database_url, name)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
