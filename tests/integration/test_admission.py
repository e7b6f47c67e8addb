"""Overload and fairness on a real mesh: SmolLM2 (int8) in a worker with one slot, a router
that sheds by predicted queue wait (gRPC RESOURCE_EXHAUSTED + retry-after metadata, HTTP 429
+ Retry-After; lower priorities first; each shed call in the ledger as shed, no revenue),
and a router without a bound through which two tenants share the engine token-fairly."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import openai
import pytest

from common import mesh_state, model_keys
from common.mesh_state import DepthSample
from common.net import free_port
from common.tenancy import TenantPolicy
from devmesh.testing import Mesh
from ledger.store import Store
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from tests.integration.conftest import llm_mesh

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "Write a long story about a robot who learns to paint."
TOKENS = 24  # every request here generates exactly this many (ignore_eos)
LONG = 64  # the warm-up's and the background's: the service time the routers predict with
ONE_SLOT = {model_keys.MAX_NUM_SEQS: "1"}


class Served:
    def __init__(self, mesh: Mesh, worker: str, bounded: str, http: str, free: str, store: Store):
        self.mesh, self.worker, self.bounded, self.http = mesh, worker, bounded, http
        self.free, self.store = free, store
        self.keys: dict[str, str] = {}

    def key(self, tenant: str, priority: str = "normal") -> str:
        if tenant not in self.keys:
            admin = self.mesh.tenant_admin()
            admin.set_tenant(tenant, TenantPolicy(priority=priority))
            self.keys[tenant] = admin.create_key(tenant)[1]
        return self.keys[tenant]


def request(tokens: int = TOKENS, prompt: str = PROMPT) -> pb.ModelInferRequest:
    sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    req = pb.ModelInferRequest(model_name=MODEL)
    for name, value in (("text_input", prompt), ("sampling_parameters", json.dumps(sampling))):
        tensor = req.inputs.add(name=name, datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(value.encode())
    return req


def infer(address: str, key: str | None, tokens: int = TOKENS) -> pb.ModelInferResponse:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelInfer(request(tokens), metadata=metadata, timeout=300)


def service_seconds(mesh: Mesh) -> float:
    """The worker's mean service time as it publishes it (slots / rate)."""
    client = mesh.redis_client()
    worker_id = client.zrange(mesh_state.WORKERS, 0, -1)[0]
    sample = DepthSample.decode(client.get(mesh_state.depth_key(worker_id)))
    assert sample.slots == 1 and sample.rate_milli > 0, sample
    return 1000 / sample.rate_milli


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("admission")
    with llm_mesh(root, ONE_SLOT) as (mesh, worker):
        for _ in range(3):  # the worker measures its service time: the routers read it
            infer(worker, None, LONG)
        time.sleep(0.5)  # a heartbeat publishes it
        service = service_seconds(mesh)
        # with one request running and none queued, a new one starts after one release:
        # its wait's p99 is predicted (1 + 2.33) service times; normal's bound under that,
        # high's (2x) over it
        bound = service * (1 + 2.33) / 1.5
        http = free_port()
        bounded = mesh.start_router(
            "--queue-wait-bound-seconds", f"{bound:.3f}", "--http-port", str(http),
            "--auth-cache-seconds", "0.2",
        )  # fmt: skip
        free, process = mesh.spawn_router()
        mesh.others.append(process)
        store = Store(f"sqlite:///{root / 'ledger.db'}")
        mesh.start_ledger(store.url, "--interval-seconds", "0.1")
        yield Served(mesh, worker, bounded, f"http://127.0.0.1:{http}", free, store)


class Background:
    """A long request running on the one slot (sent to the worker directly, so the routers
    learn of it only from the worker's depth), until `join`."""

    def __init__(self, served: Served) -> None:
        self.thread = threading.Thread(target=infer, args=(served.worker, None, LONG))
        self.thread.start()
        self.mesh = served.mesh
        self.wait_depth(lambda depth: depth >= 1)

    def wait_depth(self, done: Callable[[int], bool]) -> None:
        client = self.mesh.redis_client()
        worker_id = client.zrange(mesh_state.WORKERS, 0, -1)[0]
        deadline = time.monotonic() + 30
        while not done(DepthSample.decode(client.get(mesh_state.depth_key(worker_id))).depth):
            assert time.monotonic() < deadline, "the worker's depth did not change"
            time.sleep(0.01)
        time.sleep(0.1)  # the routers get the sample (pushed)

    def join(self) -> None:
        self.thread.join(timeout=300)
        self.wait_depth(lambda depth: depth == 0)


