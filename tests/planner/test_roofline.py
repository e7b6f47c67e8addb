"""Profiles, the Roofline verdicts and the queueing model, against known answers."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from perfmodel import profiles
from perfmodel.analysis import DECODER, ENCODER, ModelAnalysis
from perfmodel.queueing import erlang_c, md_c_decay, poisson_quantile, predict, wait_quantile
from perfmodel.roofline import diagnose

# Llama-3-8B's shape in bf16 (the issue's reference model): 8.03 B parameters, of which
# 7.5 B in projections and 0.5 B in the embedding table; 32 layers, 8 KV heads of 128.
LLAMA_8B = ModelAnalysis(
    name="llama-8b",
    version="1",
    recipe="bf16",
    kind=DECODER,
    weight_bytes=16_060_000_000,
    projection_params=7_500_000_000,
    projection_bytes=15_000_000_000,
    head_params=525_000_000,
    table_row_bytes=8192,
    other_bytes=0,
    output_bytes_per_row=128_256 * 4,
    layers=32,
    heads=32,
    kv_heads=8,
    attention_width=4096,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    compute_dtype_cpu="bf16",
    compute_dtype_gpu="bf16",
)


def test_named_profiles_cite_datasheets_and_have_ridges() -> None:
    for name in ("H200", "H100", "A100", "L4"):
        p = profiles.load(name.lower())
        assert "datasheet" in p.source
        assert p.ridge("bf16") > p.ridge("fp32") > 1
    h200 = profiles.load("H200")
    assert h200.ridge("bf16") == pytest.approx(989.5e12 * 0.78 / (4.8e12 * 0.88))


def test_profile_files_round_trip_and_errors_name_what_is_known(tmp_path: Path) -> None:
    path = profiles.save(profiles.load("L4"), tmp_path / "mine.json")
    assert profiles.load(str(path)) == profiles.load("L4")
    with pytest.raises(profiles.ProfileError, match=r"unknown profile 'B300'.*'A100'"):
        profiles.load("B300")
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(profiles.ProfileError, match="not a profile"):
        profiles.load(str(tmp_path / "bad.json"))


def test_llama_decode_matches_the_issues_h200_roofline() -> None:
    """The issue's reference: roofline 3.8 ms at batch 1, 7.8 ms at batch 64 / context 2,048
    (bytes over the 4.24 TB/s the H200 copies at; the CUDA-graph launch cost apart). The
    issue counts the whole 16 GB; a decode step gathers one row of the 1 GB embedding
    table, so ours is 3.55 ms: within 8%."""
    h200 = replace(profiles.load("H200"), call_overhead_s=0.0)
    one = diagnose(LLAMA_8B, h200, 1, 0)
    assert one.bound == "bandwidth"
    assert one.time_s * 1e3 == pytest.approx(15.0e9 / (4.8e12 * 0.88) * 1e3, rel=0.001)
    assert one.time_s * 1e3 == pytest.approx(3.8, rel=0.08)
    busy = diagnose(LLAMA_8B, h200, 64, 2048)
    # At 2,048 tokens of context the KV bytes grow with the batch as fast as the FLOPs:
    # no batch reaches the ridge, and the advice says so.
    assert busy.bound == "bandwidth" and "no batch up to 4096" in busy.help
    assert busy.time_s * 1e3 == pytest.approx(7.8, rel=0.05)


def test_verdicts_capacity_compute_overhead() -> None:
    h200 = profiles.load("H200")
    # 64 sequences of 128k tokens: 2.1 TB of KV cannot fit 141 GB; TP 8 splits it, still no.
    assert diagnose(LLAMA_8B, h200, 64, 131_072).bound == "capacity"
    # A prompt-sized batch of rows: past the ridge.
    prefill_like = diagnose(LLAMA_8B, h200, 2048, 0)
    assert prefill_like.bound == "compute" and prefill_like.intensity > prefill_like.ridge
    # A tiny encoder on a GPU: the per-call cost dwarfs its bytes and FLOPs.
    tiny = replace(
        LLAMA_8B,
        kind=ENCODER,
        projection_params=10**6,
        projection_bytes=4 * 10**6,
        weight_bytes=4 * 10**6,
        kv_bytes_per_token=0,
        default_tokens=16,
    )
    d = diagnose(tiny, h200, 1)
    assert d.bound == "overhead" and "batch" in d.help
    # TP splits the bytes: the 64 x 16k-token load fits over 4 devices, not on 1.
    assert diagnose(LLAMA_8B, h200, 64, 16_384).bound == "capacity"
    assert diagnose(LLAMA_8B, h200, 64, 16_384, tp=4).fits


def test_erlang_c_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 0.0) == 0.0


def test_md_c_tail_matches_a_simulated_queue() -> None:
    """The p99 wait from Erlang C and M/D/c's decay rate against an M/D/c queue simulated
    call by call (Kiefer-Wolfowitz: the c servers' next-free times), 200k Poisson arrivals."""
    rng = np.random.default_rng(0)
    for c, d, rho in ((1, 0.4, 0.5), (1, 0.01, 0.8), (4, 0.02, 0.7)):
        lam = rho * c / d
        free = np.zeros(c)  # when each server next frees up, sorted
        waits = np.empty(200_000)
        t = 0.0
        for i, gap in enumerate(rng.exponential(1 / lam, waits.size)):
            t += gap
            start = max(t, free[0])
            waits[i] = start - t
            free[0] = start + d
            free.sort()
        theta = md_c_decay(lam, c, d)
        if c == 1:  # the classical M/D/1 root
            assert lam * math.expm1(theta * d) == pytest.approx(theta)
        predicted = wait_quantile(erlang_c(c, lam * d), theta, 0.01)
        assert predicted == pytest.approx(np.quantile(waits, 0.99), rel=0.15), (c, d, rho)


def test_trip_tail_grows_with_the_busy_cores() -> None:
    """The mesh trip's p99 by busy cores: through the probed points (made non-decreasing),
    flat below them, rising as a wait for n cores does (1 / (n - busy)), unbounded at n."""
    p = replace(
        profiles.load("H200"),
        kind="cpu",
        cores=2,
        mesh_tail=[[1.4, 0.05], [0.5, 0.01], [0.9, 0.02]],
    )
    assert [p.trip_p99(c) for c in (0.5, 0.9, 1.4)] == pytest.approx([0.01, 0.02, 0.05])
    assert p.trip_p99(0.1) == pytest.approx(0.01)
    rising = [p.trip_p99(c) for c in (0.6, 1.0, 1.2, 1.6, 1.9)]
    assert rising == sorted(rising) and 0.02 < p.trip_p99(1.2) < 0.05
    assert p.trip_p99(1.9) > 0.05 and math.isinf(p.trip_p99(2.0))
    # a noisy window that falls is pooled with its neighbour: a busier host is never faster
    noisy = replace(p, mesh_tail=[[0.48, 0.016], [0.75, 0.0064], [1.26, 0.060]])
    assert noisy.trip_p99(0.48) == noisy.trip_p99(0.75) == pytest.approx(0.0112)
    assert noisy.trip_p99(1.26) == pytest.approx(0.060)
    assert replace(p, mesh_tail=[], mesh_latency_p99_s=0.03).trip_p99(1.0) == 0.03


def test_queueing_batches_saturates_and_replicas_cut_the_tail() -> None:
    def service(b: int) -> float:  # 4 ms fixed + 1 ms per item
        return 0.004 + 0.001 * b

    low = predict(10, 1, 8, service)
    assert low.batch == pytest.approx(1, abs=0.01) and low.p99_s < 0.02
    busy = predict(500, 1, 8, service)
    assert busy.batch > 1  # the batcher fills up under load
    assert predict(500, 1, 8, service).capacity_rps == pytest.approx(8 / 0.012)
    over = predict(1000, 1, 8, service)
    assert over.utilisation >= 1 and math.isinf(over.p99_s)
    assert predict(500, 3, 8, service).p99_s < busy.p99_s
    # A shared host: three replicas on two cores give no more than the cores allow.
    shared = predict(100, 3, 1, service, host_cores=2, cpu_per_call_s=0.001)
    assert shared.capacity_rps == pytest.approx(2 / (0.001 + 0.005))
    assert shared.limit == "host cores"


def test_shared_host_background_and_free_cores() -> None:
    def service(b: int) -> float:  # 1 ms fixed + 2 ms per item
        return 0.001 + 0.002 * b

    alone = predict(50, 1, 8, service, host_cores=2, cpu_per_call_s=0.001)
    busy = predict(50, 1, 8, service, host_cores=2, cpu_per_call_s=0.001, background_cores=1)
    # Other jobs keep a core: the host limit halves, and the runs wait longer for the rest.
    assert busy.capacity_rps < alone.capacity_rps
    assert busy.p99_s > alone.p99_s
    # Saturation runs full batches; a replica alone on free cores is not stretched.
    assert alone.saturation_batch == 8
    assert alone.capacity_rps == pytest.approx(min(8 / 0.017, 2 / (0.001 + 0.017 / 8)))
    # Three single-threaded replicas on two cores stretch each other's runs at saturation.
    three = predict(50, 3, 8, service, host_cores=2, cpu_per_call_s=0.0)
    assert three.capacity_rps == pytest.approx(2 * 8 / 0.017)
    # A p99 mesh trip, when probed, is what the p99 adds (the median stays with p50).
    tail = predict(50, 1, 8, service, 0.002, mesh_latency_p99_s=0.010)
    assert tail.p99_s - predict(50, 1, 8, service, 0.002).p99_s == pytest.approx(0.008)


def test_continuous_batching_joins_running_sequences() -> None:
    def generation(b: int) -> float:  # b prefills of 0.1 s + 31 shared steps of 10 + 5 b ms
        return 0.1 * b + 31 * (0.010 + 0.005 * b)

    per_run = predict(2.0, 1, 4, generation)
    per_step = predict(2.0, 1, 4, generation, continuous=True)
    # Same capacity (full slots), but a call no longer waits for a whole batch to end.
    assert per_step.capacity_rps == pytest.approx(per_run.capacity_rps)
    assert per_step.p99_s < per_run.p99_s
    # Little's law: the running sequences settle at lam x T(k).
    k = per_step.batch
    t = generation(1) + (generation(2) - generation(1)) * (k - 1)
    assert k > 1 and k == pytest.approx(2.0 * t, rel=1e-3)
    # The p99 call runs among the 99th percentile of others (Poisson(lam T), 1 + that
    # capped at the 4 slots), not among the mean k.
    assert 1 + poisson_quantile(2.0 * t, 0.99) >= 4
    assert per_step.p99_s >= generation(4) > generation(2)


def test_poisson_quantile() -> None:
    assert [poisson_quantile(m, 0.99) for m in (0.0, 1.0, 10.0)] == [0, 4, 18]
    assert poisson_quantile(1.0, 0.5) == 1


def test_a_service_measured_under_load_is_not_slowed_again() -> None:
    def service(b: int) -> float:
        return 0.004 + 0.001 * b

    args = dict(host_cores=2, cpu_per_call_s=0.002, open_cpu=(0.1, 0.002))
    bare = predict(150, 1, 8, service, **args)  # type: ignore[arg-type]
    measured = predict(150, 1, 8, service, contended=True, **args)  # type: ignore[arg-type]
    assert measured.capacity_rps == bare.capacity_rps
    assert measured.p99_s < bare.p99_s  # the cores' queue is already inside service(b)
