"""The interleaved anchor (benchmarks/llm_paired.py): its turn order runs every pair of sides
both ways every two rounds; its verdict is the median of per-round ratios, against the
llama-server setting that leaves the worker weakest, and a miss is written as one; and its
rounds, driven against two fake streaming servers, give both sides the same prompts per
round. Fast: no model."""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from benchmarks import llm_paired, llm_serve
from common.corpus import python_reference
from tests.loadtest.test_llm_openai import serve


def test_every_pair_of_sides_runs_both_ways_every_two_rounds() -> None:
    assert ["".join(llm_paired.order("ABC", r)) for r in range(6)] == [
        "ABC",
        "CBA",
        "BCA",
        "ACB",
        "CAB",
        "BAC",
    ]
    assert ["".join(llm_paired.order("AB", r)) for r in range(4)] == ["AB", "BA", "BA", "AB"]
    for names in ("AB", "ABC", "ABCD"):
        for k in range(4):
            first, second = (llm_paired.order(names, 2 * k + i) for i in (0, 1))
            assert sorted(first) == sorted(names)
            for x, y in itertools.combinations(names, 2):
                assert (first.index(x) < first.index(y)) != (second.index(x) < second.index(y))


DRIFT = (1.0, 1.25, 0.8, 1.2, 0.85)  # this VM's speed, round by round


def _side(decode: list, ttft: list, tok_s: dict[int, list], peak: float) -> dict:
    return {
        "single": {
            "each_round": [
                {"decode_tokens_per_s": d, "ttft_ms": t} for d, t in zip(decode, ttft, strict=True)
            ]
        },
        "load": [
            {
                "streams": c,
                "each_round": [
                    {"output_tokens_per_s": v, "itl_ms": {"p50": 10.0, "p99": 20.0 + 3 * i}}
                    for i, v in enumerate(values)
                ],
            }
            for c, values in tok_s.items()
        ],
        "rss_mb": {"start": 100.0, "peak": peak},
    }


def _drifting(decode: float, ttft: float, tok_s: dict[int, float], peak: float) -> dict:
    return _side(
        [decode * d for d in DRIFT],
        [ttft / d for d in DRIFT],
        {c: [v * d for d in DRIFT] for c, v in tok_s.items()},
        peak,
    )


def test_the_verdict_is_the_median_of_per_round_ratios_against_the_weakest_pairing() -> None:
    servers = {
        "default": _drifting(100.0, 20.0, {8: 100.0, 16: 120.0, 32: 100.0}, 1100.0),
        "PASSIVE": _drifting(90.0, 30.0, {8: 110.0, 16: 130.0, 32: 90.0}, 1090.0),
    }
    worker = _drifting(115.0, 10.0, {8: 300.0, 16: 250.0, 32: 260.0}, 1000.0)
    checks, lines = llm_paired.verdict(servers, worker)

    decode = checks["single_decode_vs_llama_server"]  # 1.15 each round, whatever the drift
    assert decode["met"] and decode["value"] == 1.15 and decode["against"] == "default"
    assert decode["rounds"] == [1.15] * 5 and decode["medians"]["PASSIVE"] == 1.28
    sixteen = checks["aggregate_16_vs_llama_server"]  # 250 / 130 = 1.92 against PASSIVE
    assert sixteen["against"] == "PASSIVE" and sixteen["value"] == 1.92 and not sixteen["met"]
    line = next(x for x in lines if x.startswith("aggregate_16"))
    assert line.endswith("against llama-server, OMP_WAIT_POLICY PASSIVE): MISSED")
    assert checks["aggregate_32_vs_llama_server"]["value"] == 2.6  # 260 / 100, default's
    assert checks["single_ttft_vs_llama_server"]["value"] == 0.5  # 10 / 20, default's
    itl = checks["itl_p99_over_p50_8"]  # 2.0, 2.3, 2.6, 2.9, 3.2: median 2.6
    assert itl["rounds"] == [2.0, 2.3, 2.6, 2.9, 3.2] and itl["value"] == 2.6 and itl["met"]
    rss = checks["rss_peak_vs_llama_server"]
    assert rss["against"] == "PASSIVE" and rss["value"] == round(1000 / 1090, 2) and rss["met"]

    drift = llm_paired.drift_reading(servers, worker, checks)  # 1.25 / 0.8 on each side
    assert "single_decode: llama-server default 1.56x, the worker 1.56x, their per-round " in drift
    assert "aggregate_16: llama-server PASSIVE 1.56x" in drift and "ratio 1.0x" in drift

    # one bad round is outvoted; three of five turn the verdict
    worker["single"]["each_round"][1]["decode_tokens_per_s"] = 50.0
    assert llm_paired.verdict(servers, worker)[0]["single_decode_vs_llama_server"]["met"]
    for r in (0, 2):
        worker["single"]["each_round"][r]["decode_tokens_per_s"] = 100.0 * DRIFT[r]
    decode = llm_paired.verdict(servers, worker)[0]["single_decode_vs_llama_server"]
    assert decode["value"] == 1.0 and not decode["met"]


