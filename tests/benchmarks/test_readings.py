"""The benchmarks' sentences follow their numbers: each verdict fed two result sets, the
committed one and one changed the other way, flips. Fast, no servers."""

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


def test_ledger_section_from_old_and_new_results() -> None:
    old = load("ledger")  # on, off, on, off: two pairs, no "pairs" entry
    text = ledger.section(old)
    assert "| 1 | on, off | 2131.0 | 2418.2 | 11.9% |" in text
    assert "not distinguishable from run-to-run noise" in text
    assert "8,143: the two are equal" in text

    new = copy.deepcopy(old)
    new["accounting"]["pairs"] = [
        {"order": "on, off" if i % 2 == 0 else "off, on", "on": 2000.0 - i, "off": 2200.0 - i}
        for i in range(8)
    ]
    new["economics"].update(durable_calls=8140, exact=False)
    text = ledger.section(new)
    assert "in 8 alternated pairs" in text and "| 2 | off, on |" in text
    assert "Exact accounting costs" in text and "distinguishable from run-to-run noise" in text
    assert "the two **differ**" in text
    del new["economics"]  # --skip-economics
    assert "The economics run was skipped" in ledger.section(new)


# -- router ----------------------------------------------------------------------------------


def test_hop_targets_flip() -> None:
    r = load("router")
    text = readings.hop_reading(r["hop"], 2)
    assert "The router misses the target p50 <= 1.5x direct at c=1 (2.61x)" in text
    assert "misses throughput >= 0.9x direct at c=32 (0.51x)" in text
    assert "does 0.98x the bare proxy's throughput" in text
    assert "costs 2% of the bare proxy's throughput" in text

    fast = copy.deepcopy(r["hop"])
    fast["router"]["c1"]["p50_ms"] = fast["direct"]["c1"]["p50_ms"] * 1.2
    fast["router"]["c32"]["throughput_rps"] = fast["direct"]["c32"]["throughput_rps"] * 0.95
    text = readings.hop_reading(fast, 16)
    assert "The router meets the target p50 <= 1.5x direct at c=1 (1.2x)" in text
    assert "meets throughput >= 0.9x direct at c=32 (0.95x)" in text
    assert "(balancing, accounting, metrics) cost no throughput in this run" in text
    assert "the hop itself costs 48% of direct throughput" in text and "share 16 cores" in text


def test_policies_and_replicas_flip() -> None:
    r = load("router")
    assert "0.014x random's" in readings.policies_reading(r["policies"])
    assert ", lower);" in readings.policies_reading(r["policies"])
    worse = copy.deepcopy(r["policies"])
    next(p for p in worse if p["policy"] == "p2c")["p99_ms"] = 20000.0
    assert ", higher);" in readings.policies_reading(worse)

    rows = r["replicas"]["waiting 4 ms @180 rps"]
    assert "p99 falls (58.591 -> 18.015 -> 13.023 ms)" in readings.replicas_reading("w", rows)
    flat = r["replicas"]["compute-bound MLP @150 rps"]
    assert "p99 stays about flat" in readings.replicas_reading("c", flat)
    rising = copy.deepcopy(rows)
    rising[-1]["p99_ms"] = 90.0
    assert "p99 rises" in readings.replicas_reading("w", rising)


# -- MLServer -------------------------------------------------------------------------------------


def test_mlserver_names_every_point_where_meshserve_is_worse() -> None:
    r = load("mlserver")
    text = mlserver.section(r)
    assert "**not met** — 1.86x the throughput at 0.47x the p99" in text
    assert (
        "Points where meshserve's p99 is worse than MLServer's: "
        "meshserve router + 2 workers at c=32 (1.15x)."
    ) in text
    assert "Points where its throughput is lower: none." in text

    better = copy.deepcopy(r)
    better["summary"]["router_2_workers_over_mlserver_2_workers_c32"]["p99_ratio"] = 0.9
    better["summary"]["worker_over_mlserver_c1"]["throughput_ratio"] = 0.8
    better["summary"]["target_met"] = True
    text = mlserver.section(better)
    assert "p99 no worse): met —" in text
    assert "p99 is worse than MLServer's: none." in text
    assert "throughput is lower: meshserve worker (1 process) at c=1 (0.8x)." in text


# -- tensor parallelism ---------------------------------------------------------------------------


