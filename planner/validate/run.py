"""The whole validation: build what is missing, probe this machine and the mesh, calibrate
each model x recipe (its session alone, and each encoder through a one-worker mesh), run
every configuration, write planner.json and the Roofline plots; or, with `reanalyse`,
recompute the predictions from the measurements already in planner.json."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from loadtest.results import machine, summary_block, write_json
from perfmodel import profiles
from perfmodel.analysis import ModelAnalysis, analyse_file
from perfmodel.profiles import Profile
from perfmodel.roofline import diagnose
from planner import probe
from planner.calibrate import Calibration, calibrate, refit
from planner.plot import roofline_png
from planner.serving import ServingCalibration, calibrate_serving
from planner.validate import report
from planner.validate.configs import (
    CONFIGS,
    PROMPT,
    STEP_CONTEXT,
    TOKENS,
    Config,
    ValidateSettings,
    artifact,
)
from planner.validate.measure import run_config
from planner.validate.predict import predictions, summarize

NAME = "planner"  # results/planner.json: benchmarks/summary.py renders its summary rows


def validate(settings: ValidateSettings) -> dict:
    """Every configuration predicted, measured and compared; planner.json written."""
    if settings.reanalyse:
        return reanalyse(settings)
    configs = [c for c in CONFIGS if not (settings.skip_llm and c.llm)]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for c in configs:  # build what is missing before anything is measured
            artifact(c.model, c.recipe, settings.cache)
        profile = probe.probe(2.0)
        overhead = probe.mesh_overhead(tmp / "probe", 6.0)
        profile = Profile(**{**profile.as_dict(), **overhead})
        profiles.save(profile, profiles.default_probed())
        analyses: dict[str, ModelAnalysis] = {}
        calibrations = calibrations_for(configs, profile, settings.cache, analyses)
        servings = servings_for(configs, settings.cache, min(settings.seconds, 3.0))
        rows = []
        for c in configs:
            rows.append(
                run_config(
                    c,
                    tmp,
                    profile,
                    settings.seconds,
                    settings.cache,
                    analyses,
                    calibrations,
                    servings,
                )
            )
            partial = {"profile": profile.as_dict(), "rows": rows}
            write_json(settings.results / f"{NAME}_partial.json", partial)
    accuracy = summarize(rows)
    result = {
        "benchmark": NAME,
        "machine": machine(),
        "machine_note": f"{machine()['cpu']}, {profile.cores} cores, no GPU, shared with "
        "other jobs (their CPU demand measured before each row)",
        "profile": profile.as_dict(),
        "calibrations": {k: v.as_dict() for k, v in calibrations.items()},
        "servings": {k: v.as_dict() for k, v in servings.items()},
        "seconds_per_point": settings.seconds,
        "configurations": rows,
        "accuracy": accuracy,
    }
    result["summary"] = summary_block(report.TITLE, report.rows(result), machine(), report.COMMAND)
    plots(rows, analyses, profile, settings.results)
    print(f"wrote {write_json(settings.results / f'{NAME}.json', result)}")
    (settings.results / f"{NAME}_partial.json").unlink(missing_ok=True)
    print(accuracy)
    return result


def calibrations_for(
    configs: list[Config], profile: Profile, cache: Path, analyses: dict[str, ModelAnalysis]
) -> dict[str, Calibration]:
    """Each model x recipe timed alone at batch 1 and its configurations' largest batch."""
    out = {}
    for key in dict.fromkeys(c.key for c in configs):
        model, recipe = key.split(" ")
        top = max(c.max_batch for c in configs if c.key == key)
        path = artifact(model, recipe, cache)
        a = analyses[key] = analyses.get(key) or analyse_file(path, model, "1")
        out[key] = calibrate(path, a, profile, top, 1, TOKENS, PROMPT, STEP_CONTEXT)
        print(f"calibration {key}: {out[key].as_dict()}", flush=True)
    return out


def servings_for(configs: list[Config], cache: Path, seconds: float) -> dict:
    """Each encoder model x recipe served through a one-worker mesh (planner/serving.py) at
    batch limits 2 and twice its configurations' largest: the planner then predicts every
    checked batch limit (1 and 8) and replica count from points it was not fitted at."""
    out = {}
    for key in dict.fromkeys(c.key for c in configs if not c.llm):
        model, recipe = key.split(" ")
        top = max(c.max_batch for c in configs if c.key == key)
        limits = (2, 2 * top)
        out[key] = calibrate_serving(artifact(model, recipe, cache), model, limits, TOKENS, seconds)
        print(f"serving {key}: {out[key].as_dict()}", flush=True)
    return out


def reanalyse(settings: ValidateSettings) -> dict:
    """Predictions again (same profile, calibrations and measurements) after the planner
    changed."""
    cache, path = settings.cache, settings.results / f"{NAME}.json"
    result = json.loads(path.read_text())
    by_label = {c.label: c for c in CONFIGS}
    configs = [by_label[r["config"]] for r in result["configurations"]]
    base = Profile(**result["profile"])
    analyses = {
        c.key: analyse_file(artifact(c.model, c.recipe, cache), c.model, "1") for c in configs
    }
    calibrations = {  # the stored timings, fitted again
        k: refit(Calibration.from_dict(v), analyses[k], base, TOKENS, STEP_CONTEXT)
        for k, v in result["calibrations"].items()
    }
    result["calibrations"] = {k: v.as_dict() for k, v in calibrations.items()}
    servings = {k: ServingCalibration.from_dict(v) for k, v in result["servings"].items()}
    for c, r in zip(configs, result["configurations"], strict=True):
        m, key = r["measured"], c.key
        profile = replace(base, background_cores=m["background_cores"])
        r.update(predictions(c, analyses[key], profile, m, calibrations[key], servings.get(key)))
    result["accuracy"] = summarize(result["configurations"])
    result["summary"] = summary_block(
        report.TITLE, report.rows(result), result["machine"], f"{report.COMMAND} --reanalyse"
    )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["reanalysed"] = (
        "predictions recomputed on these measurements and timings after the planner changed "
        f"(`python -m planner validate --reanalyse`, {when})"
    )
    plots(result["configurations"], analyses, base, settings.results)
    print(f"wrote {write_json(path, result)}")
    print(result["accuracy"])
    return result


def plots(
    rows: list[dict], analyses: dict[str, ModelAnalysis], local: Profile, folder: Path
) -> None:
    """planner_roofline.png (this machine, with the rows' measured points) and
    planner_roofline_h200.png (the same models on the H200 profile)."""
    for profile, name in (
        (local, "planner_roofline.png"),
        (profiles.load("H200"), "planner_roofline_h200.png"),
    ):
        points = [
            diagnose(a, profile, b, PROMPT, threads=1 if profile.kind == "cpu" else None)
            for a in analyses.values()
            for b in (1, 8, 64)
        ]
        measured = []
        if profile is local:
            for r in rows:
                closed = r["measured"]["closed"]
                rep = closed["reported"]
                a = analyses[r["config"].split(" x")[0]]
                b = max(1, round(closed["mean_batch"]))
                if rep.get("achieved_flops_per_s"):
                    measured.append(
                        (r["config"], a.intensity(b, PROMPT, TOKENS), rep["achieved_flops_per_s"])
                    )
        roofline_png(profile, points, folder / name, measured)
