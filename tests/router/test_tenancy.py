"""Tenant records as Redis holds them, and what a tenant's call charges (no network)."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Unauthenticated
from common.mesh_state import model_key, parse_model_key
from common.tenancy import KeyRecord, TenantPolicy, check_tenant, key_hash, key_id_of, new_key
from router.money.accounting import Accounting, Receipt, Tokens
from router.tenancy.auth import _bearer
from router.tenancy.limits import seconds_to_next_month


def test_a_key_is_stored_as_its_hash_and_named_by_its_id() -> None:
    key_id, key = new_key()
    assert key_id_of(key) == key_id
    assert len(key_hash(key)) == 64 and key not in key_hash(key)
    assert key_id_of("ms_zzzz_short") is None


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"models": []}', "'models' must be a non-empty list"),
        ('{"models": ["*"], "requests_per_second": -1}', "'requests_per_second' must be"),
        ('{"models": ["*"], "burst": 1.5}', "'burst' must be an integer"),
        ('{"models": ["*"], "admin": "yes"}', "'admin' must be true or false"),
        ('["*"]', "a tenant policy is a JSON object"),
    ],
)
def test_a_bad_policy_is_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        TenantPolicy.from_json(text)


def test_policy_and_key_record_round_trip() -> None:
    policy = TenantPolicy(models=("mlp",), requests_per_second=2.5, burst=4, admin=True)
    assert TenantPolicy.from_json(policy.to_json()) == policy
    assert policy.allows("mlp") and not policy.allows("minilm")
    record = KeyRecord("acme", "0123abcd", 7)
    assert KeyRecord.from_json(record.to_json()) == record
    with pytest.raises(ValueError, match="tenant name"):
        check_tenant("Acme|x")


def test_bearer_metadata() -> None:
    key = new_key()[1]
    assert _bearer((("authorization", f"Bearer {key}"),)) == key
    for metadata, says in [
        ((), "no API key"),
        ((("authorization", key),), "must be 'Bearer <API key>'"),
        ((("authorization", "Bearer nope"),), "not one this mesh issues"),
    ]:
        with pytest.raises(Unauthenticated, match=says):
            _bearer(metadata)


def test_batch_keys_carry_the_tenant() -> None:
    assert parse_model_key(model_key("mlp", "1")) == ("mlp", "1", "")
    assert parse_model_key(model_key("mlp", "1", "acme")) == ("mlp", "1", "acme")


def test_a_tenants_calls_charge_its_tokens_and_spend_and_a_refund_gives_it_back() -> None:
    charged: list[tuple[str, int, int]] = []

    async def run() -> dict:
        accounting = Accounting("redis://127.0.0.1:1/0", "router-t")  # never flushed here
        accounting.charge = lambda *a: charged.append(a)
        tokens = Tokens(prompt=10, completion=30, revenue_micro_usd=7)
        accounting.record("llm", "1", True, 100, 0, tokens, "stop", tenant="acme")
        accounting.record("mlp", "1", False, 250, 0, tenant="acme")  # an error: no spend
        accounting.record("mlp", "1", True, 250, 0)  # auth off: nobody to charge
        accounting.refund(Receipt("llm", "1", 100, tokens, "stop", tenant="acme"))
        usage = dict(accounting._current.usage)
        await accounting.redis.aclose()
        return usage

    usage = asyncio.run(run())
    assert charged == [("acme", 40, 107), ("acme", 0, -107)]
    assert set(usage) == {"llm|1|acme", "mlp|1|acme", "mlp|1"}


def test_the_spend_cap_resets_at_the_next_utc_month() -> None:
    import datetime as dt

    now = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)
    assert seconds_to_next_month(now) == 3600
