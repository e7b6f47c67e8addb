"""The mesh API both front doors call: one owner of who may see and call what, with a real
registry (not started: its replicas set by hand) and no network."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from common.errors import PermissionDenied, Unauthenticated
from common.mesh_state import ModelEntry, WorkerInfo
from common.tenancy import TenantPolicy
from router.forwarding.dispatch import Dispatcher
from router.forwarding.registry import Registry
from router.forwarding.replica import Replica
from router.mesh import KEY_IN_HEADER, KEY_IN_METADATA, MeshApi
from router.tenancy.auth import Auth, Tenant
from router.tenancy.limits import Limiter
from tests.router.fakes import FakeChannel


def mesh(auth: Auth | None = None) -> MeshApi:
    registry = Registry("redis://127.0.0.1:1/0", [])  # never started: nothing connects
    for worker, models in [("w0", {"mlp": ["1"]}), ("w1", {"minilm": ["1", "2"], "mlp": ["1"]})]:
        info = WorkerInfo(
            worker, "127.0.0.1:1", {m: ModelEntry(v, 8) for m, v in models.items()}, "CPU"
        )
        registry.replicas[worker] = Replica(info, FakeChannel())  # type: ignore[arg-type]
    return MeshApi(registry, Dispatcher(registry, None), auth)


ACME = Tenant("acme", TenantPolicy(models=("mlp",)), "k1")


def test_the_index_holds_what_the_tenant_may_use() -> None:
    m = mesh()
    everything = [(x.name, x.version) for x in m.repository_index(None).models]
    assert everything == [("minilm", "1"), ("minilm", "2"), ("mlp", "1")]
    assert [(x.name, x.version) for x in m.repository_index(ACME).models] == [("mlp", "1")]
    assert m.ready() and m.server_metadata().extensions[-1] == "execution_provider/CPU"


def test_authorize_refuses_a_model_the_tenant_may_not_call_served_or_not() -> None:
    m = mesh()
    m.authorize(None, "anything")  # auth off
    m.authorize(ACME, "mlp")
    for model in ("minilm", "not-served"):
        with pytest.raises(PermissionDenied, match=f"may not call model '{model}'"):
            m.authorize(ACME, model)
    assert m.allows(ACME, "mlp") and not m.allows(ACME, "minilm") and m.allows(None, "minilm")


def test_metadata_of_a_model_is_authorized_before_any_replica_is_asked() -> None:
    m = mesh()
    with pytest.raises(PermissionDenied):
        asyncio.run(m.model_metadata(ACME, "minilm", ""))
    with pytest.raises(PermissionDenied):
        asyncio.run(m.statistics(ACME, "minilm", ""))


def test_a_call_without_a_key_is_told_where_its_transport_carries_one() -> None:
    assert asyncio.run(mesh().authenticate(None)) is None  # auth off: no tenant

    async def refusal(sent_as: str) -> str:
        redis = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # the no-key path reads none
        m = mesh(Auth(redis, Limiter(redis)))
        with pytest.raises(Unauthenticated) as e:
            await m.authenticate(None, sent_as)
        await redis.aclose()
        return e.value.message

    assert "send the metadata 'authorization: Bearer" in asyncio.run(refusal(KEY_IN_METADATA))
    assert "send the header 'Authorization: Bearer" in asyncio.run(refusal(KEY_IN_HEADER))
