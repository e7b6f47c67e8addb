"""Tenants, keys and trust on a real secured mesh: a redis-server with ACL users per role, a
worker serving mutual TLS, routers with API keys and TLS, a real ledger consumer."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
import tritonclient.grpc as triton

from common import mesh_state
from common.errors import ResourceExhausted
from common.tenancy import PRICE_PER_CALL, TenantPolicy
from devmesh.certs import make_certs
from devmesh.redis_acl import make_users
from devmesh.testing import Mesh, mlp_config, mlp_repository, mlp_request
from ledger.config import LedgerConfig
from ledger.consumer import Consumer
from ledger.store import Store
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from router.tenancy import keys as keys_cli
from router.tenancy.keys import TenantAdmin
from router.tenancy.limits import LEASE_TTL_S, Limiter

PRICE = 250  # micro-USD per mlp call (mlp_config)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("secure")
    mesh = Mesh(root / "logs")
    mesh.certs = make_certs(root / "certs")
    mesh.users = make_users(root / "secrets")
    mesh.auth = True
    mesh.start_redis()
    try:
        repo = mlp_repository(root / "repo", mlp_config(max_batch=32))
        mesh.add_worker(repo)
        mesh.wait_registered(1)
        mesh.start_router("--auth-cache-seconds", "0.2")
        yield mesh
    finally:
        mesh.stop(kill=True)


def admin(mesh: Mesh) -> TenantAdmin:
    return mesh.tenant_admin()


def key_for(mesh: Mesh, tenant: str, policy: TenantPolicy) -> tuple[str, str]:
    admin(mesh).set_tenant(tenant, policy)
    return admin(mesh).create_key(tenant)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def stub(mesh: Mesh, address: str | None = None) -> pb_grpc.GRPCInferenceServiceStub:
    credentials = mesh.client_credentials()
    assert credentials is not None
    channel = grpc.secure_channel(address or mesh.router_address, credentials)
    return pb_grpc.GRPCInferenceServiceStub(channel)


def code_of(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value


def test_each_status_from_a_real_client(secure: Mesh) -> None:
    s = stub(secure)
    _, key = key_for(secure, "acme", TenantPolicy(models=("mlp",)))
    # no key, not a Bearer, not a key this mesh issues, unknown key
    for metadata, says in [
        ((), "no API key"),
        ((("authorization", "Basic abc"),), "must be 'Bearer <API key>'"),
        (bearer("hunter2"), "not one this mesh issues"),
        (bearer("ms_00000000_" + "a" * 22), "unknown or revoked"),
    ]:
        e = code_of(lambda m=metadata: s.ModelInfer(mlp_request(), timeout=5, metadata=m))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
        assert says in e.details()
    assert s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key)).model_name == "mlp"
    # tritonclient over TLS with the key as a header, as any KServe v2 client would send it
    ca = secure.certs.ca if secure.certs else None
    client = triton.InferenceServerClient(
        secure.router_address, ssl=True, root_certificates=str(ca)
    )
    x = triton.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    out = client.infer("mlp", [x], headers={"authorization": f"Bearer {key}"})
    assert out.as_numpy("OUTPUT0").shape == (1, 4)
    with pytest.raises(triton.InferenceServerException, match="UNAUTHENTICATED|no API key"):
        client.infer("mlp", [x])
    # a model the tenant may not call: refused whether or not the mesh serves it
    _, other = key_for(secure, "limited", TenantPolicy(models=("minilm",)))
    for call in (
        lambda: s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(other)),
        lambda: s.ModelConfig(pb.ModelConfigRequest(name="mlp"), timeout=5, metadata=bearer(other)),
    ):
        e = code_of(call)
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may not call model 'mlp'" in e.details()
    index = s.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=5, metadata=bearer(other))
    assert not index.models  # it sees none of the models it may not use
    # a stream: the key checked at its start, the model per request
    e = code_of(lambda: list(s.ModelStreamInfer(iter([mlp_request()]), timeout=5)))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    replies = list(s.ModelStreamInfer(iter([mlp_request()]), timeout=5, metadata=bearer(other)))
    assert replies[0].error_message.startswith("PERMISSION_DENIED:")
    # health stays open for probes
    assert s.ServerLive(pb.ServerLiveRequest(), timeout=5).live


def test_rate_limit_says_the_limit_and_when_it_resets(secure: Mesh) -> None:
    s = stub(secure)
    _, key = key_for(secure, "bursty", TenantPolicy(requests_per_second=2, burst=3))
    codes = Counter()
    trailers = {}
    for _ in range(5):
        try:
            s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key))
            codes["OK"] += 1
        except grpc.RpcError as e:
            codes[e.code().name] += 1
            trailers = dict(e.trailing_metadata() or ())
            details = e.details()
    assert codes == {"OK": 3, "RESOURCE_EXHAUSTED": 2}
    assert "2 requests per second (burst 3)" in details
    assert trailers["limit"] == "rps"
    assert 0 < float(trailers["retry-after"]) <= 0.5
    time.sleep(float(trailers["retry-after"]))
    s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key))  # refilled as it said


def test_monthly_spend_cap(secure: Mesh) -> None:
    s = stub(secure)
    _, key = key_for(secure, "thrifty", TenantPolicy(monthly_spend_cap_micro_usd=2 * PRICE))
    for _ in range(2):
        s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key))
    time.sleep(0.3)  # the charges reach Redis in the background
    e = code_of(lambda: s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key)))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "monthly spend cap: 500 micro-USD this month" in e.details()
    retry = float(dict(e.trailing_metadata() or ())["retry-after"])
    assert 0 < retry <= 31 * 86400  # the first of next month


def test_tokens_per_minute_bucket(secure: Mesh) -> None:
    """The limiter's scripts on the mesh's Redis as the router user: a call that used more
    tokens than the minute allows leaves the bucket overdrawn, and the next is refused."""

    async def run() -> str:
        client = redis.asyncio.from_url(
            f"redis://router@127.0.0.1:{secure.redis_port}/0",
            password=secure.users.password("router") if secure.users else None,
        )
        limiter = Limiter(client)
        policy = TenantPolicy(tokens_per_minute=600)
        await limiter.admit("wordy", policy)  # a full bucket
        limiter.charge("wordy", policy, 900, 0)
        await limiter.flush()
        try:
            await limiter.admit("wordy", policy)
        except Exception as e:
            await client.aclose()
            return str(e) + " " + str(getattr(e, "trailers", ""))
        await client.aclose()
        return "admitted"

    said = asyncio.run(run())
    assert "over its tokens per minute: 600 tokens per minute" in said
    retry = float(said.split("'retry-after', '")[1].split("'")[0])
    assert 29 < retry <= 31  # 300 tokens overdrawn (+1) at 10 tokens per second


def test_rate_limit_decisions_come_from_a_lease(mesh: Mesh) -> None:
    """One router process's limiter on a quiet Redis: calls are decided from its lease (a Lua
    script per renewal, not per call), a refusal is kept until the bucket refills, and a
    lease's unused rest goes back to the shared bucket once the lease expires."""
    policy = TenantPolicy(requests_per_second=100, burst=100)  # leases of at most 10
    lender = TenantPolicy(requests_per_second=100, burst=1000)
    client = mesh.redis_client()

    def scripts() -> int:
        stats: dict = client.info("commandstats")  # type: ignore[assignment]
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    def level(tenant: str) -> float:
        return float(client.hget(mesh_state.limit_key(tenant, "rps"), "level") or "nan")

    async def run() -> tuple[Counter[str], int, float, float, float]:
        limiter = Limiter(redis.asyncio.from_url(mesh.redis_url))
        limiter.start()
        codes: Counter[str] = Counter()
        before = scripts()
        for _ in range(300):  # a call a millisecond, from a full bucket: past its burst
            try:
                await limiter.admit("busy", policy)
                codes["OK"] += 1
            except ResourceExhausted as e:
                codes[dict(e.trailers)["limit"]] += 1
            await asyncio.sleep(0.001)
        ran = scripts() - before
        for _ in range(3):  # a few calls: the lease takes more than they use
            await limiter.admit("lender", lender)
            await asyncio.sleep(0.001)
        held = level("lender")
        await asyncio.sleep(3 * LEASE_TTL_S)  # expired, and swept back to the bucket
        back = level("lender")
        await limiter.close()
        await limiter.redis.aclose()
        return codes, ran, held, back, level("busy")

    codes, ran, held, back, _ = asyncio.run(run())
    assert codes["OK"] >= 100 and codes["rps"] > 0, codes  # the burst, then refusals
    assert ran * 4 < sum(codes.values()), (ran, codes)  # most calls decided locally
    # The bucket is written only when tokens are taken or given back (none are taken after
    # the 3 calls): it held the 3 calls' tokens and the lease's rest, and then the rest came
    # back (with the refill since).
    assert held < 996, held
    assert back >= 997, (held, back)


