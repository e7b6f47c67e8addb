"""EngineConfig declares each engine setting once: its default and its config.pbtxt key."""

from __future__ import annotations

import dataclasses

import pytest

from common import model_keys
from worker.llm.engine_config import EngineConfig


def test_every_key_is_a_model_key_and_named_once() -> None:
    keys = EngineConfig.keys()
    assert keys["max_num_seqs"] == model_keys.MAX_NUM_SEQS
    assert keys["prefix_caching"] == model_keys.PREFIX_CACHING
    assert len(set(keys.values())) == len(keys)
    assert set(keys) <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_parameters_over_model_defaults_over_declared_defaults() -> None:
    config = EngineConfig.from_parameters(
        "m",
        {model_keys.MAX_NUM_SEQS: "8", model_keys.PREFIX_CACHING: "False"},
        max_model_len=1024,
    )
    assert config.max_num_seqs == 8
    assert config.prefix_caching is False
    assert config.max_model_len == 1024  # the model's default for an unset key
    assert config.prefill_chunk == EngineConfig.prefill_chunk


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (model_keys.MAX_NUM_SEQS, "eight", "positive integer"),
        (model_keys.NUM_SCHEDULER_STEPS, "0", "positive integer"),
        (model_keys.PREFIX_CACHING, "yes", "true or false"),
        (model_keys.RESERVED_SLOTS, "-1", "an integer >= 0"),
    ],
)
def test_a_bad_value_is_refused_by_key(key: str, value: str, expected: str) -> None:
    with pytest.raises(ValueError, match=f"model 'm': parameter {key} must be .*{expected}"):
        EngineConfig.from_parameters("m", {key: value})


def test_no_slot_held_back_is_a_valid_setting() -> None:
    assert EngineConfig.from_parameters("m", {model_keys.RESERVED_SLOTS: "0"}).reserved_slots == 0
    assert EngineConfig().reserved_slots == 1
