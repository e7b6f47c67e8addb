"""The benchmarks' summary rows follow their numbers: each verdict fed two result sets, the
committed one and one changed the other way, flips; the summary renders whatever results
files it finds. Fast, no servers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import ledger, mlserver, readings, router, summary, tp

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_the_committed_readme_is_rendered_from_the_committed_results() -> None:
    assert summary.render() == (RESULTS.parent / "README.md").read_text()


# -- accounting: paired runs --------------------------------------------------------------------


def test_sign_test() -> None:
    assert readings.sign_test_p(0, 0) == 1.0
    assert readings.sign_test_p(5, 0) == pytest.approx(0.0625)
    assert readings.sign_test_p(6, 0) == pytest.approx(0.03125)
    assert readings.sign_test_p(0, 6) == pytest.approx(0.03125)
    assert readings.sign_test_p(7, 1) == pytest.approx(2 * 9 / 256)
    assert readings.sign_test_p(4, 4) == 1.0


def test_accounting_inside_noise_then_distinguishable() -> None:
    noisy = readings.paired_cost([2131.0, 2015.8], [2418.2, 2012.4])  # the committed runs
    assert noisy["distinguishable"] is False and noisy["pairs_needed"] == 6
    assert noisy["min"] < 0 < noisy["max"]
    text = readings.accounting_reading(noisy)
    assert text.startswith("The cost of exact accounting is not distinguishable")
    assert "range -0.2% to 11.9%" in text and "2 pairs cannot reach p < 0.05" in text

    off = [2400.0, 2380.0, 2410.0, 2390.0, 2405.0, 2395.0, 2385.0, 2400.0]
    on = [x * 0.94 for x in off]  # 6% slower in every pair
    clear = readings.paired_cost(on, off)
    assert clear["distinguishable"] is True and clear["median"] == pytest.approx(0.06)
    text = readings.accounting_reading(clear)
    assert text.startswith("Exact accounting costs 6.0% of router saturation throughput")
    assert "8 of 8 pairs slower" in text and "distinguishable from run-to-run noise" in text

    faster = readings.paired_cost(off, on)  # accounting "on" faster in every pair
    assert readings.accounting_reading(faster).startswith("Exact accounting gains")

    mixed = readings.paired_cost(on[:4] + off[4:], off[:4] + on[4:])  # 4 one way, 4 the other
    assert mixed["distinguishable"] is False
    assert "cannot reach" not in readings.accounting_reading(mixed)  # enough pairs, no effect

    with pytest.raises(ValueError):
        readings.paired_cost([1.0], [])


def test_ledger_rows_flip_with_the_pairs_and_the_ledger() -> None:
    old = load("ledger")  # two pairs, on, off, on, off
    rows = ledger.rows(old)
    assert rows[0][:2] == ["accounting on: throughput cost, median of 2 pairs", "5.9%"]
    assert rows[1][1] == "no (p = 1.0)"
    assert rows[2][1:] == ["equal", "equal", "met"]

    new = copy.deepcopy(old)
    new["accounting"]["runs_rps"] = {"on": [2000.0 - i for i in range(8)], "off": [2200.0] * 8}
    new["economics"].update(durable_calls=8140, exact=False)
    rows = ledger.rows(new)
    assert rows[1][1].startswith("yes") and rows[2][1:] == ["differ", "equal", "missed"]
    del new["economics"]  # --skip-economics: no row for it
    assert len(ledger.rows(new)) == 2


def verdicts(rows: list[list]) -> dict[str, str]:
    return {row[0]: row[3] for row in rows}


def test_router_rows_flip_with_the_hop_and_the_policies() -> None:
    r = load("router")
    v = verdicts(router.rows(r))
    assert v["router p50 / direct at c=1"] == "missed"  # 2.61x
    assert v["router req/s / direct at c=32"] == "missed"  # 0.51x
    assert v["p2c p99 / random p99, one replica 4x slower"] == "met"
    fast = copy.deepcopy(r)
    fast["ratios"].update(hop_p50_ratio_c1=1.2, hop_throughput_ratio_c32=0.95)
    fast["ratios"]["p2c_p99_over_random_p99"] = 1.3
    v = verdicts(router.rows(fast))
    assert v["router p50 / direct at c=1"] == v["router req/s / direct at c=32"] == "met"
    assert v["p2c p99 / random p99, one replica 4x slower"] == "missed"


def test_mlserver_rows_flip_with_the_ratios() -> None:
    r = load("mlserver")
    v = verdicts(mlserver.rows(r))
    assert v["worker / MLServer req/s at c=8"] == "missed"  # 1.86x against >= 2x
    assert v["worker / MLServer p99 at c=8"] == "met"
    better = copy.deepcopy(r)
    better["ratios"]["worker_over_mlserver_c8"].update(throughput_ratio=2.1, p99_ratio=1.2)
    v = verdicts(mlserver.rows(better))
    assert v["worker / MLServer req/s at c=8"] == "met"
    assert v["worker / MLServer p99 at c=8"] == "missed"


def test_tp_rows_follow_the_numbers() -> None:
    r = load("tp")
    rows = {row[0]: row[1] for row in tp.rows(r)}
    assert rows["minilm batch8: latency / TP1 with every core"] == "TP2 1.75x, TP3 2.85x"
    assert rows["minilm: weight bytes per rank / TP1's"] == "TP2 0.76x, TP3 0.69x"
    fast = copy.deepcopy(r)
    for row in fast["minilm"]["latency"]["batch8"]:
        row["vs_tp1_all_cores"] = 0.5 if row["tp"] > 1 else row["vs_tp1_all_cores"]
    rows = {row[0]: row[1] for row in tp.rows(fast)}
    assert rows["minilm batch8: latency / TP1 with every core"] == "TP2 0.5x, TP3 0.5x"


# -- the summary: discovery ---------------------------------------------------------------------


def test_the_summary_renders_a_results_file_it_has_never_seen(tmp_path: Path) -> None:
    """A new benchmark's file is found by globbing, its rows and history rendered; a file
    without a summary object is listed as such, and nothing else is needed."""
    new = {
        "summary": {
            "title": "Structured output: the constrained sampler",
            "machine": "a 2-core VM",
            "date": "2026-12-06",
            "command": "python -m benchmarks.llm_never_seen --quick",
            "rows": [
                ["JSON-valid answers", "1.0", ">= 0.99", "met"],
                ["tok/s / unconstrained", "0.71x", ">= 0.8x", "missed"],
            ],
        },
        "history": [
            {
                "date": "2026-12-01",
                "machine": "another VM",
                "commit": "abc1234",
                "file": "llm_never_seen_run2.json",
                "rows": [["tok/s / unconstrained", "0.6x", ">= 0.8x", "missed"]],
            }
        ],
    }
    (tmp_path / "llm_never_seen.json").write_text(json.dumps(new))
    (tmp_path / "bare.json").write_text(json.dumps({"machine": {}}))
    text = summary.render(tmp_path)
    assert "## Structured output: the constrained sampler" in text
    assert "(results/llm_never_seen.json) — a 2-core VM, 2026-12-06;" in text
    assert "| tok/s / unconstrained | 0.71x | >= 0.8x | missed |" in text
    assert "| JSON-valid answers | 1.0 | >= 0.99 | met |" in text
    assert "| 2026-12-01 | another VM | abc1234 | 0 of 1 targets met; tok/s / unconstrained" in text
    assert "`results/bare.json` has no `summary` object" in text


def test_every_committed_results_file_has_a_summary_with_verdicts_from_its_rows() -> None:
    for path in RESULTS.glob("*.json"):
        s = json.loads(path.read_text())["summary"]
        assert {"title", "machine", "date", "command", "rows"} <= set(s), path.name
        assert all(len(row) == 4 and row[3] in ("met", "missed", "") for row in s["rows"])
