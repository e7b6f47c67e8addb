"""The capacity planner and the CLI over a real repository (the toy MLP)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import pytest

from devmesh import toy_models
from perfmodel import profiles
from planner.__main__ import main
from planner.plan import Prices, Workload, plan
from tests.planner.test_roofline import LLAMA_8B

NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)


def test_cheapest_configuration_meets_the_slo_and_the_rest_say_why() -> None:
    h200 = profiles.load("H200")
    w = Workload(qps=20, p99_s=4.0, context=512, max_tokens=128)
    prices = Prices(4.0, per_call_micro_usd=2000, training_cost_micro_usd=10**12)
    result = plan([LLAMA_8B], h200, w, prices, NOW)
    best = result.best
    assert best is not None and best.meets
    assert best.prediction.p99_s <= w.p99_s and best.prediction.capacity_rps > w.qps
    assert best.cost_per_hour_usd == best.replicas * best.tp * 4.0
    # Nothing that meets the SLO is cheaper.
    assert all(c.cost_per_hour_usd >= best.cost_per_hour_usd for c in result.runners_up if c.meets)
    assert all(c.why for c in result.runners_up if not c.meets)
    e = result.economics
    assert e["cost_per_call_usd"] == pytest.approx(best.cost_per_hour_usd / (20 * 3600))
    assert e["cost_per_1k_output_tokens_usd"] == pytest.approx(
        best.cost_per_hour_usd / (20 * 3600 * 128) * 1000
    )
    # The ledger's break-even: N* = T / (p - c), dated at 20 calls/s from NOW.
    c = best.cost_per_hour_usd * 1e6 / (20 * 3600)
    assert e["break_even_calls"] == pytest.approx(10**12 / (2000 - c), rel=1e-3)
    days = e["break_even_calls"] / (20 * 86400)
    assert e["break_even_date"] == (NOW + dt.timedelta(days=days)).date().isoformat()


def test_capacity_bound_configurations_need_tp_or_fewer_bytes() -> None:
    l4 = profiles.load("L4")  # 24 GB: the 16 GB of weights fit, long contexts do not
    w = Workload(qps=0.5, p99_s=600.0, context=8192, max_tokens=512)
    result = plan([LLAMA_8B], l4, w, Prices(0.8), NOW)
    assert result.best is not None
    assert result.best.tp > 1 or result.best.max_batch <= 2
    misses = [c for c in result.runners_up if not c.fits]
    assert all("does not fit" in c.why and "capacity-bound" in c.why for c in misses)


def test_no_configuration_for_an_impossible_slo() -> None:
    result = plan([LLAMA_8B], profiles.load("H200"), Workload(5, 0.001, 512, 64), Prices(4.0))
    assert result.best is None
    assert result.runners_up and all(c.why for c in result.runners_up)
    assert any("misses the SLO" in c.why for c in result.runners_up)


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    toy_models.write(
        tmp_path / "repo" / "mlp",
        toy_models.mlp(hidden=1024, features=512),
        'max_batch_size: 32\nparameters { key: "meshserve.price_per_call_micro_usd" '
        'value { string_value: "100" } }\n'
        'parameters { key: "meshserve.training_cost_micro_usd" '
        'value { string_value: "5000000" } }\n',
    )
    return tmp_path / "repo"


def test_cli_diagnose_prints_the_table_and_writes_the_plot(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "roofline.png"
    assert (
        main(
            [
                "diagnose",
                "--model-repository",
                str(repository),
                "--profile",
                "A100",
                "--batch",
                "1",
                "32",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ridge point fp32" in out and "mlp" in out
    assert "overhead" in out  # a tiny MLP on an A100: launch-bound
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_and_its_errors(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cpu = replace(
        profiles.load("L4"),
        name="test-cpu",
        kind="cpu",
        cores=2,
        interconnect_bandwidth=0.0,
        call_overhead_s=0.0,
        mesh_latency_s=0.001,
    )
    path = profiles.save(cpu, tmp_path / "cpu.json")
    args = [
        "plan",
        "--model",
        "mlp",
        "--model-repository",
        str(repository),
        "--qps",
        "200",
        "--p99-ms",
        "20",
        "--profile",
        str(path),
        "--price-per-hour",
        "0.5",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cheapest: 1 replica(s) x TP 1" in out and "break-even" in out
    assert "M/D/c" in out
    assert main([*args[:2], "nope", *args[3:]]) == 2
    assert "no model 'nope'" in capsys.readouterr().err
    assert main([*args[:-3], str(tmp_path / "none.json"), *args[-2:]]) == 2
    assert "unknown profile" in capsys.readouterr().err


@pytest.mark.slow  # a Redis + worker + router mesh
def test_cli_calibrate_fits_a_profile_that_plan_reads(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A one-worker mesh serves the MLP at batch limits 1 and 4; the fitted profile is a
    profile file `plan` takes, whose S(b) passes through the served seconds per batch."""
    base = replace(
        profiles.load("L4"),
        name="test-cpu",
        kind="cpu",
        cores=2,
        mesh_cpu_s=0.001,
        mesh_router_cpu_s=0.0004,
    )
    base_path = profiles.save(base, tmp_path / "cpu.json")
    out = tmp_path / "served.json"
    common = ["--model", "mlp", "--model-repository", str(repository)]
    argv = ["calibrate", *common, "--max-batch", "4", "--seconds", "1"]
    assert main([*argv, "--profile", str(base_path), "--output", str(out)]) == 0
    served = json.loads(capsys.readouterr().out)
    assert [s["max_batch"] for s in served["served"]] == [1, 4]
    fitted = profiles.load(str(out))
    # the mesh's CPU per call beside the run, and the trip's tail with the model's call
    assert "as served" in fitted.name and fitted.mesh_cpu_s >= 0
    # (each measured p99 less the replica's own run and queue there)
    measured = served["served"][-1]["tail"]
    assert [busy for busy, _ in fitted.mesh_tail] == [busy for busy, _, _ in measured]
    assert all(
        0 <= trip < p99 for (_, trip), (_, p99, _) in zip(fitted.mesh_tail, measured, strict=True)
    )
    # the open loops' busy cores: a fixed part and CPU per call beside the run
    assert fitted.open_cpu() is not None and min(fitted.open_cpu() or (-1.0,)) >= 0
    assert fitted.call_overhead_s != base.call_overhead_s  # the fit moved the roof
    plan_args = ["plan", *common, "--qps", "50", "--p99-ms", "500", "--profile", str(out)]
    assert main([*plan_args, "--price-per-hour", "0.5", "--recipe", "fp32"]) == 0
    assert "cheapest" in capsys.readouterr().out
    assert main(["calibrate", *common, "--version", "9", "--profile", str(base_path)]) == 2
    assert "has no version '9'" in capsys.readouterr().err