def test_model_config_hides_prices_unless_admin(secure: Mesh) -> None:
    s = stub(secure)
    _, plain = key_for(secure, "client-co", TenantPolicy())
    _, boss = key_for(secure, "ops", TenantPolicy(admin=True))
    request = pb.ModelConfigRequest(name="mlp")
    seen = s.ModelConfig(request, timeout=5, metadata=bearer(plain)).config.parameters
    assert PRICE_PER_CALL not in seen
    assert "meshserve.execution_provider" in seen  # the rest is still there
    full = s.ModelConfig(request, timeout=5, metadata=bearer(boss)).config.parameters
    assert full[PRICE_PER_CALL].string_value == str(PRICE)


def test_keys_cli_and_revocation(secure: Mesh, capsys: pytest.CaptureFixture) -> None:
    users = secure.users
    assert users is not None
    url = f"redis://admin@127.0.0.1:{secure.redis_port}/0"
    common = ["--redis-url", url, "--redis-password-file", str(users.password_file("admin"))]
    common += ["--db", secure.ledger_db]
    assert keys_cli.main(["tenants", "set", "--tenant", "cli-co", "--models", "mlp", *common]) == 0
    assert keys_cli.main(["keys", "create", "--tenant", "cli-co", *common]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    key_id = key.split("_")[1]
    assert keys_cli.main(["keys", "list", "--tenant", "cli-co", *common]) == 0
    assert key_id in capsys.readouterr().out
    stored = secure.redis_client("admin").keys("meshserve:apikey:*")
    assert all(key not in k for k in stored)  # only its hash is a key
    s = stub(secure)
    s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key))
    assert keys_cli.main(["keys", "revoke", "--tenant", "cli-co", "--key-id", key_id, *common]) == 0
    time.sleep(0.4)  # the router's cache (--auth-cache-seconds 0.2)
    e = code_of(lambda: s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key)))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert secure.router is not None
    assert key.split("_", 2)[2] not in secure.router.log.read_text()  # never logged


