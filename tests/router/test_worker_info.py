"""Registrations as the router and the ledger read them from Redis: checked, not trusted."""

from __future__ import annotations

import json

import pytest

from common.mesh_state import DepthSample, RegistryEvent, WorkerInfo

GOOD = {
    "id": "w1",
    "address": "127.0.0.1:9001",
    "models": {"mlp": {"versions": ["1"], "max_queue": 8, "price_micro_usd": 250}},
    "provider": "CPUExecutionProvider",
    "tp": 1,
    "started_ms": 5,
    "extra": {},
}


LLM = {
    "versions": ["1"],
    "max_queue": 272,
    "price_micro_usd": 200,
    "price_per_1k_input_tokens_micro_usd": 50,
    "price_per_1k_output_tokens_micro_usd": 200,
}


def test_per_token_prices_travel_with_the_registration() -> None:
    info = WorkerInfo.from_json(json.dumps({**GOOD, "models": {"smollm2": LLM}}))
    assert info.models["smollm2"].prices == (200, 50, 200)
    assert WorkerInfo.from_json(info.to_json()) == info
    assert WorkerInfo.from_json(json.dumps(GOOD)).models["mlp"].prices == (250, 0, 0)


def test_a_registration_round_trips_and_unknown_fields_are_ignored() -> None:
    info = WorkerInfo.from_json(json.dumps(GOOD))
    assert WorkerInfo.from_json(info.to_json()) == info
    newer = WorkerInfo.from_json(json.dumps({**GOOD, "zone": "eu-1"}))
    assert newer == info


@pytest.mark.parametrize(
    "change",
    [
        {"models": {}},
        {"models": {"mlp": {"versions": ["1"], "max_queue": -1}}},
        {"models": {"mlp": {"versions": ["1"], "max_queue": 8, "price_micro_usd": -250}}},
        {"models": {"mlp": {"versions": ["1"], "max_queue": 8, "price_micro_usd": "250"}}},
        {"models": {"mlp": {**LLM, "price_per_1k_input_tokens_micro_usd": -1}}},
        {"models": {"mlp": {**LLM, "price_per_1k_output_tokens_micro_usd": 1.5}}},
        {"models": {"mlp": {**LLM, "price_per_1k_output_tokens_micro_usd": True}}},
        {"models": {"m|x": {"versions": ["1"], "max_queue": 8}}},
        {"models": {"mlp": {"versions": ["1|success"], "max_queue": 8}}},
        {"models": {"mlp": {"versions": [], "max_queue": 8}}},
        {"address": "nowhere"},
        {"address": "127.0.0.1:99999"},
        {"tp": -3},
        {"id": ""},
        {"extra": []},
    ],
)
def test_a_bad_registration_is_a_value_error(change: dict) -> None:
    with pytest.raises(ValueError):
        WorkerInfo.from_json(json.dumps({**GOOD, **change}))


@pytest.mark.parametrize("text", ["{not json", "[]", '"w1"'])
def test_text_that_is_no_registration_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        WorkerInfo.from_json(text)


def test_a_depth_sample_is_two_counts() -> None:
    assert DepthSample.decode("3:1000") == DepthSample(3, 1000)
    for text in ("-1:1000", "x:1", "3"):
        with pytest.raises(ValueError):
            DepthSample.decode(text)


@pytest.mark.parametrize(
    "event",
    [
        RegistryEvent("join", "worker-127.0.0.1-9001"),
        RegistryEvent("leave", "a worker id with spaces"),
        RegistryEvent("depth", "w 1", DepthSample(3, 1234, 10, 100).encode()),
    ],
)
def test_registry_events_round_trip(event: RegistryEvent) -> None:
    assert RegistryEvent.decode(event.encode()) == event
    assert RegistryEvent.decode(event.encode().encode()) == event


@pytest.mark.parametrize("text", ["", "join", "join ", "quit w1", "depth w1", "depth  5:6"])
def test_registry_events_that_do_not_parse_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected join"):
        RegistryEvent.decode(text)
