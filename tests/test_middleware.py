"""The conformance suite: docs/design.md §2-5, run against every store (``store`` is parametrised)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Scope

from idempotency_mw import (
    Event,
    IdempotencyMiddleware,
    MemoryStore,
    Outcome,
    PostgresStore,
    Store,
    StoredResponse,
    header_tenant,
    idempotency_context,
)
from idempotency_mw.store import StoreNotGranted, StoreNotMigrated, StoreUnavailable
from tests.apps import Probe, build_app
from tests.calls import keyed_scope, raw_call
from tests.conftest import client_for, tenant_of


def setup(store: Store, **options: Any) -> tuple[Probe, httpx.AsyncClient]:
    probe = Probe()
    return probe, client_for(build_app(store, probe, **options))


def problem(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert set(body) == {"type", "title", "status", "detail", "code"}
    assert body["status"] == response.status_code
    return body


async def test_a_keyed_request_no_route_takes_gets_the_routers_answer(store: Store, key: str) -> None:
    """Nothing would run for a request the app's router answers with 404 or 405 (a path no route has, a method the
    path's routes lack): nothing is claimed or compared, whatever its key, and the router answers as it would to
    the same request without one."""
    probe, client = setup(store, methods=("POST", "PATCH", "PUT"))
    assert (await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})).status_code == 201
    for method, path, status in (("PATCH", "/read", 405), ("POST", "/nowhere", 404), ("PUT", "/status/201", 405)):
        for sent in (key, "not a key", None):
            headers = {"Idempotency-Key": sent} if sent is not None else {}
            answer = await client.request(method, path, headers=headers)
            assert answer.status_code == status, (method, path, sent, answer.text)
            assert answer.headers.get("content-type") != "application/problem+json"
    assert probe.calls["charge"] == 1


# -- the happy path ----------------------------------------------------------------------------------------


async def test_first_request_runs_and_retry_replays(store: Store, key: str) -> None:
    probe, client = setup(store)
    first = await client.post("/charge", content=b'{"amount": 10}', headers={"Idempotency-Key": key})
    second = await client.post("/charge", content=b'{"amount": 10}', headers={"Idempotency-Key": key})
    assert first.status_code == second.status_code == 201
    assert probe.calls["charge"] == 1
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert list(second.headers.items())[:-1] == list(first.headers.items())


async def test_requests_without_key_pass_through_untouched(store: Store) -> None:
    probe, client = setup(store)
    for _ in range(2):
        response = await client.post("/charge", content=b"x")
        assert response.status_code == 201
        assert "idempotent-replayed" not in response.headers
    assert probe.calls["charge"] == 2


async def test_uncovered_methods_ignore_the_header(store: Store, key: str) -> None:
    probe, client = setup(store)
    for _ in range(2):
        assert (await client.get("/read", headers={"Idempotency-Key": key})).status_code == 200
        assert (await client.put("/charge", content=b"x", headers={"Idempotency-Key": key})).status_code == 201
    assert probe.calls["get"] == 2
    assert probe.calls["charge"] == 2


async def test_patch_is_covered(store: Store, key: str) -> None:
    probe, client = setup(store)
    for _ in range(2):
        await client.patch("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert probe.calls["charge"] == 1


async def test_required_key_missing_is_400(store: Store) -> None:
    probe, client = setup(store, required=True)
    response = await client.post("/charge", content=b"x")
    assert response.status_code == 400
    assert problem(response)["code"] == "idempotency_key_missing"
    assert probe.calls["charge"] == 0


# -- concurrency -------------------------------------------------------------------------------------------


async def test_fifty_concurrent_identical_requests_run_the_handler_once(store: Store, key: str) -> None:
    probe, client = setup(store)
    probe.hold()

    async def send() -> httpx.Response:
        return await client.post("/charge", json={"amount": 5}, headers={"Idempotency-Key": key})

    tasks = [asyncio.create_task(send()) for _ in range(50)]
    await asyncio.wait_for(probe.entered.wait(), 10)
    await asyncio.sleep(0.05)
    probe.release.set()
    responses = await asyncio.gather(*tasks)
    assert probe.calls["charge"] == 1
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(201) >= 1
    assert set(statuses) <= {201, 409}
    originals = [r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(originals) == 1
    for response in responses:
        if response.status_code == 409:
            assert problem(response)["code"] == "idempotency_request_in_progress"
            assert response.headers["retry-after"] == "1"
        else:
            assert response.content == originals[0].content
    final = await send()
    assert final.headers["idempotent-replayed"] == "true"
    assert final.content == originals[0].content


async def test_in_progress_is_409_with_retry_after(store: Store, key: str) -> None:
    probe, client = setup(store, retry_after=3)
    probe.hold()
    first = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    second = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert second.status_code == 409
    assert second.headers["retry-after"] == "3"
    assert problem(second)["code"] == "idempotency_request_in_progress"
    probe.release.set()
    assert (await first).status_code == 201


# -- a different request under the same key ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [("/charge", b'{"amount": 11}'), ("/charge?x=1", b'{"amount": 10}'), ("/stream", b'{"amount": 10}')],
    ids=["body", "query", "path"],
)
async def test_same_key_different_request_is_422(store: Store, key: str, path: str, body: bytes) -> None:
    probe, client = setup(store)
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    assert (await client.post("/charge", content=b'{"amount": 10}', headers=headers)).status_code == 201
    response = await client.post(path, content=body, headers=headers)
    assert response.status_code == 422
    assert problem(response)["code"] == "idempotency_key_reused"
    assert probe.calls["charge"] == 1
    assert probe.calls["stream"] == 0


async def test_mismatch_is_422_even_while_the_original_runs(store: Store, key: str) -> None:
    probe, client = setup(store)
    probe.hold()
    first = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    other = await client.post("/charge", content=b"b", headers={"Idempotency-Key": key})
    assert other.status_code == 422
    probe.release.set()
    await first


async def test_json_key_order_and_whitespace_are_the_same_request(store: Store, key: str) -> None:
    probe, client = setup(store)
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    await client.post("/charge", content=b'{"a": 1, "b": [1, 2]}', headers=headers)
    again = await client.post("/charge", content=b'{"b":[1,2],\n "a":1}', headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_form_pair_order_is_the_same_request(store: Store, key: str) -> None:
    probe, client = setup(store)
    headers = {"Idempotency-Key": key, "content-type": "application/x-www-form-urlencoded"}
    await client.post("/charge", content=b"amount=10&currency=usd&metadata%5Bx%5D=1", headers=headers)
    again = await client.post("/charge", content=b"metadata[x]=1&currency=usd&amount=10", headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_a_form_the_app_reads_differently_is_422_not_a_replay(store: Store, key: str) -> None:
    """Starlette decodes ``%C3%A9`` as UTF-8 ('é') and raw bytes as latin-1 ('Ã©'): two different requests."""
    probe, client = setup(store)
    headers = {"Idempotency-Key": key, "content-type": "application/x-www-form-urlencoded"}
    first = await client.post("/charge", content=b"to=%C3%A9ric", headers=headers)
    assert first.status_code == 201
    other = await client.post("/charge", content=b"to=\xc3\xa9ric", headers=headers)
    assert other.status_code == 422
    assert problem(other)["code"] == "idempotency_key_reused"
    assert probe.calls["charge"] == 1


# -- tenants -----------------------------------------------------------------------------------------------


async def test_tenants_are_isolated(store: Store, key: str) -> None:
    probe = Probe()
    app = build_app(store, probe)
    alice, bob = client_for(app, token="sk_alice"), client_for(app, token="sk_bob")
    a = await alice.post("/charge", content=b"alice-secret", headers={"Idempotency-Key": key})
    b = await bob.post("/charge", content=b"bob-payload", headers={"Idempotency-Key": key})
    assert a.status_code == b.status_code == 201
    assert "idempotent-replayed" not in b.headers
    assert b"alice-secret" not in b.content
    assert probe.calls["charge"] == 2
    # Bob's request with Alice's exact payload is still his own: a fresh run, not Alice's response.
    b2 = await bob.post("/charge", content=b"alice-secret", headers={"Idempotency-Key": "other-" + key})
    assert "idempotent-replayed" not in b2.headers
    # While Alice's key is in flight, Bob is neither blocked nor told anything.
    probe.hold()
    held = asyncio.create_task(alice.post("/charge", content=b"x", headers={"Idempotency-Key": "held-" + key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    probe.release.set()
    free = await bob.post("/charge", content=b"y", headers={"Idempotency-Key": "held-" + key})
    assert free.status_code == 201
    await held


async def test_custom_async_tenant_resolver(store: Store, key: str) -> None:
    async def by_account(scope: Scope) -> str:
        account: bytes = dict(scope["headers"]).get(b"x-account", b"")
        return account.decode()

    probe = Probe()
    app = build_app(store, probe, tenant=by_account)
    client = client_for(app)
    for account in ("acct_1", "acct_2", "acct_1"):
        await client.post("/charge", content=b"x", headers={"Idempotency-Key": key, "x-account": account})
    assert probe.calls["charge"] == 2


# -- released outcomes: the retry runs afresh -------------------------------------------------------------


@pytest.mark.parametrize("code", [500, 502, 503, 408, 425, 429, 401, 403, 404, 405])
async def test_transient_and_not_executed_outcomes_are_released(store: Store, key: str, code: int) -> None:
    probe, client = setup(store)
    first = await client.post(f"/status/{code}", headers={"Idempotency-Key": key})
    second = await client.post(f"/status/{code}", headers={"Idempotency-Key": key})
    assert first.status_code == second.status_code == code
    assert "idempotent-replayed" not in second.headers
    assert probe.calls["status"] == 2
    assert await store.inspect(tenant_of(), key) is None


@pytest.mark.parametrize("code", [200, 201, 202, 204, 302, 400, 402, 409, 410, 422])
async def test_final_outcomes_are_recorded(store: Store, key: str, code: int) -> None:
    probe, client = setup(store)
    first = await client.post(f"/status/{code}", headers={"Idempotency-Key": key})
    second = await client.post(f"/status/{code}", headers={"Idempotency-Key": key})
    assert second.status_code == code
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert probe.calls["status"] == 1


async def test_released_statuses_are_configurable(store: Store, key: str) -> None:
    probe, client = setup(store, released_statuses=frozenset({409}))
    await client.post("/status/409", headers={"Idempotency-Key": key})
    await client.post("/status/409", headers={"Idempotency-Key": key})
    assert probe.calls["status"] == 2


async def test_exception_releases_the_key(store: Store, key: str) -> None:
    probe, client = setup(store)
    with pytest.raises(RuntimeError):
        await client.post("/boom", headers={"Idempotency-Key": key})
    retry = await client.post("/boom", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert probe.calls["boom"] == 2


async def test_cancelled_request_releases_the_key(store: Store, key: str) -> None:
    """A client that disconnects mid-handler (the server cancels the request task) frees the key."""
    probe, client = setup(store)
    probe.hold()
    first = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0.05)  # the shielded release finishes
    probe.release.set()
    retry = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert probe.calls["charge"] == 2


async def test_disconnect_while_sending_the_body_claims_nothing(store: Store, key: str) -> None:
    probe = Probe()
    app = build_app(store, probe)
    messages: Iterator[Message] = iter(
        [{"type": "http.request", "body": b"part", "more_body": True}, {"type": "http.disconnect"}]
    )
    sent: list[Message] = []

    async def receive() -> Message:
        return next(messages)

    async def send(message: Message) -> None:
        sent.append(message)

    await app(keyed_scope("/charge", key), receive, send)
    assert sent == []
    assert probe.calls["charge"] == 0
    assert await store.inspect(tenant_of(), key) is None


# -- leases and fences -------------------------------------------------------------------------------------


async def test_slow_handler_keeps_its_claim_through_heartbeats(store: Store, key: str) -> None:
    # A lease of 1 s, renewed every third of it: a 0.3 s lease lapsed on a loaded CI machine whose renewal came
    # 0.2 s late, and the retry then took the key over and waited in the held handler until pytest's timeout.
    probe, client = setup(store, lease=1.0)
    probe.hold()
    first = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    await asyncio.sleep(2.5)  # two and a half leases long
    retry = client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    try:
        during = await asyncio.wait_for(retry, 10)
    except TimeoutError:
        probe.release.set()
        pytest.fail("the retry took the key over and ran the handler while the first request still held it")
    assert during.status_code == 409
    probe.release.set()
    assert (await first).status_code == 201
    assert probe.calls["charge"] == 1


async def test_lapsed_lease_is_taken_over_and_the_stale_worker_is_fenced_out(store: Store, key: str) -> None:
    fp = b"f" * 32
    stale = await store.claim("t", key, fp, lease=0.05, ttl=60)
    await asyncio.sleep(0.1)
    fresh = await store.claim("t", key, fp, lease=60, ttl=60)
    assert stale.outcome.value == fresh.outcome.value == "owned"
    assert fresh.fence != stale.fence
    from idempotency_mw import StoredResponse

    response = StoredResponse(201, [(b"a", b"b")], b"stale", 5)
    assert not await store.complete("t", key, stale.fence, response)
    assert not await store.release("t", key, stale.fence)
    assert not await store.renew("t", key, stale.fence, lease=60)
    info = await store.inspect("t", key)
    assert info is not None
    assert info.state == "in_progress"
    assert info.fence == fresh.fence
    assert await store.complete("t", key, fresh.fence, response)


async def test_lapsed_lease_of_a_different_request_is_still_422(store: Store, key: str) -> None:
    await store.claim("t", key, b"a" * 32, lease=0.05, ttl=60)
    await asyncio.sleep(0.1)
    assert (await store.claim("t", key, b"b" * 32, lease=60, ttl=60)).outcome.value == "mismatch"


async def test_a_live_lease_keeps_its_record_past_the_ttl(store: Store, key: str) -> None:
    """A handler running longer than its ttl, its lease renewed: the record is neither taken over by a retry (two
    executions at once) nor purged. An outside review found both on PostgreSQL, where expires_at stayed put."""
    fp = b"f" * 32
    first = await store.claim("t", key, fp, lease=1, ttl=0.2)
    await asyncio.sleep(0.3)  # the ttl passes; the handler is still running
    assert await store.renew("t", key, first.fence, lease=2)  # and keeps its lease alive
    await asyncio.sleep(1)  # past the first lease too: only the renewal holds the record now
    assert (await store.claim("t", key, fp, lease=1, ttl=0.2)).outcome.value == "in_progress"
    await store.purge_expired()
    info = await store.inspect("t", key)
    assert info is not None
    assert info.fence == first.fence
    assert await store.complete("t", key, first.fence, StoredResponse(201, [], b"done", 4))


async def test_a_takeover_near_the_end_of_the_ttl_keeps_its_record_for_its_lease(store: Store, key: str) -> None:
    fp = b"f" * 32
    await store.claim("t", key, fp, lease=0.1, ttl=0.4)
    await asyncio.sleep(0.2)  # the lease lapses; 0.2 s of ttl left
    taken = await store.claim("t", key, fp, lease=2, ttl=0.4)
    assert taken.outcome.value == "owned"
    await asyncio.sleep(0.4)  # past the first claim's ttl, well within the takeover's lease
    assert (await store.claim("t", key, fp, lease=2, ttl=0.4)).outcome.value == "in_progress"


async def test_release_after_a_new_claim_cannot_delete_it(store: Store, key: str) -> None:
    """Fences are unique across claims of a key, even after the record was released and claimed again."""
    first = await store.claim("t", key, b"a" * 32, lease=0.05, ttl=60)
    await asyncio.sleep(0.1)
    second = await store.claim("t", key, b"a" * 32, lease=60, ttl=60)
    assert await store.release("t", key, second.fence)
    third = await store.claim("t", key, b"a" * 32, lease=60, ttl=60)
    assert third.fence not in (first.fence, second.fence)
    assert not await store.release("t", key, first.fence)
    assert (await store.inspect("t", key)) is not None


async def test_expired_record_runs_anew(store: Store, key: str) -> None:
    probe, client = setup(store, ttl=0.4, lease=0.1)
    await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    await asyncio.sleep(0.5)
    again = await client.post("/charge", content=b"different", headers={"Idempotency-Key": key})
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert probe.calls["charge"] == 2


async def test_expired_record_takeover_starts_counting_attempts_afresh(store: Store, key: str) -> None:
    first = await store.claim("t", key, b"a" * 32, lease=0.1, ttl=0.3)
    for _ in range(3):
        await store.claim("t", key, b"a" * 32, lease=0.1, ttl=0.3)  # in progress, then a lapsed lease: counted
    await asyncio.sleep(0.4)
    taken_over = await store.claim("t", key, b"a" * 32, lease=60, ttl=60)
    assert taken_over.fence != first.fence
    assert taken_over.attempts == 0  # the new operation's count, not the expired one's
    again = await store.claim("t", key, b"a" * 32, lease=60, ttl=60)
    assert again.attempts == 1


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        [(b"idempotency-key", b"")],
        [(b"idempotency-key", b"k" * 256)],
        [(b"idempotency-key", b'"' + b"k" * 256 + b'"')],
        [(b"idempotency-key", b"ab\x01cd")],
        [(b"idempotency-key", b"ab cd")],
        [(b"idempotency-key", "clé".encode())],
        [(b"idempotency-key", b"a"), (b"idempotency-key", b"b")],
        [(b"idempotency-key", b'"unterminated')],
        [(b"idempotency-key", b'"bad\\escape"')],
        [(b"idempotency-key", b'"a"b')],
        [(b"idempotency-key", b'""')],
        [(b"idempotency-key", b"a,b")],
    ],
    ids=[
        "empty",
        "256",
        "256-quoted",
        "control",
        "space",
        "non-ascii",
        "repeated",
        "unterminated",
        "escape",
        "trailing",
        "empty-quoted",
        "comma",
    ],
)
async def test_bad_keys_are_400_and_the_handler_never_runs(store: Store, headers: list[tuple[bytes, bytes]]) -> None:
    probe = Probe()
    app = build_app(store, probe)
    status, response_headers, chunks = await raw_call(app, "/charge", None, extra_headers=headers)
    assert status == 400
    body = orjson.loads(b"".join(chunks))
    assert body["code"] == "idempotency_key_invalid"
    assert (b"content-type", b"application/problem+json") in response_headers
    assert probe.calls["charge"] == 0


async def test_quoted_and_bare_forms_name_the_same_key(store: Store, key: str) -> None:
    probe, client = setup(store)
    await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    again = await client.post("/charge", content=b"a", headers={"Idempotency-Key": f'"{key}"'})
    assert again.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_oversized_request_is_413(store: Store, key: str) -> None:
    probe, client = setup(store, max_request_bytes=100)
    declared = await client.post("/charge", content=b"x" * 101, headers={"Idempotency-Key": key})
    assert declared.status_code == 413
    assert problem(declared)["code"] == "request_too_large"

    async def streamed() -> Any:
        for _ in range(5):
            yield b"x" * 30

    chunked = await client.post("/charge", content=streamed(), headers={"Idempotency-Key": key})
    assert chunked.status_code == 413
    assert probe.calls["charge"] == 0
    ok = await client.post("/charge", content=b"x" * 100, headers={"Idempotency-Key": key})
    assert ok.status_code == 201


async def test_response_over_the_storage_cap_is_never_rerun_nor_truncated(store: Store, key: str) -> None:
    probe, client = setup(store, max_response_bytes=1000)
    live = await client.post("/big?size=5000", headers={"Idempotency-Key": key})
    assert live.status_code == 200
    assert live.content == b"x" * 5000
    retry = await client.post("/big?size=5000", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert problem(retry)["code"] == "idempotency_response_not_replayable"
    assert "retry-after" not in retry.headers
    assert probe.calls["big"] == 1
    # At the cap exactly, the body is stored.
    await client.post("/big?size=1000", headers={"Idempotency-Key": "at-cap-" + key})
    replay = await client.post("/big?size=1000", headers={"Idempotency-Key": "at-cap-" + key})
    assert replay.content == b"x" * 1000


# -- the store failing -------------------------------------------------------------------------------------


class BrokenStore(MemoryStore):
    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError("connection refused")


@pytest.mark.parametrize("broken", ["memory", "postgres"])
async def test_store_down_is_503_and_the_handler_never_runs(broken: str, key: str) -> None:
    store: Store = (
        BrokenStore() if broken == "memory" else PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    )
    probe, client = setup(store, retry_after=2)
    response = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert problem(response)["code"] == "idempotency_store_unavailable"
    assert probe.calls["charge"] == 0


async def test_fail_open_runs_the_handler_unprotected(key: str) -> None:
    probe, client = setup(BrokenStore(), fail_open=True)
    response = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert response.status_code == 201
    assert probe.calls["charge"] == 1


@pytest.mark.parametrize(
    "refusal",
    [StoreNotMigrated("public"), StoreNotGranted("public", ["idempotency_records: INSERT"])],
    ids=["not migrated", "not granted"],
)
async def test_failing_open_never_covers_a_store_set_up_wrong(key: str, refusal: StoreUnavailable) -> None:
    """A store that answers, but is not migrated or not granted, is a deploy to fix, not an outage to ride out: 503
    while it lasts, never every request unprotected (a skipped migration ran each retry again)."""

    class Refusing(MemoryStore):
        async def claim(self, *args: Any, **kwargs: Any) -> Any:
            raise refusal

    probe, client = setup(Refusing(), fail_open=True)
    response = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert (response.status_code, problem(response)["code"]) == (503, "idempotency_store_unavailable")
    assert probe.calls["charge"] == 0


# -- retention ---------------------------------------------------------------------------------------------


def _uuid7(age_seconds: float) -> str:
    import time
    import uuid

    ms = int((time.time() - age_seconds) * 1000)
    return str(uuid.UUID(int=(ms << 80) | (0x7 << 76) | (0b10 << 62) | uuid.uuid4().int % (1 << 62)))


async def test_uuid7_key_older_than_the_ttl_is_refused_not_rerun_when_asked(store: Store) -> None:
    probe, client = setup(store, ttl=60, lease=1, check_uuid7_age=True)
    old = await client.post("/charge", content=b"a", headers={"Idempotency-Key": _uuid7(120)})
    assert old.status_code == 422
    assert problem(old)["code"] == "idempotency_key_expired"
    assert probe.calls["charge"] == 0
    fresh = await client.post("/charge", content=b"a", headers={"Idempotency-Key": _uuid7(1)})
    assert fresh.status_code == 201


@pytest.mark.parametrize(
    "key",
    [
        "00249a52-a346-784a-b512-74d3ab0cb4c2",  # minted by the official Stripe Python SDK: random hex in UUID shape
        _uuid7(10 * 365 * 24 * 3600),
    ],
    ids=["stripe-sdk", "uuid7-ten-years-old"],  # the second is random: workers collecting the suite must agree
)
async def test_an_old_looking_uuid7_key_runs_by_default(store: Store, key: str) -> None:
    """About 1 in 64 random UUID-shaped keys has version nibble 7, and its random "timestamp" reads as a birth time
    long past: refusing those by default would fail payments on keys the application never chose."""
    probe, client = setup(store, ttl=60, lease=1)
    first = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert first.status_code == 201
    again = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_uuid7_key_with_a_live_record_still_replays(store: Store) -> None:
    """Age alone never refuses a key whose record still exists: the record is the better witness."""
    key = _uuid7(120)
    probe = Probe()
    long_lived = client_for(build_app(store, probe, ttl=600, lease=1, check_uuid7_age=True))
    short_lived = client_for(build_app(store, probe, ttl=60, lease=1, check_uuid7_age=True))
    first = await long_lived.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert first.status_code == 201
    again = await short_lived.post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_attempts_are_counted_on_the_record(store: Store, key: str) -> None:
    probe, client = setup(store)
    probe.hold()
    first = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(probe.entered.wait(), 5)
    for _ in range(2):  # retries while the first still runs: 409, counted
        assert (await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})).status_code == 409
    probe.release.set()
    assert (await first).status_code == 201
    assert (await client.post("/charge", content=b"b", headers={"Idempotency-Key": key})).status_code == 422
    for _ in range(3):  # replays only read the record: not counted
        replay = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
        assert replay.headers["idempotent-replayed"] == "true"
    info = await store.inspect(tenant_of(), key)
    assert info is not None
    assert info.attempts == 3  # two 409s and a 422 after the first request
    assert info.state == "completed"
    assert probe.calls["charge"] == 1


async def test_events_report_outcomes_and_attempts(store: Store, key: str) -> None:

    events: list[Event] = []
    probe, client = setup(store, on_event=events.append)
    for body in (b"a", b"a", b"b", b"a"):
        await client.post("/charge", content=body, headers={"Idempotency-Key": key})
    await client.post("/charge", content=b"a", headers={"Idempotency-Key": "bad key"})
    assert [(e.outcome.value, e.attempts, e.status) for e in events] == [
        ("executed", 0, 201),
        ("replayed", 0, 201),  # a replay reads the count and does not add to it
        ("key_reused", 1, 422),
        ("replayed", 1, 201),
        ("key_invalid", 0, 400),
    ]
    assert all(key not in repr(e) for e in events)  # only a hash of the key travels
    assert events[0].key_hash == events[1].key_hash != ""
    assert probe.calls["charge"] == 1


# -- fingerprint field selection ----------------------------------------------------------------------------------


async def test_fields_left_out_of_the_fingerprint_may_change_between_retries(store: Store, key: str) -> None:
    """A client that stamps each attempt (a timestamp, a request id inside the body) sends the same request again:
    a route that leaves those fields out of the fingerprint replays it; any other change is still another request."""
    probe, client = setup(store, routes={"/charge": {"fingerprint_exclude": {"sent_at", "meta.attempt_id"}}})
    first = b'{"amount": 10, "sent_at": "2026-11-26T10:00:00Z", "meta": {"attempt_id": "a1", "source": "app"}}'
    retry = b'{"amount": 10, "sent_at": "2026-11-26T10:00:05Z", "meta": {"attempt_id": "a2", "source": "app"}}'
    other = b'{"amount": 11, "sent_at": "2026-11-26T10:00:09Z", "meta": {"attempt_id": "a3", "source": "app"}}'
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    assert (await client.post("/charge", content=first, headers=headers)).status_code == 201
    replayed = await client.post("/charge", content=retry, headers=headers)
    assert replayed.headers["idempotent-replayed"] == "true"
    reused = await client.post("/charge", content=other, headers=headers)
    assert problem(reused)["code"] == "idempotency_key_reused"
    moved = first.replace(b'"source": "app"', b'"source": "web"')
    assert problem(await client.post("/charge", content=moved, headers=headers))["status"] == 422
    assert probe.calls["charge"] == 1


async def test_form_fields_left_out_of_the_fingerprint(store: Store, key: str) -> None:
    probe, client = setup(store, routes={"/charge": {"fingerprint_exclude": {"nonce"}}})
    form = {"Content-Type": "application/x-www-form-urlencoded", "Idempotency-Key": key}
    assert (await client.post("/charge", content=b"amount=10&nonce=1", headers=form)).status_code == 201
    again = await client.post("/charge", content=b"nonce=2&amount=10", headers=form)
    assert again.headers["idempotent-replayed"] == "true"
    assert (await client.post("/charge", content=b"amount=11&nonce=3", headers=form)).status_code == 422
    assert probe.calls["charge"] == 1


def test_fingerprint_exclude_takes_field_names() -> None:
    with pytest.raises(ValueError, match="fingerprint_exclude"):
        IdempotencyMiddleware(build_app(MemoryStore(), Probe()), store=MemoryStore(), fingerprint_exclude="sent_at")


# -- the replay hook, and turning the middleware off --------------------------------------------------------------


async def test_the_replay_hook_sees_and_may_change_each_replay(store: Store, key: str) -> None:
    seen: list[tuple[str, int]] = []

    def on_replay(scope: Scope, response: StoredResponse) -> StoredResponse:
        seen.append((scope["path"], response.status))
        return StoredResponse(
            response.status, [*response.headers, (b"x-replays-seen", b"1")], response.body, response.body_size
        )

    probe, client = setup(store, on_replay=on_replay)
    live = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
    replay = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
    assert "x-replays-seen" not in live.headers
    assert (replay.headers["x-replays-seen"], replay.headers["idempotent-replayed"]) == ("1", "true")
    assert replay.content == live.content
    assert seen == [("/charge", 201)]
    assert probe.calls["charge"] == 1


async def test_an_async_replay_hook_is_awaited(store: Store, key: str) -> None:
    async def on_replay(scope: Scope, response: StoredResponse) -> StoredResponse:
        await asyncio.sleep(0)
        return dataclasses.replace(response, headers=[*response.headers, (b"x-replays-seen", b"1")])

    probe, client = setup(store, on_replay=on_replay)
    live = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
    for _ in range(2):
        replay = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
        assert (replay.status_code, replay.headers["x-replays-seen"], replay.content) == (201, "1", live.content)
    assert probe.calls["charge"] == 1


@pytest.mark.parametrize("returned", ["a string", 201, {"status": 200}])
async def test_a_replay_hook_that_returns_something_else_replays_as_stored(
    store: Store, key: str, returned: object, caplog: pytest.LogCaptureFixture
) -> None:
    async def on_replay(scope: Scope, response: StoredResponse) -> object:
        return returned

    probe, client = setup(store, on_replay=on_replay)
    live = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
    with caplog.at_level("ERROR", logger="idempotency_mw"):
        replay = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})
    assert (replay.status_code, replay.headers["idempotent-replayed"], replay.content) == (201, "true", live.content)
    assert "on_replay hook returned" in caplog.text
    assert probe.calls["charge"] == 1


@pytest.mark.parametrize("how", ["argument", "environment"])
async def test_a_disabled_middleware_lets_everything_through_and_says_so(
    store: Store, key: str, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """For tests, or an emergency: every request runs as if the middleware were not there, and the operator is
    told at start, loudly, that retries now run again."""
    options: dict[str, Any] = {}
    if how == "argument":
        options["enabled"] = False
    else:
        monkeypatch.setenv("IDEMPOTENCY_MW_DISABLED", "1")
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        probe, client = setup(store, **options)
    for _ in range(2):
        assert (await client.post("/charge", content=b"{}", headers={"Idempotency-Key": key})).status_code == 201
    assert probe.calls["charge"] == 2
    (warning,) = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert "DISABLED" in warning.getMessage()
    assert "run again" in warning.getMessage()


def switch_app(store: Store, *, enabled: bool, runs: list[str]) -> Starlette:
    """Every kind of route a covered app has: plain, key required, transactional (when the store can), a webhook
    that takes its key from the body with a tenant of its own, and one that waits for a running original."""

    async def handle(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None, "a covered handler always has its context"
        body = await request.body()
        runs.append(request.url.path)
        if context.transaction is not None:
            assert context.connection is not None
            await context.connection.execute("INSERT INTO switch_effects (note) VALUES ($1)", body.decode())
        downstream = context.downstream_key("provider") if context.key is not None else None
        return JSONResponse({"key": context.key, "downstream": downstream, "size": len(body)}, status_code=201)

    paths = ["/plain", "/required", "/webhook", "/wait"]
    if isinstance(store, PostgresStore):
        paths.append("/tx")
    app = Starlette(routes=[Route(path, handle, methods=["POST"]) for path in paths])
    routes: dict[str, Any] = {
        "/required": {"required": True},
        "/webhook": {"key_from": lambda event: event["id"], "tenant": lambda scope: "provider"},
        "/wait": {"on_conflict": "wait"},
    }
    if "/tx" in paths:
        routes["/tx"] = {"transactional": True, "required": True}
    app.add_middleware(IdempotencyMiddleware, store=store, enabled=enabled, routes=routes)
    return app


@pytest.mark.parametrize("kind", ["memory", "postgres"])
async def test_the_off_switch_answers_nothing_and_breaks_no_route(
    kind: str, idempotency_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``enabled=False`` (an emergency): the middleware answers nothing itself, not even on a route that requires a
    key, and claims and records nothing; every route runs as its handler would without it, a transactional route
    still gets its transaction, and a handler's context still gives the downstream key it gives when enabled."""
    connection = await asyncpg.connect(idempotency_database_url)
    await connection.execute("CREATE TABLE IF NOT EXISTS switch_effects (id bigserial PRIMARY KEY, note text)")
    store: Store = MemoryStore() if kind == "memory" else PostgresStore(idempotency_database_url)
    key = f"off-{uuid.uuid4().hex}"
    event = {"id": f"evt_{uuid.uuid4().hex}"}
    try:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(store, PostgresStore):
                await stack.enter_async_context(store)
            on_runs: list[str] = []
            async with client_for(switch_app(store, enabled=True, runs=on_runs)) as client:
                enabled = (await client.post("/plain", json={}, headers={"Idempotency-Key": key + "-on"})).json()
            runs: list[str] = []
            app = switch_app(store, enabled=False, runs=runs)
            paths = ["/plain", "/required", "/webhook", "/wait"] + (["/tx"] if kind == "postgres" else [])
            async with client_for(app) as client:
                with caplog.at_level("WARNING", logger="idempotency_mw"):
                    await client.post("/plain", json={})  # the app builds its middleware at its first request
                assert "DISABLED" in caplog.text
                runs.clear()
                answers = []
                for path in paths:
                    for _ in range(2):  # a retry runs again: nothing is recorded
                        body = event if path == "/webhook" else {"note": path}
                        answers.append(await client.post(path, json=body, headers={"Idempotency-Key": key}))
                keyless = [await client.post(path, json={"note": "keyless"}) for path in ("/required", "/tx")]
                bad_key = await client.post("/plain", json={}, headers={"Idempotency-Key": "bad key"})
                not_json = await client.post("/webhook", content=b"not json", headers={"content-type": "text/plain"})
                anonymous = await client.post("/plain", json={}, headers={"Idempotency-Key": key, "Authorization": ""})
                off = (await client.post("/plain", json={}, headers={"Idempotency-Key": key + "-on"})).json()
            assert all(answer.status_code == 201 for answer in [*answers, bad_key, not_json, anonymous])
            assert all("idempotent-replayed" not in answer.headers for answer in answers)
            assert sorted(runs) == sorted(
                [p for p in paths for _ in range(2)]
                + ["/required", "/plain", "/webhook", "/plain", "/plain"]
                + (["/tx"] if kind == "postgres" else [])
            )
            assert [answer.status_code for answer in keyless] == [201, 201 if kind == "postgres" else 404]
            assert off["downstream"] == enabled["downstream"]  # the provider still deduplicates its half
            assert anonymous.json()["key"] is None  # no tenant: the key scopes nothing
            assert bad_key.json()["key"] is None
            for tenant, record_key in ((tenant_of(), key), ("provider", event["id"])):
                assert await store.inspect(tenant, record_key) is None
    finally:
        notes = await connection.fetch(
            "SELECT note FROM switch_effects WHERE note LIKE '%/tx%' OR note LIKE '%keyless%'"
        )
        await connection.execute("DROP TABLE IF EXISTS switch_effects")
        await connection.close()
    if kind == "postgres":
        assert len(notes) >= 3  # each transactional run committed its write: twice keyed, once keyless


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "switched off"])
async def test_a_transaction_that_cannot_begin_is_reported_only_for_a_claimed_key(enabled: bool) -> None:
    """The database down, a transactional route answers 503 (there is no transaction to lend). Reported as a store
    error only where a key was claimed: not for a keyless request, nor switched off, where nothing is claimed or
    reported (observability.md, rollout.md). They were reported, and counted in ``idempotency_requests_total``."""
    events: list[Event] = []

    async def charge(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    store = PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, enabled=enabled, on_event=events.append)
    async with client_for(app) as client:
        keyed = await client.post("/charge", json={}, headers={"Idempotency-Key": str(uuid.uuid4())})
        keyless = await client.post("/charge", json={})
    assert (keyed.status_code, keyless.status_code) == (503, 503)
    assert [event.outcome for event in events] == ([Outcome.STORE_ERROR] if enabled else [])


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "switched off"])
async def test_a_keyless_request_never_meets_the_tenant_resolver(enabled: bool) -> None:
    """A resolver may count on what only keyed API calls carry (the account an auth layer put in the scope): a
    request without a key is not the middleware's, switched on or off, and runs as without it."""

    def account(scope: Scope) -> str:
        return str(scope["state"]["account"])  # a KeyError for anyone the auth layer did not see

    async def page(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/page", page, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=account, enabled=enabled)
    async with client_for(app) as client:
        answer = await client.post("/page", json={})
    assert answer.status_code == 201


# -- keys from the payload (webhooks) -----------------------------------------------------------------------------


def webhook_routes(**extra: Any) -> dict[str, Any]:
    """A provider's webhooks: the key is the event's id, in the body; the provider sends no credentials, so the
    route names the tenant its keys belong to."""
    return {"/charge": {"key_from": lambda event: event.get("id"), "tenant": lambda scope: "provider", **extra}}


async def test_a_webhook_route_takes_its_key_from_the_body(store: Store) -> None:
    probe, client = setup(store, routes=webhook_routes())
    event = {"id": f"evt_{uuid.uuid4().hex}", "type": "charge.succeeded"}
    first = await client.post("/charge", json=event, headers={"Authorization": ""})
    again = await client.post("/charge", json=event, headers={"Authorization": ""})
    other = await client.post("/charge", json={**event, "id": f"evt_{uuid.uuid4().hex}"})
    assert first.status_code == 201
    assert (again.headers["idempotent-replayed"], again.content) == ("true", first.content)
    assert "idempotent-replayed" not in other.headers
    assert probe.calls["charge"] == 2
    reused = await client.post("/charge", json={**event, "type": "charge.refunded"})
    assert problem(reused)["code"] == "idempotency_key_reused"
    info = await store.inspect("route:provider", event["id"])  # a route's own tenant has a namespace of its own
    assert info is not None
    assert info.state == "completed"


async def test_a_routes_own_tenant_never_meets_a_tenant_of_the_resolver(store: Store) -> None:
    """A resolver that can return the string a route names as its tenant (an account id "provider", read from a
    header a proxy sets) must not meet that route's records: its request with the event's id as key, on another
    route, runs on its own instead of being told the key was used (422), or blocked while the event runs (409)."""
    probe = Probe()
    app = build_app(store, probe, tenant=header_tenant("x-account"), routes=webhook_routes())
    client = client_for(app)
    event = {"id": f"evt_{uuid.uuid4().hex}", "type": "charge.succeeded"}
    webhook = await client.post("/charge", json=event)
    customer = await client.post("/status/201", headers={"x-account": "provider", "Idempotency-Key": event["id"]})
    assert (webhook.status_code, customer.status_code) == (201, 201)
    assert (probe.calls["charge"], probe.calls["status"]) == (1, 1)


async def test_a_resolver_tenant_that_came_first_never_blocks_a_routes_events(store: Store) -> None:
    """The other order: the customer's request under its account "provider", with the event's id as key, came first.
    The event's look for a record the previous release wrote under the bare tenant finds the customer's, of another
    request: that is not the event's, which runs (it was answered 422 on every delivery, never handled)."""
    probe = Probe()
    app = build_app(store, probe, tenant=header_tenant("x-account"), routes=webhook_routes())
    client = client_for(app)
    event = {"id": f"evt_{uuid.uuid4().hex}", "type": "charge.succeeded"}
    customer = await client.post("/status/201", headers={"x-account": "provider", "Idempotency-Key": event["id"]})
    webhook = await client.post("/charge", json=event)
    again = await client.post("/charge", json=event)
    assert (customer.status_code, webhook.status_code) == (201, 201)
    assert (again.headers["idempotent-replayed"], again.content) == ("true", webhook.content)
    assert (probe.calls["charge"], probe.calls["status"]) == (1, 1)


async def test_a_tenant_the_app_tells_in_the_routes_namespace_is_refused(key: str) -> None:
    """A tenant told from inside the app (FastAPI's ``TenantDependency``, ``claim_for``) is held to the resolver's
    rule: none in the namespace of routes' own tenants, whose records it could otherwise write first."""
    from fastapi import Depends, FastAPI

    from idempotency_mw.fastapi import TenantDependency, setup

    async def account(request: Request) -> str:
        return request.headers["x-account"]

    store, tenant = MemoryStore(), TenantDependency(account)
    app = FastAPI(dependencies=[Depends(tenant)])
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant, routes=webhook_routes())
    setup(app)
    runs: list[str] = []

    @app.post("/orders", status_code=201)
    async def orders() -> dict[str, bool]:
        runs.append("orders")
        return {"ok": True}

    async with client_for(app) as client:
        answer = await client.post("/orders", headers={"x-account": "route:provider", "Idempotency-Key": key})
    assert problem(answer)["code"] == "idempotency_tenant_unknown"
    assert runs == []
    assert await store.inspect("route:provider", key) is None