def test_worker_refuses_a_client_without_the_mesh_certificate(secure: Mesh) -> None:
    worker = next(iter(secure.workers))
    ca = secure.certs.ca.read_bytes() if secure.certs else b""
    outsiders = [
        grpc.insecure_channel(worker),  # plaintext
        grpc.secure_channel(worker, grpc.ssl_channel_credentials(ca)),  # TLS, no cert
    ]
    for channel in outsiders:
        e = code_of(
            lambda c=channel: pb_grpc.GRPCInferenceServiceStub(c).ModelInfer(
                mlp_request(), timeout=5
            )
        )
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    credentials = secure.worker_credentials()
    assert credentials is not None
    with grpc.secure_channel(worker, credentials) as channel:  # the router's certificate
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(mlp_request(), timeout=5)
    assert reply.model_name == "mlp"


def test_redis_users_write_only_their_own_keys(secure: Mesh) -> None:
    worker = secure.redis_client("worker")
    for forge in (
        lambda: worker.xadd("meshserve:calls:router-x", {"usage": "{}", "at_ms": "1"}),
        lambda: worker.hset("meshserve:usage:router-x", "mlp|1|revenue_micro_usd", 10**9),
        lambda: worker.set(mesh_state.tenant_key("acme"), "{}"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forge()
    router = secure.redis_client("router")
    with pytest.raises(redis.exceptions.NoPermissionError):
        router.set(mesh_state.worker_key("worker-x"), "{}")  # no registrations from a router
    ledger = secure.redis_client("ledger")
    with pytest.raises(redis.exceptions.NoPermissionError):
        ledger.xadd("meshserve:calls:router-x", {"usage": "{}", "at_ms": "1"})
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=secure.redis_port, socket_timeout=2).ping()  # default user off


def test_forged_entries_do_not_change_the_ledger(secure: Mesh, tmp_path: Path) -> None:
    s = stub(secure)
    _, key = key_for(secure, "payer", TenantPolicy())
    for _ in range(3):
        s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key))
    router = secure.redis_client("router")
    # Forgeries a router user could write: a batch for a tenant the mesh does not know, and
    # one whose counts do not add up. (A worker user cannot write a batch at all: above.)
    stream = mesh_state.calls_stream("router-forged")
    router.sadd(mesh_state.ROUTERS, "router-forged")
    router.xadd(stream, {"usage": '{"mlp|1|ghost": [5, 5, 0, 1250, 0]}', "at_ms": "1"}, id="1-1")
    router.xadd(stream, {"usage": '{"mlp|1|payer": [1, 5, 0, 99, 0]}', "at_ms": "1"}, id="1-2")
    # A forged registration (with the worker user's credentials) pricing mlp at 0
    info = mesh_state.WorkerInfo(
        "worker-forged",
        "127.0.0.1:1",
        {"mlp": mesh_state.ModelEntry(["1"], 8, 0, 0)},
        "CPUExecutionProvider",
        started_ms=mesh_state.now_ms(),
    )
    worker = secure.redis_client("worker")
    worker.set(mesh_state.worker_key(info.id), info.to_json(), px=5000)
    worker.zadd(mesh_state.WORKERS, {info.id: mesh_state.now_ms()})
    time.sleep(0.5)  # the router's batches of the 3 calls are in their stream
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    password = secure.users.password("ledger") if secure.users else None
    url = f"redis://ledger@127.0.0.1:{secure.redis_port}/0"
    consumer = Consumer(url, store, LedgerConfig(), password)
    try:
        consumer.flush()
        usage = store.tenant_usage()
        assert ("ghost", "mlp") not in usage
        assert usage[("payer", "mlp")]["success"] == 3
        assert usage[("payer", "mlp")]["revenue_micro_usd"] == 3 * PRICE
        reasons = [r for router_id, _, r in store.quarantine() if router_id == "router-forged"]
        assert len(reasons) == 2
        assert any("tenant 'ghost' is not one the mesh knows" in r for r in reasons)
        assert store.models().get("mlp", (PRICE, 0))[0] == PRICE  # not repriced to 0
    finally:
        consumer.close()
        store.close()
        worker.delete(mesh_state.worker_key(info.id))
        worker.zrem(mesh_state.WORKERS, info.id)
    with grpc.secure_channel(secure.router_address, secure.client_credentials()) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            mlp_request(), timeout=5, metadata=bearer(key)
        )
    assert reply.model_name == "mlp"  # the forged replica was never picked


