"""A calibration run, apart from the mesh: a model's own onnxruntime session on this machine,
timed alone (CPU seconds of one thread, as a worker runs it) at the smallest and the largest
batch.

The Roofline says what the probed roof allows. onnxruntime on a CPU reaches only a fraction
of the probe's 1024^3 GEMM on a model's small GEMMs, and pays a fixed cost per run for the
graph's hundreds of nodes whatever the batch (MiniLM int8 at batch 1 took 2x its Roofline
time, at batch 3 1.4x). Two timed points fix both, as the profile's own fields:

    S(b) = call_overhead_s + Roofline(b) / efficiency

(`efficiency` scales the profile's `achievable` compute and bandwidth alike). The fit is per
model x recipe x threads and comes only from these standalone runs: nothing here sees the
mesh, its load or the figures a benchmark compares against.

A decoder is timed as the engine runs it (worker/llm): one prefill chunk of the prompt, and
decode steps over `batch` cache rows at the given context. Its fit uses the decode steps,
which dominate a generation; the prefill is timed too and used as measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from perfmodel.analysis import DECODER, ModelAnalysis
from perfmodel.profiles import Profile
from perfmodel.roofline import run_seconds


@dataclass(frozen=True)
class Calibration:
    """What one model x recipe took alone: seconds per run by batch (a decoder's decode
    step), a decoder's prefill of `prompt` tokens, and the fit to the Roofline."""

    runs_s: dict[int, float]
    prefill_s: float
    call_overhead_s: float
    efficiency: float
    threads: int

    def profile(self, base: Profile) -> Profile:
        """`base` with this model's fixed cost per run and achievable fraction of the roof."""
        achievable = {k: v * self.efficiency for k, v in base.achievable.items()}
        return replace(base, call_overhead_s=self.call_overhead_s, achievable=achievable)

    def as_dict(self) -> dict:
        return {
            "runs_ms": {str(b): round(s * 1e3, 3) for b, s in self.runs_s.items()},
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "call_overhead_ms": round(self.call_overhead_s * 1e3, 3),
            "efficiency": float(f"{self.efficiency:.4g}"),
            "threads": self.threads,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(
            {int(b): ms / 1e3 for b, ms in d["runs_ms"].items()},
            d["prefill_ms"] / 1e3,
            d["call_overhead_ms"] / 1e3,
            d["efficiency"],
            d["threads"],
        )


def fit(
    roofline_s: dict[int, float], measured_s: dict[int, float], negative_overhead: bool = True
) -> tuple[float, float]:
    """(overhead, efficiency) with measured = overhead + roofline / efficiency through the
    smallest and the largest batch: the line through both timed points. The overhead comes
    out negative where the runs grow faster with the batch than the Roofline's bytes and
    FLOPs do (per-row work the graph analysis does not count, e.g. MatMulNBits dequantizing
    for each row of a memory-bound decode step); the line still passes through both points,
    and the planner uses it between them. One point, a slope the noise made negative, or
    without `negative_overhead` a negative overhead: no overhead, the ratio at the largest
    batch."""
    lo, hi = min(measured_s), max(measured_s)
    rise = measured_s[hi] - measured_s[lo]
    if hi > lo and rise > 0 and roofline_s[hi] > roofline_s[lo]:
        per_roof = rise / (roofline_s[hi] - roofline_s[lo])
        overhead = measured_s[lo] - roofline_s[lo] * per_roof
        if overhead >= 0 or negative_overhead:
            return overhead, 1 / per_roof
    return 0.0, roofline_s[hi] / measured_s[hi]


def _timed(fn: Callable[[], object], budget_s: float, repeats: int = 200) -> float:
    """Median CPU seconds of `fn` on this thread (onnxruntime with one intra-op thread runs
    on the caller's), after two warm-up calls, within a bounded count and time. CPU time, not
    wall time: what a run costs a core, whatever other jobs on a shared host take meanwhile
    (the queueing model adds that contention itself, from the probed background)."""
    fn()
    fn()
    times: list[float] = []
    stop = time.monotonic() + budget_s
    while len(times) < repeats and (len(times) < 5 or time.monotonic() < stop):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _session(path: Path, threads: int):  # type: ignore[no-untyped-def]
    from worker.runtime import CPU, OnnxSession, RuntimeOptions

    return OnnxSession(path, RuntimeOptions(providers="cpu", intra_op_threads=threads), [CPU])


def encoder_feeds(path: Path, batch: int, tokens: int) -> dict[str, np.ndarray]:
    """Inputs of `batch` items: `tokens` for every dimension the graph leaves open past the
    batch, token ids (a mask of ones, token types of zeros) for integer inputs, random
    values for float ones."""
    rng = np.random.default_rng(0)
    feeds = {}
    for graph_input in onnx.load(str(path), load_external_data=False).graph.input:
        t = graph_input.type.tensor_type
        shape = [batch] + [d.dim_value or tokens for d in t.shape.dim[1:]]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        name = graph_input.name
        if np.issubdtype(dtype, np.floating):
            value = rng.standard_normal(shape)
        elif "mask" in name:
            value = np.ones(shape)
        elif "type" in name:
            value = np.zeros(shape)
        else:
            value = rng.integers(1000, 2000, shape).astype(np.float64)
        feeds[name] = value.astype(dtype)
    return feeds


def encoder_runs(
    path: Path, batches: list[int], tokens: int, threads: int, budget_s: float
) -> dict[int, float]:
    """Seconds per run of the model at each batch (inputs: encoder_feeds)."""
    session = _session(path, threads).session
    out = {}
    for b in batches:
        feeds = encoder_feeds(path, b, tokens)
        out[b] = _timed(lambda f=feeds: session.run(None, f), budget_s)  # type: ignore[misc]
    return out


def decoder_runs(
    path: Path, batches: list[int], prompt: int, context: int, threads: int, budget_s: float
) -> tuple[dict[int, float], float]:
    """(decode step seconds by batch at `context` tokens, prefill seconds of `prompt`)."""
    from worker.llm.cache import KVCache, page_aligned
    from worker.llm.model import StepModel

    model = StepModel(_session(path, threads))
    f = model.facts
    slots, max_len = max(batches), max(prompt, context) + 1
    itemsize = f.cache_shape(1, 1).itemsize
    cache = KVCache(
        f.cache_shape(slots, page_aligned(max_len, f.kv_heads * f.head_dim, itemsize=itemsize))
    )
    try:
        ids = np.ones((1, prompt), np.int64)
        prefill = _timed(lambda: model.run(cache, ids, np.array([prompt]), 0, 1), budget_s)
        steps = {}
        for b in batches:
            one, lengths = np.ones((b, 1), np.int64), np.full(b, context, np.int64)
            steps[b] = _timed(
                lambda o=one, n=lengths, r=b: model.run(cache, o, n, 0, r),  # type: ignore[misc]
                budget_s,
            )
        return steps, prefill
    finally:
        cache.close()


def calibrate(
    path: Path,
    m: ModelAnalysis,
    profile: Profile,
    max_batch: int,
    threads: int = 1,
    tokens: int = 16,
    prompt: int = 64,
    context: int = 80,
    budget_s: float = 2.0,
) -> Calibration:
    """Time the model alone at batch 1 and `max_batch` and fit the Roofline to it."""
    batches = sorted({1, max_batch})
    if m.kind == DECODER:
        runs, prefill = decoder_runs(path, batches, prompt, context, threads, budget_s)
    else:
        runs, prefill = encoder_runs(path, batches, tokens, threads, budget_s), 0.0
    return refit(Calibration(runs, prefill, 0.0, 1.0, threads), m, profile, tokens, context)


def refit(
    cal: Calibration,
    m: ModelAnalysis,
    profile: Profile,
    tokens: int = 16,
    context: int = 80,
    negative_overhead: bool = True,
) -> Calibration:
    """`cal`'s timed runs fitted to the Roofline on `profile` (no fixed cost, the full
    roof): also how stored timings are fitted again after the fit changed. See `fit` for
    `negative_overhead`."""
    bare = replace(profile, call_overhead_s=0.0)
    roof = {
        b: run_seconds(m, bare, b, context, 1, cal.threads, None if m.kind == DECODER else tokens)
        for b in cal.runs_s
    }
    overhead, efficiency = fit(roof, cal.runs_s, negative_overhead)
    return replace(cal, call_overhead_s=overhead, efficiency=efficiency)