async def test_a_resolver_tenant_in_the_routes_namespace_is_refused(
    store: Store, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe()
    client = client_for(build_app(store, probe, tenant=header_tenant("x-account")))
    with caplog.at_level("ERROR", logger="idempotency_mw"):
        for _ in range(2):
            answer = await client.post(
                "/charge", json={}, headers={"x-account": "route:provider", "Idempotency-Key": key}
            )
            assert problem(answer)["code"] == "idempotency_tenant_unknown"
    assert probe.calls["charge"] == 0
    assert len([r for r in caplog.records if "namespace" in r.getMessage()]) == 1


async def test_a_webhook_delivered_before_the_upgrade_still_replays(store: Store) -> None:
    """Records of a route's own tenant written before routes had a namespace are under the bare tenant: an event
    redelivered after the upgrade finds its record there, and is not handled twice."""
    event = {"id": f"evt_{uuid.uuid4().hex}", "type": "charge.succeeded"}
    probe, client = setup(store, routes=webhook_routes())
    first = await client.post("/charge", json=event)
    record = await store.inspect("route:provider", event["id"])
    assert record is not None
    # As 0.2 stored it: under the bare tenant.
    claim = await store.claim("provider", event["id"], record.fingerprint, lease=30, ttl=3600)
    assert await store.complete("provider", event["id"], claim.fence, StoredResponse(201, [], b'{"run":"before"}', 16))
    assert await store.forget("route:provider", event["id"])
    again = await client.post("/charge", json=event)
    assert (again.headers.get("idempotent-replayed"), again.content) == ("true", b'{"run":"before"}')
    assert await store.inspect("route:provider", event["id"]) is None  # the fresh claim was given back
    assert probe.calls["charge"] == 1
    assert first.status_code == 201


async def test_an_event_without_a_key_runs_unless_the_route_requires_one(store: Store) -> None:
    probe, client = setup(store, routes=webhook_routes())
    assert (await client.post("/charge", json={"type": "ping"})).status_code == 201
    assert probe.calls["charge"] == 1
    probe, client = setup(store, routes=webhook_routes(required=True))
    missing = await client.post("/charge", json={"type": "ping"})
    assert problem(missing)["code"] == "idempotency_key_missing"
    not_json = await client.post("/charge", content=b"id=evt_1", headers={"Content-Type": "text/plain"})
    assert problem(not_json)["code"] == "idempotency_key_invalid"
    bad = await client.post("/charge", json={"id": "evt 1"})
    assert problem(bad)["code"] == "idempotency_key_invalid"
    assert probe.calls["charge"] == 0


@pytest.mark.parametrize("body", [[{"id": "evt_1"}], "evt_1", 7, None], ids=["array", "string", "number", "null"])
async def test_a_key_function_that_raises_is_a_bad_key_not_a_500(
    store: Store, body: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The guide's own webhook recipe, ``event.get("id")``, raises for a body that is valid JSON but no object:
    an unauthenticated caller gets 400 idempotency_key_invalid, never a 500 with a traceback; logged once."""
    probe, client = setup(store, routes=webhook_routes(required=True))
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        for _ in range(2):
            answer = await client.post(
                "/charge", content=orjson.dumps(body), headers={"content-type": "application/json"}
            )
            assert (answer.status_code, problem(answer)["code"]) == (400, "idempotency_key_invalid")
            assert "Traceback" not in answer.text
    assert probe.calls["charge"] == 0
    assert [r.getMessage() for r in caplog.records if "key_from" in r.getMessage()] != []
    assert len([r for r in caplog.records if "key_from" in r.getMessage()]) == 1


async def test_a_route_may_take_its_key_from_another_header(store: Store) -> None:
    probe, client = setup(store, routes={"/charge": {"key_from": "X-Event-Id"}})
    event_id = str(uuid.uuid4())
    for _ in range(2):
        answer = await client.post("/charge", content=b"{}", headers={"X-Event-Id": event_id})
        assert answer.status_code == 201
    assert probe.calls["charge"] == 1
    ignored = await client.post("/charge", content=b"{}", headers={"Idempotency-Key": event_id})
    assert "idempotent-replayed" not in ignored.headers  # this route's key is X-Event-Id only
