"""Who owns a key: the default resolver (an HMAC of ``Authorization``), header resolvers, and keyed requests whose
tenant cannot be determined (refused, unless the app opts into a shared anonymous namespace)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import logging
import time
import uuid
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from idempotency_mw import (
    AuthorizationTenant,
    IdempotencyMiddleware,
    MemoryStore,
    Outcome,
    PostgresStore,
    Store,
    StoredResponse,
    StoreUnavailable,
    header_tenant,
)
from idempotency_mw._events import Event
from idempotency_mw._keys import TenantResolver, legacy_sha256_fallback
from idempotency_mw.testing import assert_idempotent
from tests.apps import Probe, build_app
from tests.conftest import TEST_TENANT_SECRET, client_for
from tests.faults import asgi

OTHER_SECRET = "another-secret-of-at-least-thirty-two-characters"


def scope_with(*authorization: bytes) -> dict[str, Any]:
    return {"headers": [(b"authorization", value) for value in authorization]}


def tenant_unknown(reply: asgi.Reply | httpx.Response) -> bool:
    """The reply is the 400 problem for a keyed request whose tenant cannot be determined."""
    if isinstance(reply, httpx.Response):
        status, content_type, body = reply.status_code, reply.headers.get("content-type"), reply.json()
    else:
        status, content_type = reply.status, (reply.header(b"content-type") or b"").decode()
        body = httpx.Response(200, content=reply.body).json()
    if (status, content_type) != (400, "application/problem+json"):
        return False
    assert body["code"] == "idempotency_tenant_unknown"
    assert body["status"] == 400
    assert "Idempotency-Key" in body["detail"]
    return True


async def resolved(resolve: TenantResolver, scope: Scope) -> str | None:
    """The tenant ``resolve`` gives ``scope``, whether it answers at once or is awaited."""
    tenant = resolve(scope)
    return await tenant if inspect.isawaitable(tenant) else tenant


async def record_count(store: Store, tenants: list[str | None], key: str) -> int:
    found = [await store.inspect(tenant, key) for tenant in tenants if tenant is not None]
    return len(found) - found.count(None)


# -- defect 9: the stored tenant is an HMAC under a server-side secret ----------------------------------------


async def test_the_stored_tenant_is_not_a_sha256_of_the_header_and_depends_on_the_secret(key: str) -> None:
    tenants: dict[str, str] = {}
    for name, options in (("default", {}), ("other", {"tenant": AuthorizationTenant(OTHER_SECRET)})):
        events: list[Event] = []
        client = client_for(build_app(MemoryStore(), Probe(), on_event=events.append, **options))
        response = await client.post("/charge", content=b"x", headers={"Idempotency-Key": key})
        assert response.status_code == 201
        assert events[-1].outcome is Outcome.EXECUTED
        tenants[name] = events[-1].tenant
    header = b"Bearer sk_test_alice"
    assert hashlib.sha256(header).hexdigest() not in tenants["default"]
    assert b"sk_test_alice" not in tenants["default"].encode()
    assert tenants["default"] != tenants["other"]
    assert tenants["default"] == AuthorizationTenant(TEST_TENANT_SECRET)(scope_with(header))
    assert tenants["default"].startswith("hmac-sha256:")


async def test_instances_with_the_same_secret_agree_on_the_tenant(store: Store, key: str) -> None:
    """Two app instances (or one app before and after a restart) sharing a store: a retry sent to the other one
    replays. An instance with another secret derives other tenants."""
    probe = Probe()
    first = client_for(build_app(store, probe, tenant=AuthorizationTenant(TEST_TENANT_SECRET)))
    second = client_for(build_app(store, probe))  # the secret from IDEMPOTENCY_TENANT_SECRET
    other = client_for(build_app(store, probe, tenant=AuthorizationTenant(OTHER_SECRET)))
    original = await first.post("/charge", content=b"x", headers={"Idempotency-Key": key})
    retry = await second.post("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == original.content
    assert probe.calls["charge"] == 1
    elsewhere = await other.post("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert "idempotent-replayed" not in elsewhere.headers
    assert probe.calls["charge"] == 2


async def test_a_basic_auth_tenant_is_no_password_verifier(key: str) -> None:
    """The review recovered ``hunter2`` from a stored SHA-256 with a four-word list; without the secret, the stored
    value matches no candidate header."""
    store = MemoryStore()
    events: list[Event] = []
    client = client_for(build_app(store, Probe(), on_event=events.append))
    basic = "Basic " + base64.b64encode(b"alice:hunter2").decode()
    await client.post("/charge", content=b"x", headers={"Idempotency-Key": key, "Authorization": basic})
    stored = events[-1].tenant
    assert await store.inspect(stored, key) is not None
    for password in ("password", "123456", "letmein", "hunter2"):
        candidate = b"Basic " + base64.b64encode(b"alice:" + password.encode())
        for derived in (hashlib.sha256(candidate).hexdigest(), hashlib.sha256(candidate.lower()).hexdigest()):
            assert derived not in stored
    assert "hunter2" not in stored
    assert base64.b64encode(b"alice:hunter2").decode() not in stored


def test_the_secret_comes_from_the_argument_first_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    header = scope_with(b"Bearer sk_x")
    monkeypatch.setenv("IDEMPOTENCY_TENANT_SECRET", OTHER_SECRET)
    assert AuthorizationTenant()(header) == AuthorizationTenant(OTHER_SECRET)(header)
    assert AuthorizationTenant(TEST_TENANT_SECRET)(header) != AuthorizationTenant()(header)
    assert AuthorizationTenant(OTHER_SECRET.encode())(header) == AuthorizationTenant(OTHER_SECRET)(header)


def test_a_missing_secret_stops_the_default_middleware_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEMPOTENCY_TENANT_SECRET")
    with pytest.raises(ValueError, match="IDEMPOTENCY_TENANT_SECRET") as refused:
        IdempotencyMiddleware(Starlette(), MemoryStore())
    message = str(refused.value)
    assert "IDEMPOTENCY_TENANT_SECRET" in message
    assert 'python -c "import secrets; print(secrets.token_hex(32))"' in message
    assert "tenant=" in message
    # An app with a resolver of its own needs no tenant secret, but a key for its request fingerprints all the same.
    with pytest.raises(ValueError, match="IDEMPOTENCY_FINGERPRINT_KEYS"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), tenant=header_tenant("x-account-id"))
    IdempotencyMiddleware(
        Starlette(), MemoryStore(), tenant=header_tenant("x-account-id"), fingerprint_keys="k:" + "x" * 32
    )


@pytest.mark.parametrize("secret", ["", "short", "x" * 31, b"x" * 31])
def test_an_empty_or_short_secret_is_refused(monkeypatch: pytest.MonkeyPatch, secret: str | bytes) -> None:
    with pytest.raises(ValueError, match="at least 32"):
        AuthorizationTenant(secret)
    if isinstance(secret, str) and secret:
        monkeypatch.setenv("IDEMPOTENCY_TENANT_SECRET", secret)
        with pytest.raises(ValueError, match=r"IDEMPOTENCY_TENANT_SECRET .* at least 32"):
            IdempotencyMiddleware(Starlette(), MemoryStore())


def test_an_empty_environment_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPOTENCY_TENANT_SECRET", "")
    with pytest.raises(ValueError, match="token_hex"):
        AuthorizationTenant()


def test_a_secret_that_is_not_text_or_bytes_is_refused() -> None:
    with pytest.raises(TypeError, match="secret"):
        AuthorizationTenant(12345678901234567890123456789012345)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [32, 63, 64, 65, 200])  # a secret longer than SHA-256's block is hashed first
@pytest.mark.parametrize("credentials", [b"sk_live_AbC", b"bearer " + b"t" * 500, b"basic \xff\x00"])
def test_the_tenant_is_the_standard_hmac_sha256_of_the_credentials(length: int, credentials: bytes) -> None:
    """Records written under one release must be found by the next: the tenant stays HMAC-SHA256 (RFC 2104), hex."""
    secret = bytes(range(length))
    expected = "hmac-sha256:" + hmac.new(secret, credentials, hashlib.sha256).hexdigest()
    assert AuthorizationTenant(secret)(scope_with(credentials)) == expected


def test_the_resolver_does_not_show_its_secret() -> None:
    assert TEST_TENANT_SECRET not in repr(AuthorizationTenant(TEST_TENANT_SECRET))


# -- defect 11: one credential, however HTTP lets it be spelled ----------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    [b"bearer sk_x", b"BEARER sk_x", b"Bearer  sk_x", b"Bearer\tsk_x", b" Bearer sk_x ", b"Bearer \t sk_x\t"],
)
def test_scheme_case_and_whitespace_do_not_change_the_tenant(spelling: bytes) -> None:
    resolve = AuthorizationTenant()
    assert resolve(scope_with(spelling)) == resolve(scope_with(b"Bearer sk_x"))


def test_credentials_stay_case_sensitive() -> None:
    resolve = AuthorizationTenant()
    assert resolve(scope_with(b"Bearer sk_x")) != resolve(scope_with(b"Bearer SK_X"))
    basic = base64.b64encode(b"alice:pw")
    assert resolve(scope_with(b"Basic " + basic)) != resolve(scope_with(b"Basic " + basic.swapcase()))
    assert resolve(scope_with(b"Bearer sk_x")) != resolve(scope_with(b"Token sk_x"))


async def test_three_spellings_of_one_bearer_token_run_the_handler_once(store: Store, key: str) -> None:
    probe = Probe()
    app = build_app(store, probe)
    replies = []
    for spelling in (b"Bearer x", b"bearer x", b"Bearer  x"):
        headers = [(b"authorization", spelling), (b"idempotency-key", key.encode())]
        replies.append(await asgi.call(app, "POST", "/charge", headers, [b"amount=10"]))
    assert [reply.status for reply in replies] == [201, 201, 201]
    assert [reply.replayed for reply in replies] == [False, True, True]
    assert probe.calls["charge"] == 1


@pytest.mark.parametrize("second", [b"Bearer sk_other", b"Bearer sk_x"], ids=["different", "identical"])
async def test_a_repeated_authorization_header_is_refused(store: Store, key: str, second: bytes) -> None:
    probe = Probe()
    app = build_app(store, probe)
    headers = [(b"authorization", b"Bearer sk_x"), (b"authorization", second), (b"idempotency-key", key.encode())]
    reply = await asgi.call(app, "POST", "/charge", headers, [b"x"])
    assert tenant_unknown(reply)
    assert probe.calls["charge"] == 0
    resolve = AuthorizationTenant()
    assert await record_count(store, [resolve(scope_with(b"Bearer sk_x")), ""], key) == 0


# -- defect 10: no tenant, no shared namespace ----------------------------------------------------------------


async def test_a_keyed_request_without_authorization_is_refused_before_the_store(store: Store, key: str) -> None:
    probe = Probe()
    events: list[Event] = []
    client = client_for(build_app(store, probe, on_event=events.append))
    del client.headers["Authorization"]
    response = await client.post("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert tenant_unknown(response)
    assert "credentials" in response.json()["detail"]
    assert probe.calls["charge"] == 0
    assert await store.inspect("", key) is None
    assert [(event.outcome, event.status) for event in events] == [(Outcome.TENANT_UNKNOWN, 400)]
    # Without a key the request is not the middleware's business: it passes through untouched.
    keyless = await client.post("/charge", content=b"x")
    assert keyless.status_code == 201
    assert probe.calls["charge"] == 1


async def test_an_empty_authorization_header_is_no_credential(key: str) -> None:
    probe = Probe()
    app = build_app(MemoryStore(), probe)
    for empty in (b"", b"  "):
        headers = [(b"authorization", empty), (b"idempotency-key", key.encode())]
        assert tenant_unknown(await asgi.call(app, "POST", "/charge", headers, [b"x"]))
    assert probe.calls["charge"] == 0


def cookie_app(store: Store, **options: Any) -> tuple[Starlette, Probe]:
    """A cookie-authenticated app whose responses set a fresh session cookie and a CSRF token."""
    probe = Probe()

    async def checkout(request: Request) -> Response:
        probe.calls["checkout"] += 1
        user = request.cookies["session"]
        response = JSONResponse({"user": user, "csrf": f"csrf-of-{user}"}, status_code=201)
        response.set_cookie("session", f"{user}-renewed")
        return response

    app = Starlette(routes=[Route("/checkout", checkout, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app, probe


async def test_cookie_users_never_get_each_others_response(store: Store, key: str) -> None:
    """The review's repro: user B sends user A's key and body with B's own session cookie. With the default
    resolver neither is served from a shared namespace; with a resolver that reads the session, each is their own
    tenant."""
    app, probe = cookie_app(store)
    transport = httpx.ASGITransport(app=app)
    replies = {}
    for user in ("alice", "bob"):
        async with httpx.AsyncClient(transport=transport, base_url="http://test", cookies={"session": user}) as c:
            replies[user] = await c.post("/checkout", json={"cart": 1}, headers={"Idempotency-Key": key})
    for user in ("alice", "bob"):
        assert tenant_unknown(replies[user])
        assert "set-cookie" not in replies[user].headers
    assert probe.calls["checkout"] == 0

    def by_session(scope: Any) -> str | None:
        return Request(scope).cookies.get("session")

    app, probe = cookie_app(store, tenant=by_session)
    transport = httpx.ASGITransport(app=app)
    for user in ("alice", "bob"):
        async with httpx.AsyncClient(transport=transport, base_url="http://test", cookies={"session": user}) as c:
            replies[user] = await c.post("/checkout", json={"cart": 1}, headers={"Idempotency-Key": key})
    assert replies["bob"].json() == {"user": "bob", "csrf": "csrf-of-bob"}
    assert "alice" not in replies["bob"].headers["set-cookie"]
    assert "idempotent-replayed" not in replies["bob"].headers
    assert probe.calls["checkout"] == 2


async def test_the_operator_is_warned_once_per_middleware(key: str, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(build_app(MemoryStore(), Probe()))
    del client.headers["Authorization"]
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        for n in range(3):
            await client.post("/charge", content=b"x", headers={"Idempotency-Key": f"{key}-{n}"})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "idempotency_tenant_unknown" in warnings[0]
    assert "tenant=" in warnings[0]
    assert "anonymous=" in warnings[0]


async def test_anonymous_opt_in_shares_one_namespace(store: Store, key: str) -> None:
    probe = Probe()
    app = build_app(store, probe, tenant=AuthorizationTenant(anonymous="public"))
    first, second = client_for(app), client_for(app)
    del first.headers["Authorization"], second.headers["Authorization"]
    await first.post("/charge", content=b"from-one", headers={"Idempotency-Key": key})
    other = await second.post("/charge", content=b"from-one", headers={"Idempotency-Key": key})
    assert other.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1
    assert await store.inspect("public", key) is not None
    # Authenticated requests still get their own tenant, and an ambiguous one is still refused.
    authenticated = await client_for(app).post("/charge", content=b"from-one", headers={"Idempotency-Key": key})
    assert "idempotent-replayed" not in authenticated.headers
    headers = [(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b"), (b"idempotency-key", key.encode())]
    assert tenant_unknown(await asgi.call(app, "POST", "/charge", headers, [b"from-one"]))


async def test_header_tenant_refuses_a_missing_header_unless_anonymous_is_named(key: str) -> None:
    probe = Probe()
    strict = client_for(build_app(MemoryStore(), probe, tenant=header_tenant("x-account-id")))
    assert tenant_unknown(await strict.post("/charge", content=b"x", headers={"Idempotency-Key": key}))
    with_account = {"Idempotency-Key": key, "X-Account-Id": "acct_1"}
    assert (await strict.post("/charge", content=b"x", headers=with_account)).status_code == 201
    assert probe.calls["charge"] == 1
    store = MemoryStore()
    shared = client_for(build_app(store, probe, tenant=header_tenant("X-Account-Id", anonymous="guests")))
    assert (await shared.post("/charge", content=b"x", headers={"Idempotency-Key": key})).status_code == 201
    assert await store.inspect("guests", key) is not None


def test_header_tenant_refuses_a_repeated_header() -> None:
    resolve = header_tenant("x-account-id", anonymous="guests")
    assert resolve({"headers": [(b"x-account-id", b"a"), (b"x-account-id", b"b")]}) is None
    assert resolve({"headers": [(b"x-account-id", b"a")]}) == "a"
    assert resolve({"headers": []}) == "guests"


def test_bad_resolver_options_are_refused() -> None:
    with pytest.raises(TypeError, match="anonymous"):
        AuthorizationTenant(anonymous=b"public")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="anonymous"):
        header_tenant("x-account-id", anonymous=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="header"):
        header_tenant("")


async def test_a_resolver_must_return_a_str_or_none(key: str) -> None:
    client = client_for(build_app(MemoryStore(), Probe(), tenant=lambda scope: 42))
    with pytest.raises(TypeError, match="str or None"):
        await client.post("/charge", content=b"x", headers={"Idempotency-Key": key})


# -- the upgrade: records written under the old SHA-256 tenant ------------------------------------------------


async def test_legacy_fallback_finds_records_written_before_the_upgrade(store: Store, key: str) -> None:
    """A retry of a request made before the upgrade (its record under the old SHA-256 tenant) replays; a new
    request goes to the new tenant, so no new password verifier is written."""
    legacy = hashlib.sha256(b"Bearer sk_test_alice").hexdigest()
    claim = await store.claim(legacy, key, b"f" * 32, lease=60, ttl=3600)
    await store.complete(legacy, key, claim.fence, StoredResponse(201, [], b"before the upgrade", 18))

    probe = Probe()
    events: list[Event] = []
    client = client_for(build_app(store, probe, tenant=legacy_sha256_fallback(store), on_event=events.append))
    # Same key, same (old) tenant: the stored fingerprint differs from this request's, so the store says 422,
    # which proves the record was found; the handler did not run.
    found = await client.post("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert found.json()["code"] == "idempotency_key_reused"
    assert events[-1].tenant == legacy
    fresh = await client.post("/charge", content=b"x", headers={"Idempotency-Key": "new-" + key})
    assert fresh.status_code == 201
    assert events[-1].tenant == AuthorizationTenant()(scope_with(b"Bearer sk_test_alice"))
    assert await store.inspect(legacy, "new-" + key) is None
    assert probe.calls["charge"] == 1


async def test_legacy_fallback_replays_an_old_record(key: str) -> None:
    old_store = MemoryStore()
    probe = Probe()
    old_app = build_app(
        old_store, probe, tenant=lambda scope: hashlib.sha256(dict(scope["headers"])[b"authorization"]).hexdigest()
    )
    original = await client_for(old_app).post("/charge", content=b"x", headers={"Idempotency-Key": key})
    new_app = build_app(old_store, probe, tenant=legacy_sha256_fallback(old_store))
    retry = await client_for(new_app).post("/charge", content=b"x", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == original.content
    assert probe.calls["charge"] == 1


async def test_legacy_fallback_ignores_expired_records_and_keeps_refusing_unknown_tenants(key: str) -> None:
    store = MemoryStore(clock=lambda: time.time() - 7200)  # the record was claimed two hours ago, for one hour
    legacy = hashlib.sha256(b"Bearer sk_test_alice").hexdigest()
    await store.claim(legacy, key, b"f" * 32, lease=60, ttl=3600)
    resolve = legacy_sha256_fallback(store)
    headers = [(b"authorization", b"Bearer sk_test_alice"), (b"idempotency-key", key.encode())]
    assert await resolved(resolve, {"headers": headers}) == AuthorizationTenant()(scope_with(b"Bearer sk_test_alice"))
    assert await resolved(resolve, {"headers": [(b"idempotency-key", key.encode())]}) is None
    anonymous = legacy_sha256_fallback(store, AuthorizationTenant(anonymous="public"))
    assert await resolved(anonymous, {"headers": [(b"idempotency-key", key.encode())]}) == "public"


async def test_legacy_fallback_leaves_an_outage_to_the_claim(key: str) -> None:
    """A store that cannot be reached answers the claim with 503; the lookup before it must not turn that into a
    500."""

    class Down(MemoryStore):
        async def inspect(self, tenant: str, key: str) -> Any:
            raise StoreUnavailable("down")

    resolve = legacy_sha256_fallback(Down())
    headers = [(b"authorization", b"Bearer sk_test_alice"), (b"idempotency-key", key.encode())]
    assert await resolved(resolve, {"headers": headers}) == AuthorizationTenant()(scope_with(b"Bearer sk_test_alice"))


async def test_assert_idempotent_names_a_missing_tenant(key: str) -> None:
    """A newcomer's first test, without credentials, is told why every request got 400."""
    app = build_app(MemoryStore(), Probe())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        with pytest.raises(AssertionError, match="idempotency_tenant_unknown"):
            await assert_idempotent(client, "POST", "/charge", content=b"x", times=3)


