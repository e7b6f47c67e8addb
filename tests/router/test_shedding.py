"""The queue-wait prediction and the shedding decision (router/forwarding/shedding.py) over replicas
with fake channels; and the request parameters the router adds for an LLM's engines."""

from __future__ import annotations

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
from tests.router.fakes import FakeChannel

MODEL = "smollm2"


def replica(depth: int, slots: int = 4, rate_milli: int = 2000, at: int | None = None) -> Replica:
    info = WorkerInfo("w", "127.0.0.1:1", {MODEL: ModelEntry(["1"], 64)}, "CPU")
    r = Replica(info, FakeChannel())  # type: ignore[arg-type]
    r.sample = DepthSample(depth, now_ms() if at is None else at, 10, 4096, slots, rate_milli)
    return r


def place(replicas: list[Replica], inflight: int = 0) -> int | None:
    line = predicted_wait(replicas, inflight, now_ms(), 1000)
    return None if line is None else line.place


def test_a_free_slot_means_no_wait_and_a_queue_waits_its_turn() -> None:
    assert place([replica(2)]) == 0
    line = predicted_wait([replica(7)], 0, now_ms(), 1000)
    # 4 slots busy, 3 queued: the new request starts after the 4th release, at 2/s
    assert line is not None and (line.place, line.rate) == (4, 2.0)
    assert line.wait() == pytest.approx((4 + 2.33 * 2) / 2)  # the wait's p99, not its mean
    assert line.wait(0) == 0.0
    # two replicas pool their queues and rates; a free slot on either: no wait
    assert place([replica(7), replica(3)]) == 0
    assert place([replica(8), replica(8)]) == 9


def test_calls_the_samples_did_not_see_count_and_unknown_rates_admit() -> None:
    now = now_ms()
    r = replica(4, at=now - 50)
    r.inflight = {1: now - 100, 2: now - 10, 3: now - 5}  # one seen by the sample, two not
    assert place([r], 3) == 3  # 2 ahead + itself
    assert place([replica(3)], 2) == 2  # one admitted, not sent yet, takes the free slot
    assert place([replica(9, rate_milli=0)]) is None  # nothing finished yet
    assert place([replica(9, at=now - 5000)]) is None  # stale
    assert place([replica(9, slots=0)]) is None  # not an LLM engine


def test_lower_priorities_are_shed_first_with_retry_after() -> None:
    shedder = Shedder(1.0)
    busy = [replica(4, rate_milli=5000)]  # place 1 at 5/s: p99 wait 3.33 / 5 = 0.67 s
    shedder.check(MODEL, "high", busy, 0)  # bound 2 s
    shedder.check(MODEL, "normal", busy, 0)  # bound 1 s
    with pytest.raises(ResourceExhausted) as caught:
        shedder.check(MODEL, "low", busy, 0)  # bound 0.5 s
    trailers = dict(caught.value.trailers)
    assert float(trailers["retry-after"]) == pytest.approx(0.2)  # one release
    assert trailers["limit"] == "queue_wait"
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    long = [replica(13, rate_milli=5000)]  # place 10: p99 wait (10 + 7.37) / 5 = 3.47 s
    for priority in ("high", "normal", "low"):
        with pytest.raises(ResourceExhausted) as caught:
            shedder.check(MODEL, priority, long, 0)
        retry = float(dict(caught.value.trailers)["retry-after"])
        bound = shedder.bound(priority)
        line = predicted_wait(long, 0, now_ms(), 1000)
        assert line is not None
        within = line.place - round(retry * line.rate)  # the place the line drains to
        assert line.wait(within) <= bound < line.wait(within + 1)


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
