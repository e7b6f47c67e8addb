"""The calibration run: a model's own session timed alone, and the Roofline fitted to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from perfmodel import profiles
from perfmodel.analysis import analyse_file
from perfmodel.roofline import run_seconds
from planner.calibrate import Calibration, calibrate, fit
from planner.serving import TAIL_SHARES, ServingCalibration, calibrate_serving


def test_fit_recovers_overhead_and_efficiency() -> None:
    roof = {1: 0.001, 8: 0.008}
    measured = {b: 0.0005 + t / 0.5 for b, t in roof.items()}  # 0.5 ms fixed, half the roof
    overhead, efficiency = fit(roof, measured)
    assert overhead == pytest.approx(0.0005)
    assert efficiency == pytest.approx(0.5)
    # Runs that grow faster than the roof: a negative fixed cost, still through both points.
    overhead, efficiency = fit({1: 0.007, 4: 0.0076}, {1: 0.0165, 4: 0.028})
    assert overhead < 0
    assert overhead + 0.007 / efficiency == pytest.approx(0.0165)
    assert overhead + 0.0076 / efficiency == pytest.approx(0.028)
    # One batch, or a slope the noise made negative: no fixed cost, the ratio at the top.
    assert fit({1: 0.001}, {1: 0.004}) == (0.0, pytest.approx(0.25))
    assert fit(roof, {1: 0.009, 8: 0.008}) == (0.0, pytest.approx(1.0))


def test_calibrated_profile_reproduces_the_timed_runs(wide_paths: tuple[Path, Path]) -> None:
    path = wide_paths[0]
    m = analyse_file(path, "wide", "1")
    local = profiles.load("H200")  # any roof: the fit absorbs it
    cal = calibrate(path, m, local, 8, threads=1, tokens=1, budget_s=0.2)
    assert set(cal.runs_s) == {1, 8} and cal.prefill_s == 0.0
    fitted = cal.profile(local)
    # Both timed points when the fit found a line, else the largest batch's.
    rising = cal.runs_s[8] > cal.runs_s[1]
    exact = cal.runs_s if rising else {8: cal.runs_s[8]}
    for b, measured in exact.items():
        assert run_seconds(m, fitted, b, 0, 1, 1, 1) == pytest.approx(measured, rel=1e-6)
    assert Calibration.from_dict(cal.as_dict()).efficiency == pytest.approx(cal.efficiency, 1e-2)


def test_decoder_calibration_times_prefill_and_steps(tiny_llm_path: Path) -> None:
    m = analyse_file(tiny_llm_path, "tiny", "1")
    cal = calibrate(tiny_llm_path, m, profiles.load("H200"), 2, prompt=8, context=12, budget_s=0.2)
    assert set(cal.runs_s) == {1, 2}
    assert cal.prefill_s > 0 and all(s > 0 for s in cal.runs_s.values())


@pytest.mark.slow  # a Redis + worker + router mesh
def test_serving_calibration_saturates_a_real_worker(wide_paths: tuple[Path, Path]) -> None:
    """A one-worker mesh (Redis, worker, router) serving the model at batch limits 1 and 4:
    the batches the worker formed, its seconds per batch and the host CPU per call, read
    back as the planner uses them."""
    cal = calibrate_serving(wide_paths[0], "wide", (4, 1), tokens=1, seconds=1.0)
    one, four = cal.served
    assert (one.max_batch, four.max_batch) == (1, 4)
    assert one.batch == 1.0 and 1.0 < four.batch <= 4.0  # 8 callers keep 4 queued
    for s in cal.served:
        assert s.rps > 0 and 0 < s.run_s < s.batch / s.rps  # a run is part of its cycle
        assert s.cpu_per_call_s > 0
    # the trip's tail under Poisson arrivals, at the largest limit only, against the host's
    # busy cores (ours and other jobs': how many depends on what else runs here)
    assert not one.tail and len(four.tail) == 3
    cores = os.cpu_count() or 1
    assert all(0 < busy <= cores * 1.01 and p99 > 0 and rate > 0 for busy, p99, rate in four.tail)
    assert [r for _, _, r in four.tail] == pytest.approx([four.rps * f for f in TAIL_SHARES], 0.02)
    cycles = cal.cycles_s()
    assert set(cycles) == {1, round(four.batch)}
    # f + g / b passes through both points
    assert cal.cpu_per_call_s(1) == pytest.approx(one.cpu_per_call_s)
    assert cal.cpu_per_call_s(four.batch) == pytest.approx(four.cpu_per_call_s)
    assert ServingCalibration.from_dict(cal.as_dict()).served[1].batch == pytest.approx(
        four.batch, abs=1e-5
    )
