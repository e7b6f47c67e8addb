"""Where each served model actually runs against its roof (issue 14, item 4).

From the model's statistics (worker/stats.py: the rows, tokens and cached tokens of its
runs, and their compute time) and its analysis (perfmodel/analysis.py: FLOPs and bytes per
run, from the ONNX graph), the achieved FLOP/s and bytes/s since start, and, with a
hardware profile, each as a fraction of the profile's roof. `Roofs.figures(model)` is what
a metrics endpoint calls; the servicer puts the same figures in ModelStatistics.

An encoder's items are counted at the analysis's 16 tokens (the TEXT padding unit): longer
requests are under-counted. A decode run's bytes include each row's cached tokens; a
prefill chunk's attention over tokens cached before it is left out. A TP shard group's
segments are not analysed (no figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from common import model_keys
from perfmodel import profiles
from perfmodel.profiles import Profile
from worker.stats import ModelStats, Work

if TYPE_CHECKING:
    from perfmodel.analysis import ModelAnalysis

log = structlog.get_logger()

PREFIX = model_keys.ROOFLINE


Cost = tuple[float, float]  # (FLOPs, bytes)


def _kind_cost(a: ModelAnalysis, kind: str, w: Work) -> Cost:
    """A run's cost is fixed + per row (+ per cached token in a decode, + per token^2 in a
    prompt): the analysis is linear in the sums kept, so three points of it give the terms."""
    if kind == "decode":
        c0, c1, c2 = a.decode_step(0, 0), a.decode_step(1, 0), a.decode_step(1, 1)
        terms = [(w.runs, c0), (w.rows, _minus(c1, c0)), (w.row_context, _minus(c2, c1))]
    elif kind == "prefill":
        p0, p1, p2 = a.prefill(0), a.prefill(1), a.prefill(2)
        square = ((p2[0] - 2 * p1[0] + p0[0]) / 2, (p2[1] - 2 * p1[1] + p0[1]) / 2)
        per_token = (p1[0] - p0[0] - square[0], p1[1] - p0[1] - square[1])
        terms = [(w.runs, p0), (w.tokens, per_token), (w.tokens_sq, square)]
    else:
        e0, e1 = a.encoder_call(0), a.encoder_call(1)
        terms = [(w.runs, e0), (w.rows, _minus(e1, e0))]
    return (
        sum(n * cost[0] for n, cost in terms),
        sum(n * cost[1] for n, cost in terms),
    )


def _minus(x: Cost, y: Cost) -> Cost:
    return x[0] - y[0], x[1] - y[1]


def totals(a: ModelAnalysis, work: dict[str, Work]) -> tuple[float, float, float]:
    """(FLOPs, bytes, seconds) of every run recorded."""
    costs = [_kind_cost(a, kind, w) for kind, w in work.items()]
    seconds = sum(w.ns for w in work.values()) / 1e9
    return sum(c[0] for c in costs), sum(c[1] for c in costs), seconds


@dataclass
class Roofs:
    """The profile the worker measures itself against, and each model's analysis (read
    from its ONNX file once, on first use)."""

    profile: Profile | None = None
    threads: int | None = None  # onnxruntime intra-op threads (None: the whole device)
    _analyses: dict[Path, ModelAnalysis | None] = field(default_factory=dict)

    @classmethod
    def from_setting(cls, name: str | None, threads: int) -> Roofs:
        """`name`: a profile name or file (perfmodel/profiles.py); None: the probed profile
        at build/planner/profile.json when there is one, else none (achieved figures only)."""
        if name is not None:
            return cls(profiles.load(name), threads or None)  # a bad name stops the worker
        try:
            probed = profiles.load("local") if profiles.default_probed().exists() else None
        except profiles.ProfileError as e:
            log.warning("roofline_profile_unreadable", error=str(e))
            probed = None
        return cls(probed, threads or None)

    def analysis(self, path: Path, name: str, version: str) -> ModelAnalysis | None:
        if path not in self._analyses:
            # the version folder's model.onnx, or a variant's in a folder of its own there
            # (worker/config.model_filename); a TP shard segment is not the whole model
            folder = next((p for p in path.parents[:2] if p.name == version), None)
            if path.name != "model.onnx" or folder is None:
                self._analyses[path] = None
                return None
            # here, not at the top: the analysis (and onnx, 17 MB resident) is loaded when a
            # model's roofline is first asked for, not by every worker at start
            from perfmodel.analysis import AnalysisError, analyse_file, read_config

            try:
                config = read_config(folder.parent)
                self._analyses[path] = analyse_file(path, name, version, config)
            except AnalysisError as e:
                log.warning("roofline_analysis_failed", model=name, version=version, error=str(e))
                self._analyses[path] = None
        return self._analyses[path]

    def figures(self, path: Path, name: str, version: str, stats: ModelStats) -> dict[str, float]:
        """Achieved FLOP/s and bytes/s over the model's compute time so far, and their
        fractions of the profile's roofs; {} before the first run or without an analysis."""
        a = self.analysis(path, name, version)
        if a is None:
            return {}
        flops, moved, seconds = totals(a, stats.work)
        out: dict[str, float] = {"weight_bytes": float(a.weight_bytes)}
        if seconds <= 0:
            return out
        out["achieved_flops_per_s"] = flops / seconds
        out["achieved_bytes_per_s"] = moved / seconds
        if self.profile is not None:
            peak = self.profile.peak(a.compute_dtype(self.profile.kind), self.threads)
            out["compute_roof_fraction"] = out["achieved_flops_per_s"] / peak
            bandwidth = self.profile.bandwidth(a.streamed_bytes)
            out["bandwidth_roof_fraction"] = out["achieved_bytes_per_s"] / bandwidth
        return out
