"""What the ledger accepts from a router's stream, and what it quarantines (no Redis)."""

from __future__ import annotations

import json

import pytest

from ledger.consumer import check_entry, parse_entry
from ledger.store import Quarantined


def fields(usage: object, at_ms: str = "1000") -> dict[str, str]:
    return {"usage": json.dumps(usage), "at_ms": at_ms}


def test_a_well_formed_batch_and_a_refund_parse() -> None:
    entry = parse_entry("1700000000000-3", fields({"mlp|1": [4, 3, 1, 750, 10]}), {"mlp"})
    assert (entry.epoch, entry.seq, entry.usage) == (
        1700000000000,
        3,
        {("mlp", "1"): [4, 3, 1, 750, 10] + [0] * 9},  # a 5-count batch: no tokens
    )
    refund = parse_entry("1700000000000-4", fields({"mlp|1": [0, -1, 1, -250, 0]}), {"mlp"})
    assert refund.usage[("mlp", "1")][1] == -1
    assert parse_entry("7-1", fields({"mlp|1": [1, 1, 0, 250, 0]})).id == (7, 1)  # legacy id


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"usage": "{not json", "at_ms": "1"}, "Expecting"),
        (fields({"mlp|1|success": [1, 1, 0, 250, 0]}), "tenant 'success' is not one"),
        (fields({"mlp|1|a|b": [1, 1, 0, 250, 0]}), "not 'model|version[|tenant]'"),
        (fields({"ghost|1": [1, 1, 0, 250, 0]}), "not one the mesh serves"),
        (fields({"mlp|1": [1, 2, 0, 500, 0]}), "do not add up"),
        (fields({"mlp|1": [1, 1, 0, -250, 0]}), "revenue"),
        (fields({"mlp|1": [1, 1, 0, 250]}), "5 or 11 or 13 or 14 ints"),
        (fields({"mlp|1": [1, 1, 0, 250, 0.5]}), "5 or 11 or 13 or 14 ints"),
        (fields({"mlp|1": [True, 1, 0, 250, 0]}), "5 or 11 or 13 or 14 ints"),
        (fields({"mlp|1": [1, 1, 0, 250, 0]}, at_ms="-5"), "at_ms"),
        ({**fields({"mlp|1": [1, 1, 0, 250, 0]}), "extra": "x"}, "fields"),
        (fields([]), "non-empty object"),
    ],
)
def test_what_does_not_pass_is_quarantined_with_the_reason(entry: dict, reason: str) -> None:
    got = check_entry("1700000000000-9", entry, {"mlp"})
    assert isinstance(got, Quarantined), got
    assert got.id == (1700000000000, 9) and reason in got.reason, got.reason