def test_missing_rounds_count_against_the_worker() -> None:
    assert llm_paired.ratios([2.0, None, 3.0], [1.0, 1.0, None]) == [2.0, None, None]
    assert llm_paired.median([2.0, None, None]) is None  # one round of three: no verdict
    assert llm_paired.median([2.0, 4.0, None]) == 3.0
    server = _drifting(100.0, 20.0, {16: 100.0}, 1000.0)
    worker = _drifting(200.0, 10.0, {16: 300.0}, 900.0)
    for e in worker["load"][0]["each_round"][:3]:
        e["output_tokens_per_s"] = 0.0  # every request of those rounds failed
    sixteen = llm_paired.verdict({"default": server}, worker)[0]["aggregate_16_vs_llama_server"]
    assert sixteen["value"] is None and not sixteen["met"]
    assert sixteen["rounds"][:3] == [None] * 3


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"])
    tok.train_from_iterator([python_reference()[:50_000]], trainer)
    return tok


def test_rounds_take_turns_with_the_same_prompts_on_every_side(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm_paired, "SETTLE_S", 0.0)
    plan = llm_serve.Plan(rounds=2, levels=(2,), decode_tokens=3, load_tokens=3, level_seconds=20)

    async def main() -> tuple[dict, list[dict], list[dict]]:
        seen_a: list[dict] = []
        seen_b: list[dict] = []
        (server_a, port_a), (server_b, port_b) = await serve(seen_a), await serve(seen_b)
        async with server_a, server_b:
            sides = [
                llm_paired.Side(n, f"http://127.0.0.1:{p}", "openai", "m", os.getpid())
                for n, p in (("A", port_a), ("B", port_b))
            ]
            out = await llm_paired.measure(sides, plan, tokenizer, 3, sizes=(8, 24, 12))
        return out, seen_a, seen_b

    out, seen_a, seen_b = asyncio.run(main())
    measured = [t for t in out["turns"] if t["what"] != "warm-up"]
    assert [t["side"] for t in measured] == list("ABBABA" + "ABBA")
    assert [t["what"] for t in measured] == ["single"] * 6 + ["c=2"] * 4
    # warm-up: 1 + 2 requests; single: opener + 1 a round; c=2: 2 x 2 requests a round
    assert len(seen_a) == len(seen_b) == 3 + 3 * 2 + 2 * 4
    assert [b["prompt"] for b in seen_a][3:9] == [b["prompt"] for b in seen_b][3:9]
    assert [b["max_tokens"] for b in seen_a][3:9] == [1, 3] * 3
    for r in range(2):  # each load round: the same prompts on both sides and in every round
        a, b = (sorted(x["prompt"] for x in s[9 + 4 * r : 13 + 4 * r]) for s in (seen_a, seen_b))
        assert a == b and {x["prompt"] for x in seen_a[9:13]} == set(a)
    assert len(set(a)) == 3  # the three sizes, the first again as the fourth request
    a, b = out["sides"]["A"], out["sides"]["B"]
    assert a["single"]["rounds"] == 3 and a["single"]["decode_tokens_per_s"] > 0
    assert [lv["streams"] for lv in b["load"]] == [2] and len(b["load"][0]["each_round"]) == 2
    assert set(out["idle_cpu"]) == {"A", "B"}
    assert all(t["others_cores"] is not None and t["others_cores"] >= 0 for t in out["turns"])
    assert llm_paired.contention_reading(out["turns"]).startswith("Processes outside this run")
    busy = [{**t, "others_cores": 1.0 if i == 3 else 0.0} for i, t in enumerate(measured)]
    assert "1 of 10 turns saw 0.25 or more (most: 1.0 in single round 1, A)" in (
        llm_paired.contention_reading(busy)
    )
    checks, lines = llm_paired.verdict({"A": a}, b)
    assert len(checks["single_decode_vs_llama_server"]["rounds"]) == 3
    assert all(line.endswith((": met", ": MISSED")) for line in lines)