async def test_assert_idempotent_passes_an_endpoint_whose_own_answer_is_a_409(key: str) -> None:
    """An endpoint's final answer may be a 409 of its own (a state conflict: the order is already shipped), recorded
    and replayed: one answer from running it, not a conflict of the middleware's (which says so in its
    Idempotency-Problem header). It failed as "answered 0 times"."""
    runs: list[int] = []

    async def ship(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"error": "already shipped"}, status_code=409)

    app = Starlette(routes=[Route("/ship", ship, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    async with client_for(app) as client:
        report = await assert_idempotent(client, "POST", "/ship", content=b"x", times=3, key=key)
    assert (report.executed, report.replayed + report.in_progress) == (1, 3)
    assert set(report.statuses) == {409}
    assert runs == [1]


def test_bare_credentials_keep_their_case() -> None:
    """The auth scheme is case-insensitive (RFC 9110 §11.1), the credentials themselves are not: a value with no
    scheme, the bare API key many APIs take (``Authorization: sk_live_AbC...``), keeps its case, so two keys that
    differ only in letter case are two tenants and never see each other's records."""
    resolve = AuthorizationTenant(TEST_TENANT_SECRET)
    assert resolve(scope_with(b"sk_live_AbCdEf")) != resolve(scope_with(b"sk_live_abcdef"))


async def test_header_tenant_refuses_an_empty_header(pg_store: PostgresStore) -> None:
    """``header_tenant("x-account-id")`` gives a request whose header is present but empty no tenant, as
    ``AuthorizationTenant`` does an empty Authorization header: it is refused (400 ``idempotency_tenant_unknown``)
    rather than put in a namespace shared by every caller whose proxy passes the header empty, and a second caller
    never gets the first caller's response. docs/design.md §4: a keyed request whose tenant cannot be told "never
    silently shares a namespace with other anonymous callers"."""

    async def balance(request: Request) -> Response:
        return JSONResponse({"owner": request.headers.get("x-caller")}, status_code=201)

    app = Starlette(routes=[Route("/payouts", balance, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, tenant=header_tenant("x-account-id"))
    key = str(uuid.uuid4())
    async with client_for(app) as client:
        first = await client.post("/payouts", headers={"Idempotency-Key": key, "x-account-id": "", "x-caller": "a"})
        second = await client.post("/payouts", headers={"Idempotency-Key": key, "x-account-id": "", "x-caller": "b"})
    assert (first.status_code, second.status_code) == (400, 400)  # no tenant, so no shared namespace
    assert second.json()["code"] == "idempotency_tenant_unknown"  # and never caller a's response
    assert header_tenant("x-account-id")({"headers": [(b"x-account-id", b"")]}) is None
