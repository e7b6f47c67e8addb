"""The load tool's tenant mode and overload report as units (no server): --tenant values,
Jain's index, and the refusals a recorder counts with their Retry-After."""

from __future__ import annotations

import pytest

from loadtest.llm.stats import LLMRecorder
from loadtest.llm.stream import Outcome
from loadtest.llm.tenants import TenantLoad, jain


def test_tenant_values_parse_or_say_what_is_wrong() -> None:
    assert TenantLoad.parse("heavy,HEAVY_KEY,concurrency=20") == TenantLoad(
        "heavy", "HEAVY_KEY", concurrency=20
    )
    assert TenantLoad.parse("light,K,rate=0.5").rate == 0.5
    assert TenantLoad.parse("light,K,concurrency=1,after=5").after == 5.0
    bad_ones = ("heavy", "a,K,concurrency=0", "a,K,concurrency=1.5", "a,K,rate=-1", "a,K,x=1")
    for bad in (*bad_ones, "a,K,rate=1,after=-1", "a,K,rate=1,later=2", "a,K,rate=1,after=x"):
        with pytest.raises(ValueError, match="--tenant"):
            TenantLoad.parse(bad)


def test_jains_index() -> None:
    assert jain([5.0, 5.0]) == 1.0
    assert jain([10.0, 0.0]) == 0.5
    assert jain([10.0, 1.0]) == pytest.approx(121 / 202, abs=1e-4)
    assert jain([0.0, 0.0]) is None


def test_refusals_for_overload_are_counted_with_their_retry_after() -> None:
    r = LLMRecorder()
    ok = Outcome(0.0, end=1.0, pieces=[0.2, 0.5], text="ab", completion_tokens=2)
    r.add(ok, "p")
    r.add(Outcome(0.1, end=0.1, error="RESOURCE_EXHAUSTED", shed=True, retry_after="1.500"), "p")
    r.add(Outcome(0.2, end=0.2, error="HTTP 429", shed=True, retry_after="2"), "p")
    r.add(Outcome(0.3, end=0.3, error="HTTP 429", shed=True), "p")  # no Retry-After
    r.add(Outcome(0.4, end=0.4, error="UNAVAILABLE"), "p")  # not a refusal
    shed = r.summary()["shed"]
    assert (shed["count"], shed["with_retry_after"]) == (3, 2)
    assert shed["retry_after_s"]["max"] == 2.0
    assert r.summary()["ttft_ms"]["p99"] == pytest.approx(200, rel=0.01)  # accepted only


def test_a_tenants_served_tokens_are_those_of_requests_ended_in_the_window() -> None:
    r = LLMRecorder()
    r.add(Outcome(0.0, end=1.0, pieces=[0.5], text="a", prompt_tokens=5, completion_tokens=3), "p")
    r.add(Outcome(0.5, end=9.0, pieces=[8.0], text="b", prompt_tokens=5, completion_tokens=3), "p")
    assert (r.served_until(0.9), r.served_until(5.0), r.served_until(9.0)) == (0, 8, 16)