def test_tp_reading_flips_with_the_numbers() -> None:
    r = load("tp")
    text = readings.tp_reading(r)
    assert text.startswith(
        "On 2 CPU cores TP is slower than one process using every core at every point"
    )
    assert "it pays only in weight bytes per rank (MiniLM, SmolLM2)" in text
    assert "TP2 40.707 ms (1.75x)" in text and "3 ranks on 2 cores" in text
    assert "61 per token" in text  # 2 x 30 layers + 1, from the result's config_layers
    assert "about 48 MB per rank is replicated" in text

    fast = copy.deepcopy(r)
    fast["machine"]["cores"] = 4
    for batch in fast["minilm"]["latency"].values():
        for row in batch:
            if row["threads_per_rank"] == 2:
                row["threads_per_rank"] = 4
            if row["tp"] == 2:
                row["total_ms"] = 1.0
    text = readings.tp_reading(fast)
    assert text.startswith("On 4 CPU cores TP beats one process using every core at: ")
    assert "MiniLM TP2 at batch1, MiniLM TP2 at batch8." in text
    assert "3 ranks on 2 cores" not in text and "3 ranks on 4 cores" not in text
    assert tp.section(fast).endswith(text)

    heavy = copy.deepcopy(r)
    for model in ("minilm", "smollm2"):
        w = heavy[model]["weight_bytes_per_rank"]
        for k in w:
            w[k] = list(w["tp1"])
    assert "its weight bytes per rank do not fall either" in readings.tp_reading(heavy)


def test_router_section_names_client_limited_points() -> None:
    r = load("router")
    assert "Client-limited" not in router.section(r)  # results before the flag
    flagged = copy.deepcopy(r)
    point = flagged["policies"][0]
    point["client_limited"] = True
    point["client"] = {"reason": "send lag p99 80 ms (above 50 ms)"}
    text = router.section(flagged)
    assert "Client-limited, so measuring the load generator rather than the mesh: " in text
    assert "policy p2c (send lag p99 80 ms (above 50 ms))." in text


# -- the LLM anchor: llama-server's strongest configuration per target --------------------------


def _server(decode: float, ttft: float, tok_s: tuple[float, ...], peak: float) -> dict:
    levels = [
        {"streams": c, "output_tokens_per_s": t, "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0}}
        for c, t in zip((8, 16, 32), tok_s, strict=True)
    ]
    return {
        "single": {"decode_tokens_per_s": decode, "ttft_ms": ttft},
        "load": levels,
        "rss_mb": {"start": 100.0, "peak": peak},
    }


def test_the_anchor_checks_each_target_against_llama_servers_strongest_figure() -> None:
    from benchmarks import llm_serve

    runs = {
        "default": _server(100.0, 20.0, (80.0, 100.0, 90.0), 1100.0),
        "PASSIVE": _server(40.0, 90.0, (85.0, 120.0, 80.0), 1090.0),
    }
    best = llm_serve.strongest(runs)
    assert best["single"] == {
        "decode_tokens_per_s": 100.0,
        "ttft_ms": 20.0,
        "by": {"decode": "default", "ttft": "default"},
    }
    assert [(lv["output_tokens_per_s"], lv["by"]) for lv in best["load"]] == [
        (85.0, "PASSIVE"),
        (120.0, "PASSIVE"),
        (90.0, "default"),
    ]
    assert best["rss_mb"]["peak"] == 1090.0 and best["rss_mb"]["by"] == "PASSIVE"

    worker = _server(115.0, 19.0, (200.0, 235.0, 230.0), 1000.0)
    for lv in worker["load"]:
        lv["itl_ms"] = {"p50": 10.0, "p99": 20.0}
    checks, lines = llm_serve.verdict(best, worker)
    assert checks["single_decode_vs_llama_server"]["met"]  # 1.15x the spinning run's 100
    sixteen = checks["aggregate_16_vs_llama_server"]  # 235 / 120 (PASSIVE's) = 1.96
    assert sixteen["value"] == 1.96 and not sixteen["met"]
    assert checks["aggregate_32_vs_llama_server"]["value"] == round(230 / 90, 2)
    line = next(x for x in lines if x.startswith("aggregate_16"))
    assert line.endswith("(target >= 2.0, against llama-server, OMP_WAIT_POLICY PASSIVE): MISSED")
    # against the passive run alone, the single stream would have looked 2.9x
    alone = llm_serve.verdict(llm_serve.strongest({"PASSIVE": runs["PASSIVE"]}), worker)[0]
    assert alone["single_decode_vs_llama_server"]["value"] == round(115 / 40, 2)


def test_the_anchor_judges_unrounded_ratios() -> None:
    """A peak 0.2% over llama-server's misses its target of 1.0, shown as 1.002, not 1.0."""
    from benchmarks import llm_serve

    server = llm_serve.strongest({"default": _server(100.0, 20.0, (80.0, 100.0, 90.0), 1082.4)})
    worker = _server(120.0, 10.0, (200.0, 250.0, 250.0), 1084.4)
    for lv in worker["load"]:
        lv["itl_ms"] = {"p50": 10.0, "p99": 20.0}
    rss = llm_serve.verdict(server, worker)[0]["rss_peak_vs_llama_server"]
    assert rss == {
        "value": 1.002,
        "target": 1.0,
        "met": False,
        "against": "llama-server, OMP_WAIT_POLICY default",
    }
