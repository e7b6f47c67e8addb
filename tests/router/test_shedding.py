"""The queue-wait prediction and the shedding decision (router/forwarding/shedding.py) over replicas
with fake channels; and the request parameters the router adds for an LLM's engines."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from common import llm_protocol
from common.errors import ResourceExhausted
from common.mesh_state import DepthSample, ModelEntry, WorkerInfo, now_ms
from common.tenancy import TenantPolicy
from protos import grpc_service_pb2 as pb
from router.forwarding.dispatch import with_tenant
from router.forwarding.replica import Replica
from router.forwarding.shedding import Shedder, predicted_wait
from router.tenancy.auth import Tenant

MODEL = "smollm2"


class FakeChannel:
    def unary_unary(self, method: str) -> Any:
        return None

    def stream_stream(self, method: str) -> Any:
        return None


def replica(depth: int, slots: int = 4, rate_milli: int = 2000, at: int | None = None) -> Replica:
    info = WorkerInfo("w", "127.0.0.1:1", {MODEL: ModelEntry(["1"], 64)}, "CPU")
    r = Replica(info, FakeChannel())  # type: ignore[arg-type]
    r.sample = DepthSample(depth, now_ms() if at is None else at, 10, 4096, slots, rate_milli)
    return r


def test_a_free_slot_means_no_wait_and_a_queue_waits_its_turn() -> None:
    now = now_ms()
    assert predicted_wait([replica(2)], 0, now, 1000) == 0.0
    # 4 slots busy, 3 queued: a new request is the 4th in line at 2 requests/s
    assert predicted_wait([replica(7)], 0, now, 1000) == pytest.approx(2.0)
    # two replicas pool their queues and rates
    assert predicted_wait([replica(7), replica(3)], 0, now, 1000) == pytest.approx(0.0)
    assert predicted_wait([replica(8), replica(8)], 0, now, 1000) == pytest.approx(2.25)


def test_calls_the_samples_did_not_see_count_and_unknown_rates_admit() -> None:
    now = now_ms()
    r = replica(4, at=now - 50)
    r.inflight = {1: now - 100, 2: now - 10, 3: now - 5}  # one seen by the sample, two not
    assert predicted_wait([r], 3, now, 1000) == pytest.approx(1.5)  # 2 ahead + itself
    assert predicted_wait([replica(9, rate_milli=0)], 0, now, 1000) is None  # none finished
    assert predicted_wait([replica(9, at=now - 5000)], 0, now, 1000) is None  # stale
    assert predicted_wait([replica(9, slots=0)], 0, now, 1000) is None  # not an LLM engine


def test_lower_priorities_are_shed_first_with_retry_after() -> None:
    shedder = Shedder(1.0)
    busy = [replica(6)]  # 2 ahead: the new request waits 1.5 s
    shedder.check(MODEL, "high", busy, 0)  # bound 2 s
    for priority in ("normal", "low"):
        with pytest.raises(ResourceExhausted) as caught:
            shedder.check(MODEL, priority, busy, 0)
        trailers = dict(caught.value.trailers)
        expected = 1.5 - shedder.bound(priority)
        assert float(trailers["retry-after"]) == pytest.approx(expected, abs=1e-3)
        assert trailers["limit"] == "queue_wait"
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    shedder.check(MODEL, "low", [replica(4)], 0)  # a request that would wait 0.5 s: in


def test_the_router_overwrites_the_clients_tenant_parameters() -> None:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.parameters[llm_protocol.TENANT].string_param = "someone-else"
    request.parameters[llm_protocol.TENANT_WEIGHT].double_param = 100.0
    tenant = Tenant("acme", TenantPolicy(weight=2.5), "k1")
    sent = pb.ModelInferRequest.FromString(with_tenant(request.SerializeToString(), tenant))
    assert sent.parameters[llm_protocol.TENANT].string_param == "acme"
    assert sent.parameters[llm_protocol.TENANT_WEIGHT].double_param == 2.5
    anonymous = pb.ModelInferRequest.FromString(with_tenant(request.SerializeToString(), None))
    assert anonymous.parameters[llm_protocol.TENANT].string_param == ""
    assert anonymous.model_name == MODEL


def test_a_tenant_policy_checks_its_priority_and_weight() -> None:
    policy = TenantPolicy.from_json('{"models": ["*"], "priority": "low", "weight": 3}')
    assert (policy.priority, policy.weight) == ("low", 3.0)
    assert TenantPolicy.from_json(policy.to_json()) == policy
    for bad in ('"priority": "urgent"', '"weight": 0', '"weight": true', '"weight": 5000'):
        with pytest.raises(ValueError, match="priority|weight"):
            TenantPolicy.from_json('{"models": ["*"], ' + bad + "}")
