"""events.py: the event of each keyed request, and the log line of the default hook."""

from __future__ import annotations

import logging

import pytest

from idempotency_mw import MemoryStore
from idempotency_mw.events import Outcome, tenant_tag
from tests.apps import Probe, build_app
from tests.conftest import client_for


async def test_log_lines_tell_the_tenants_of_one_key_apart(caplog: pytest.LogCaptureFixture) -> None:
    """One key used by two accounts runs twice, legitimately: the two log lines must not read like one operation
    executed twice. Each names its tenant by a short tag, never by the tenant itself."""
    app = build_app(MemoryStore(), Probe())
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        for token in ("sk_alice", "sk_bob"):
            answer = await client_for(app, token=token).post("/charge", headers={"Idempotency-Key": "k-1"})
            assert answer.status_code == 201
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("idempotency executed")]
    assert len(lines) == 2
    assert lines[0] != lines[1]
    assert all(" tenant=" in line for line in lines)


def test_a_tenant_tag_is_short_stable_and_not_the_tenant() -> None:
    assert tenant_tag("acct_1") == tenant_tag("acct_1")
    assert tenant_tag("acct_1") != tenant_tag("acct_2")
    assert len(tenant_tag("acct_1")) == 8
    assert "acct" not in tenant_tag("acct_1")
    assert tenant_tag("") == "-"


def test_outcomes_name_themselves() -> None:
    assert Outcome("executed") is Outcome.EXECUTED
