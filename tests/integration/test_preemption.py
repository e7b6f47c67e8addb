"""Fair preemption on a real mesh: SmolLM2 (int8) in a worker with two slots, a router with
keys. Heavy's two long requests fill both slots; a new tenant's short request does not wait
for one of them to end: the worker preempts heavy's newest, light finishes first, and both
of heavy's requests still complete with every token they asked for."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common import model_keys
from common.tenancy import TenantPolicy
from devmesh.testing import Mesh
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from tests.integration.conftest import llm_mesh

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "Write a long story about a robot who learns to paint."
LONG, SHORT = 400, 8
TWO_SLOTS = {model_keys.MAX_NUM_SEQS: "2"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str, Path]]:
    root = tmp_path_factory.mktemp("preemption")
    with llm_mesh(root, TWO_SLOTS) as (m, _):
        yield m, m.start_router(), root / "logs"


def infer(address: str, key: str, tokens: int) -> pb.ModelInferResponse:
    sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    req = pb.ModelInferRequest(model_name=MODEL)
    for name, value in (("text_input", PROMPT), ("sampling_parameters", json.dumps(sampling))):
        tensor = req.inputs.add(name=name, datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(value.encode())
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelInfer(req, metadata=(("authorization", f"Bearer {key}"),), timeout=300)


def test_a_new_tenant_preempts_and_the_preempted_request_completes(mesh) -> None:  # type: ignore[no-untyped-def]
    m, router, logs = mesh
    admin = m.tenant_admin()
    keys = {}
    for tenant in ("heavy", "light"):
        admin.set_tenant(tenant, TenantPolicy())
        keys[tenant] = admin.create_key(tenant)[1]
    infer(router, keys["heavy"], SHORT)  # warm: the key resolved, the graph run once
    done: list[tuple[str, pb.ModelInferResponse]] = []
    lock = threading.Lock()

    def call(tenant: str, tokens: int) -> None:
        response = infer(router, keys[tenant], tokens)
        with lock:
            done.append((tenant, response))

    heavy = [threading.Thread(target=call, args=("heavy", LONG)) for _ in range(2)]
    for t in heavy:
        t.start()
    time.sleep(0.5)  # both on their slots, decoding (400 tokens take seconds)
    light = threading.Thread(target=call, args=("light", SHORT))
    light.start()
    for t in [*heavy, light]:
        t.join(timeout=300)
    assert [tenant for tenant, _ in done] == ["light", "heavy", "heavy"], done
    for _, response in done:
        assert response.outputs[0].name == "text_output"
    counts = [int(r.parameters["completion_tokens"].int64_param) for _, r in done]
    assert counts == [SHORT, LONG, LONG], counts
    worker_log = "".join(p.read_text() for p in logs.glob("worker-*.log"))
    assert "llm_preempted" in worker_log