def shed_grpc(served: Served, key: str) -> dict[str, str]:
    """A call the bounded router must shed: its trailing metadata."""
    with pytest.raises(grpc.RpcError) as caught:
        infer(served.bounded, key)
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "overloaded" in (error.details() or "")
    return dict(error.trailing_metadata() or ())


def test_grpc_and_http_shed_with_retry_after_and_the_ledger_counts_them(served: Served) -> None:
    key = served.key("bob")
    before = sum(n for (_, _, t), n in served.store.shed().items() if t == "bob")
    busy = Background(served)
    try:
        trailers = shed_grpc(served, key)
        retry = float(trailers["retry-after"])
        assert 0 < retry < 60 and trailers["limit"] == "queue_wait"
        client = openai.OpenAI(base_url=f"{served.http}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError) as limited:  # a stream: refused before it
            list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True))
        assert int(limited.value.response.headers["retry-after"]) >= 1
    finally:
        busy.join()
    # idle again: admitted
    assert infer(served.bounded, key, tokens=4).outputs
    deadline = time.monotonic() + 20
    while True:
        shed = sum(n for (_, _, t), n in served.store.shed().items() if t == "bob")
        usage = served.store.tenant_usage().get(("bob", MODEL), {"success": 0})
        if (shed - before == 3 and usage["success"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert shed - before == 3  # every shed call is in the ledger, none lost
    assert usage["errors"] >= 3 and usage["success"] >= 1
    assert usage["revenue_micro_usd"] == usage["success"] * 200  # the shed ones paid nothing


def test_lower_priorities_are_shed_first(served: Served) -> None:
    low, normal, high = (served.key(t, t) for t in ("low", "normal", "high"))
    busy = Background(served)
    try:
        assert float(shed_grpc(served, low)["retry-after"]) > 0
        assert float(shed_grpc(served, normal)["retry-after"]) > 0
        # the same predicted wait is within high's bound: admitted (it queues for the slot)
        assert infer(served.bounded, high, tokens=4).outputs
    finally:
        busy.join()


def test_a_light_tenant_is_not_starved_behind_a_heavy_backlog(served: Served) -> None:
    """Heavy queues 6 long requests on the one slot, then light sends 2 short ones: light's
    second is done after at most two more of heavy's (the one running when light came, and
    one while light's counter is ahead after its first), not after all of heavy's backlog."""
    heavy, light = served.key("heavy"), served.key("light")
    done: list[str] = []
    lock = threading.Lock()

    def call(tenant: str, key: str, tokens: int) -> None:
        infer(served.free, key, tokens)
        with lock:
            done.append(tenant)

    threads = [threading.Thread(target=call, args=("heavy", heavy, LONG)) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.5)  # all six are at the worker: one running, five waiting
    with lock:
        before = len(done)  # heavy's finished before light came (0 unless the machine is fast)
    for _ in range(2):
        threads.append(threading.Thread(target=call, args=("light", light, TOKENS)))
        threads[-1].start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=600)
    assert len(done) == 8
    ranks = [i for i, tenant in enumerate(done) if tenant == "light"]
    assert before + 3 < 7, (before, done)  # else first come first served would pass too
    assert ranks[-1] <= before + 3, (before, done)  # first come first served: ranks 6 and 7


def test_the_router_sets_the_tenant_parameter_whatever_the_client_sends(served: Served) -> None:
    """A client naming another tenant is still counted as its own: here a request naming
    'heavy' from light's key goes through (the worker accepts any name it is given), and
    one with a bad weight is not refused, since the router replaces it."""
    req = request(4)
    req.parameters["tenant"].string_param = "heavy"
    req.parameters["tenant_weight"].double_param = -5.0
    with grpc.insecure_channel(served.free) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        key = served.key("light")
        reply = stub.ModelInfer(req, metadata=(("authorization", f"Bearer {key}"),), timeout=120)
    assert reply.outputs
    # straight to the worker the weight is checked: the router is what makes it safe
    with grpc.insecure_channel(served.worker) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(req, timeout=120)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tenant_weight" in (caught.value.details() or "")
