"""The durable store on SQLite and on the PostgreSQL this machine runs: exactly-once apply."""

from __future__ import annotations

import pytest

from common.mesh_state import CALL_FIELDS, TOKEN_FIELDS
from ledger.store import BatchEntry, Quarantined, Store, WorkerSpan


def batch(seq: int, calls: int, price: int = 100) -> BatchEntry:
    return BatchEntry(
        seq, {("mlp", "1"): [calls, calls, 0, calls * price, calls * 1000]}, 60_000 * seq
    )


def test_apply_counts_each_batch_once(ledger_store: Store) -> None:
    assert ledger_store.apply("r1", [batch(1, 10), batch(2, 5)], 0) == (0, 2)
    assert ledger_store.apply("r1", [batch(1, 10), batch(2, 5), batch(3, 1)], 0) == (0, 3)
    assert ledger_store.apply("r1", [batch(3, 1)], 0) == (0, 3)
    usage = ledger_store.usage()[("mlp", "1")]
    assert {k: v for k, v in usage.items() if k in CALL_FIELDS} == {
        "calls": 16,
        "success": 16,
        "errors": 0,
        "revenue_micro_usd": 1600,
        "upstream_ns": 16000,
    }
    assert not any(usage[k] for k in TOKEN_FIELDS)  # a model not priced per token
    assert ledger_store.cursor("r1") == (0, 3) and ledger_store.cursor("other") == (0, 0)
    assert [b[1] for b in ledger_store.buckets("mlp")] == [10, 5, 1]
    assert ledger_store.gaps() == []


def test_routers_have_their_own_cursors(ledger_store: Store) -> None:
    ledger_store.apply("r1", [batch(1, 10)], 0)
    ledger_store.apply("r2", [batch(1, 7)], 0)
    assert ledger_store.usage()[("mlp", "1")]["calls"] == 17


