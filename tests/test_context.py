"""What a handler learns about its request: the downstream key it sends a payment provider."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idempotency_mw._context import IdempotencyContext


@pytest.mark.parametrize(
    ("tenant", "key", "label", "derived"),
    [
        ("tenant-a", "order-42", "psp-charge", "c582342bafafff3ea21c77be10d4ac5db63042430841f4a2b1e018d74e068ebd"),
        (
            "acct_é",
            "7f1c2a9e-5b0d-4e7a-9c3f-2d8e6b1a0f45",
            "refund",
            "339d14d5850efdc213fae98400520d9df2bd7a5e3262119877bcb82876293962",
        ),
        ("t", "k", "", "f24389241dbcf917e6a7f24ec4fc3ec9656da7efc5748cdd79a0fc8a4ba761a4"),
    ],
)
def test_the_downstream_key_is_the_same_in_every_release(tenant: str, key: str, label: str, derived: str) -> None:
    """The provider deduplicates by this value: a retry after an upgrade that derived another one would charge
    twice."""
    assert IdempotencyContext(tenant, key).downstream_key(label) == derived


def test_a_nul_in_a_tenant_or_label_cannot_make_another_requests_key() -> None:
    """Joined with NUL bytes, tenant "a\\0b" with key "k" and label "c" and tenant "a" with key "b" and label
    "k\\0c" were the same bytes, so one tenant's request could send another's downstream key."""
    assert IdempotencyContext("a\0b", "k").downstream_key("c") != IdempotencyContext("a", "b").downstream_key("k\0c")
    assert IdempotencyContext("a", "k").downstream_key("\0") != IdempotencyContext("a\0", "k").downstream_key("")


def test_a_request_without_a_key_has_no_downstream_key() -> None:
    with pytest.raises(LookupError):
        IdempotencyContext("t", None).downstream_key("psp")


@given(st.text("a\0é", max_size=12))
def test_no_two_requests_spelling_the_same_characters_share_a_downstream_key(joined: str) -> None:
    """Every (tenant, key, label) that, joined with NULs, spells ``joined``: what a NUL-joined hash merged."""
    nuls = [index for index, char in enumerate(joined) if char == "\0"]
    requests = [(joined[:i], joined[i + 1 : j], joined[j + 1 :]) for i, j in itertools.combinations(nuls, 2)]
    requests = [(tenant, key, label) for tenant, key, label in requests if key and "\0" not in key]
    derived = {IdempotencyContext(tenant, key).downstream_key(label) for tenant, key, label in requests}
    assert len(derived) == len(requests)


# A key never holds a NUL (keys.py refuses control characters); tenants and labels may.
@given(
    st.lists(
        st.tuples(st.text("a\0é", max_size=3), st.text("ab", min_size=1, max_size=2), st.text("a\0é", max_size=3)),
        unique=True,
        max_size=40,
    )
)
def test_different_requests_or_labels_never_share_a_downstream_key(requests: list[tuple[str, str, str]]) -> None:
    derived = {IdempotencyContext(tenant, key).downstream_key(label) for tenant, key, label in requests}
    assert len(derived) == len(requests)
