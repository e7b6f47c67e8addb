"""`python -m planner validate`: its flags (from ValidateSettings), the verdicts over the
rows, the reasons a miss gets, and its section of benchmarks/README.md — on the committed
planner.json and on rows changed to flip each verdict. Fast: no mesh is started."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from common import cli
from perfmodel.profiles import Profile
from planner import __main__ as planner_cli
from planner.validate import report
from planner.validate.configs import CONFIGS, TARGETS, ValidateSettings
from planner.validate.predict import explain, missed, summarize

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "planner.json"


def committed() -> dict:
    return json.loads(RESULT.read_text())


def settings(argv: list[str]) -> ValidateSettings:
    return cli.from_args(ValidateSettings, planner_cli.parser().parse_args(["validate", *argv]))


def test_flags_over_environment_over_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s = settings([])
    assert s.seconds == 5.0 and not s.skip_llm and not s.reanalyse
    assert s.results.parts[-2:] == ("benchmarks", "results")
    monkeypatch.setenv("MESHSERVE_PLANNER_VALIDATE_SECONDS", "2.5")
    assert settings([]).seconds == 2.5
    s = settings(["--seconds", "1", "--skip-llm", "--results", str(tmp_path)])
    assert s.seconds == 1.0 and s.skip_llm and s.results == tmp_path


def test_a_bad_flag_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert planner_cli.main(["validate", "--seconds", "0"]) == 2
    err = capsys.readouterr().err
    assert "seconds" in err and "greater than 0" in err


def test_the_summary_of_the_committed_rows_is_the_committed_summary() -> None:
    r = committed()
    assert {c.label for c in CONFIGS} >= {row["config"] for row in r["configurations"]}
    assert summarize(r["configurations"]) == r["accuracy"]
    assert r["summary"]["rows"] == report.rows(r)


def test_summary_verdicts_follow_the_errors() -> None:
    rows = copy.deepcopy(committed()["configurations"])
    for row in rows:
        for key in ("roofline", "calibrated", "served"):
            row[key].update(throughput_error=0.05, p99_error=-0.1)
    s = summarize(rows)
    assert s["served"]["met"] == {"throughput": True, "p99": True} and not s["served"]["misses"]
    rows[0]["served"]["p99_error"] = TARGETS["p99"] + 0.01
    assert missed(rows[0]["served"]) and summarize(rows)["served"]["misses"] == [rows[0]["config"]]
    for row in rows:
        row["served"]["throughput_error"] = -0.5
    assert summarize(rows)["served"]["met"]["throughput"] is False


def test_a_miss_gets_the_reason_its_numbers_show() -> None:
    c = CONFIGS[2]  # MiniLM int8 x2 b8
    profile = Profile(**committed()["profile"])
    loop = {"runs": 100, "mean_batch": 3.0, "run_ms": 4.0, "host_cpu_ms_per_call": 1.5}
    meas = {
        "throughput_rps": 400.0,
        "offered_rps": 200.0,
        "background_cores": 0.0,
        "closed": {**loop, "other_cores": 0.0},
        "open": {**loop, "other_cores": 0.9},
    }
    pred = {"saturation_batch": 8, "run_ms_at_saturation": 15.0, "limit": "replicas"}
    why = explain(c, pred, meas, profile)
    assert any("formed batches of 3.0" in w and "has 8" in w for w in why)
    assert any("other jobs on this machine took 0.90 cores" in w for w in why)
    meas["closed"]["mean_batch"] = 8.0  # batches as predicted, cycle 2 x 8 / 400 = 40 ms
    assert any("a replica took 40.00 ms per batch" in w for w in explain(c, pred, meas, profile))


def test_section_names_the_command_and_flips_with_the_misses() -> None:
    r = committed()
    text = report.section(r)
    assert f"`{report.COMMAND}`" in text and "python -m benchmarks.planner" not in text
    assert text.count("\n| ") == len(r["configurations"]) + 1  # header + one row each
    for row in r["configurations"]:
        row["explanation"] = []
    assert "No misses." in report.section(r)
    # a queue that never settles: an unbounded p99 is written as null (loadtest/results.py)
    r["configurations"][0]["served"].update(p99_ms=None, p99_error=None)
    r["accuracy"]["served"]["median_abs_p99_error"] = None
    text = report.section(r)
    assert "unbounded (unbounded)" in text and "p99 median |error| unbounded" in text