async def _hammer(channel: grpc.aio.Channel, key: str, seconds: float) -> Counter[str]:
    codes: Counter[str] = Counter()
    s = pb_grpc.GRPCInferenceServiceStub(channel)
    stop_at = time.monotonic() + seconds

    async def caller() -> None:
        n = 0
        while time.monotonic() < stop_at and n < 20_000:  # bounded in time and count
            n += 1
            try:
                await s.ModelInfer(mlp_request(n), timeout=5, metadata=bearer(key))
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

    await asyncio.gather(*(caller() for _ in range(4)))
    return codes


def test_rate_limit_holds_within_one_percent_over_two_routers(secure: Mesh) -> None:
    # A rate this shared 2-core machine can exceed, and a burst of a second's worth: a
    # client that stalls for less than that (waiting for a core) loses no token.
    rate, burst, seconds = 50, 50, 6.0
    _, key = key_for(secure, "shared", TenantPolicy(requests_per_second=rate, burst=burst))
    second, process = secure.spawn_router("--auth-cache-seconds", "0.2")
    secure.others.append(process)
    clock = secure.redis_client("admin")

    def redis_now() -> float:
        s, us = clock.time()
        return s + us / 1e6

    async def both() -> tuple[list[Counter[str]], float]:
        credentials = secure.client_credentials()
        assert credentials is not None
        channels = [
            grpc.aio.secure_channel(a, credentials) for a in (secure.router_address, second)
        ]
        for channel in channels:
            await channel.channel_ready()
        start = redis_now()  # Redis's clock: the one the buckets run on
        counts = await asyncio.gather(*(_hammer(c, key, seconds) for c in channels))
        for channel in channels:
            await channel.close()
        # the last admitted call's time, on the same clock: the bucket records it
        last_us = clock.hget(mesh_state.limit_key("shared", "rps"), "at_us")
        return list(counts), int(last_us) / 1e6 - start

    per_router, elapsed = asyncio.run(both())
    allowed = sum(c["OK"] for c in per_router)
    refused = sum(c["RESOURCE_EXHAUSTED"] for c in per_router)
    assert all(c["OK"] > 0 for c in per_router), per_router  # both routers took part
    assert set().union(*per_router) <= {"OK", "RESOURCE_EXHAUSTED"}, per_router
    assert refused * 4 > allowed, per_router  # offered above the rate all along
    most = burst + rate * elapsed  # the bucket's ceiling up to the last admitted call
    assert most * 0.99 <= allowed <= most, (allowed, most, per_router)


def test_a_bad_tenant_record_is_refused_not_trusted_and_not_fatal(secure: Mesh) -> None:
    s = stub(secure)
    _, key = key_for(secure, "broken", TenantPolicy())
    _, fine = key_for(secure, "fine", TenantPolicy())
    secure.redis_client("admin").set(mesh_state.tenant_key("broken"), '{"models": "all"}')
    time.sleep(0.3)  # past the router's key cache
    e = code_of(lambda: s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(key)))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "record in the mesh is not valid" in e.details()
    assert s.ModelInfer(mlp_request(), timeout=5, metadata=bearer(fine)).model_name == "mlp"
    assert secure.router is not None
    assert "tenant_record_refused" in secure.router.log.read_text()


def test_a_plaintext_client_cannot_reach_the_tls_router(secure: Mesh) -> None:
    with grpc.insecure_channel(secure.router_address) as channel:
        e = code_of(
            lambda: pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                pb.ServerLiveRequest(), timeout=3
            )
        )
    assert e.code() == grpc.StatusCode.UNAVAILABLE