def test_a_crash_inside_the_transaction_writes_nothing(
    ledger_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    ledger_store.apply("r1", [batch(1, 10)], 0)
    calls = {"n": 0}
    original = Store._add_usage

    def crash_on_second(cur, *args):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("killed mid-flush")
        original(cur, *args)

    monkeypatch.setattr(Store, "_add_usage", staticmethod(crash_on_second))
    with pytest.raises(RuntimeError):
        ledger_store.apply("r1", [batch(2, 5), batch(3, 1)], 0)
    monkeypatch.setattr(Store, "_add_usage", staticmethod(original))
    assert ledger_store.cursor("r1") == (0, 1)
    assert ledger_store.usage()[("mlp", "1")]["calls"] == 10  # batch 2 rolled back with batch 3
    assert ledger_store.apply("r1", [batch(2, 5), batch(3, 1)], 0) == (0, 3)
    assert ledger_store.usage()[("mlp", "1")]["calls"] == 16


def test_a_gap_is_recorded_not_hidden(ledger_store: Store) -> None:
    ledger_store.apply("r1", [batch(1, 1), batch(3, 1)], 42)
    assert ledger_store.gaps() == [("r1", 1, 3)]


def test_worker_spans_keep_the_latest_sighting(ledger_store: Store) -> None:
    ledger_store.record_workers([WorkerSpan("w", 1000, "cpu", 5000)])
    ledger_store.record_workers([WorkerSpan("w", 1000, "cpu", 9000)])
    ledger_store.record_workers([WorkerSpan("w", 1000, "cpu", 7000)])  # an older pass, late
    ledger_store.record_workers([WorkerSpan("w", 20_000, "cpu", 21_000)])  # restarted: a new span
    assert sorted(ledger_store.workers(), key=lambda s: s.started_ms) == [
        WorkerSpan("w", 1000, "cpu", 9000),
        WorkerSpan("w", 20_000, "cpu", 21_000),
    ]


def test_a_restarted_router_goes_on_above_its_previous_epoch(ledger_store: Store) -> None:
    def at(epoch: int, seq: int, calls: int) -> BatchEntry:
        return BatchEntry(seq, {("mlp", "1"): [calls, calls, 0, calls, 0]}, 0, epoch)

    assert ledger_store.apply("r1", [at(1000, 1, 1), at(1000, 2, 1), at(1000, 3, 1)], 0) == (
        1000,
        3,
    )
    # The same router id, a new process: its seq starts at 1 again, above the old epoch.
    assert ledger_store.apply("r1", [at(2000, 1, 10), at(2000, 2, 10)], 0) == (2000, 2)
    assert ledger_store.apply("r1", [at(1000, 3, 1), at(2000, 2, 10)], 0) == (2000, 2)  # replay
    assert ledger_store.usage()[("mlp", "1")]["success"] == 23
    assert ledger_store.gaps() == []
    ledger_store.apply("r1", [at(3000, 2, 1)], 0)  # a new epoch that does not start at 1
    assert ledger_store.gaps() == [("r1", 0, 2)]


def test_a_quarantined_entry_is_kept_and_passed(ledger_store: Store) -> None:
    bad = Quarantined(0, 2, "usage is not JSON", "{not json")
    assert ledger_store.apply("r1", [batch(1, 1), batch(3, 1)], 0, [bad]) == (0, 3)
    assert ledger_store.usage()[("mlp", "1")]["calls"] == 2
    assert ledger_store.quarantine() == [("r1", "0-2", "usage is not JSON")]
    assert ledger_store.gaps() == []  # the quarantined entry fills its place in the sequence


def test_tokens_are_stored_per_model_version_exactly_once(ledger_store: Store) -> None:
    """An LLM's batch: 3 calls (2 stopped, 1 cut), tokens in/out and their revenue; then a
    batch taking back one streamed piece. Applying them twice changes nothing."""
    llm = [3, 2, 1, 0, 9_000, 30, 120, 26, 2, 0, 0]
    back = [0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0]
    entries = [
        BatchEntry(1, {("smollm2", "1"): llm, ("mlp", "1"): [1, 1, 0, 100, 5]}, 60_000),
        BatchEntry(2, {("smollm2", "1"): back}, 70_000),
    ]
    for _ in range(2):
        assert ledger_store.apply("r1", entries, 0) == (0, 2)
    u = ledger_store.usage()
    assert [u[("smollm2", "1")][k] for k in TOKEN_FIELDS] == [30, 119, 25, 2, 0, 0]
    assert u[("smollm2", "1")]["success"] == 2 and u[("mlp", "1")]["prompt_tokens"] == 0
    assert sum(r for _, _, r in ledger_store.buckets("smollm2")) == 25
    ledger_store.record_model("smollm2", 0, 1_000_000, 50, 200)
    assert ledger_store.token_prices() == {"smollm2": (50, 200)}


def test_tenant_usage_and_gauges(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest

    from ledger.__main__ import set_gauges
    from ledger.config import LedgerConfig
    from ledger.report import by_tenant, tenant_text

    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    store.apply(
        "r",
        [
            BatchEntry(
                1, {("mlp", "1", "acme"): [2, 2, 0, 500, 10], ("mlp", "1"): [1, 1, 0, 250, 5]}, 1
            ),
            BatchEntry(2, {("mlp", "1", "acme"): [1, 0, 1, 0, 5]}, 2),
        ],
        3,
    )
    assert store.usage()[("mlp", "1")]["success"] == 3  # every tenant's and none
    rows = by_tenant(store, LedgerConfig())
    assert [(r.tenant, r.model, r.calls, r.errors, r.revenue_micro_usd) for r in rows] == [
        ("acme", "mlp", 2, 1, 500)
    ]
    assert "acme" in tenant_text(rows)
    set_gauges([], rows)
    text = generate_latest().decode()
    assert 'meshserve_ledger_tenant_revenue_micro_usd{model="mlp",tenant="acme"} 500.0' in text
    store.close()


def test_cached_tokens_are_stored_and_reported_per_model_and_tenant(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A batch with the cache counts (13 fields): cached tokens and the discount per model
    version and per tenant, once however often the batch is applied; the report shows the
    hit rate, the discount and break-even with and without it."""
    from ledger.config import LedgerConfig
    from ledger.report import build, by_tenant, tenant_text, text

    store = Store(f"sqlite:///{tmp_path / 'l.db'}")
    counts = [2, 2, 0, 0, 9_000, 1000, 200, 80, 2, 0, 0, 600, 20]
    entry = BatchEntry(1, {("smollm2", "1", "acme"): counts}, 60_000)  # totals count it too
    for _ in range(2):
        store.apply("r1", [entry], 0)
    u = store.usage()[("smollm2", "1")]
    assert (u["cached_tokens"], u["cached_discount_micro_usd"], u["prompt_tokens"]) == (
        600,
        20,
        1000,
    )
    store.record_model("smollm2", 0, 1_000_000, 50, 200)
    rows = build(store, LedgerConfig())
    cache = rows[0].tokens.cache  # type: ignore[union-attr]
    assert cache is not None and cache.hit_rate == 0.6 and cache.discount_micro_usd == 20
    assert cache.break_even_output_tokens == -(-1_000_000 * 200 // 80)
    assert cache.break_even_without_discount == -(-1_000_000 * 200 // 100)
    report = text(rows)
    assert "cached tokens in      600 (hit rate 60.0%)" in report
    tenants = by_tenant(store, LedgerConfig())
    assert (tenants[0].cached_tokens, tenants[0].hit_rate) == (600, 0.6)
    assert "60.0%" in tenant_text(tenants)
    store.close()
