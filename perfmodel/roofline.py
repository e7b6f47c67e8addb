"""Diagnosis: which resource is the limit for one model x recipe x profile x batch.

The predicted time of one run is the Roofline's: max(FLOPs / peak FLOP/s, bytes / bandwidth),
plus the profile's fixed cost per run (launch, framework). With tensor parallelism over N
devices each holds and reads 1/N of the projection weights and does 1/N of the FLOPs, and
every layer adds two all-reduces of the activations (ring: 2 (N-1)/N x size / link
bandwidth, plus a fixed latency each).

The verdict, in the article's terms:
- capacity-bound: weights + KV for the target concurrency and context do not fit the
  device's memory: nothing runs until bytes shrink (quantize) or spread (TP);
- bandwidth-bound: moving the bytes takes longer than the arithmetic (intensity below the
  profile's ridge point): batching raises intensity, quantization cuts bytes;
- compute-bound: the arithmetic takes longer: int8 compute, TP or more devices; batching
  no longer helps;
- overhead-bound: the fixed cost per run exceeds both (launch-bound): batch to amortise it.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmodel.analysis import DECODER, ModelAnalysis
from perfmodel.profiles import Profile

ALLREDUCE_LATENCY_S = {"gpu": 10e-6, "cpu": 100e-6}
ACTIVATION_HEADROOM = 1.10  # activations and the runtime's arena beside weights + KV

TECHNIQUES = {
    "capacity": (
        "quantize: fewer bytes per weight, so it fits (helps capacity and bandwidth); "
        "TP: splits the weights and KV across devices (helps capacity and latency, costs "
        "two all-reduces per layer); fewer concurrent sequences or a shorter context "
        "shrink the KV cache"
    ),
    "bandwidth": (
        "batch: more rows per weight read raises arithmetic intensity{batch_hint}; quantize: "
        "fewer bytes to move (helps bandwidth and capacity); TP: each device reads 1/N of "
        "the bytes (latency); replicas: more throughput, same per-call latency"
    ),
    "compute": (
        "int8 compute where the roof is higher{int8_hint}; TP: splits the FLOPs (latency, "
        "costs all-reduces); replicas: more throughput, same per-call latency; batching "
        "no longer helps (already past the ridge)"
    ),
    "overhead": (
        "batch: the fixed cost per run is paid once for the whole batch (launch-bound until "
        "batched); fewer, fused nodes or a CUDA graph cut it; replicas: more throughput"
    ),
}


@dataclass(frozen=True)
class Diagnosis:
    model: str
    recipe: str
    profile: str
    batch: int
    context: int
    tp: int
    flops: float
    bytes_moved: float
    intensity: float  # FLOP / byte
    ridge: float  # the profile's ridge point for this compute dtype
    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float
    time_s: float  # predicted time per run (step for a decoder, call for an encoder)
    resident_bytes: int  # per device: weights / TP + KV + headroom
    fits: bool
    bound: str  # capacity, bandwidth, compute, overhead
    help: str

    @property
    def attained_flops(self) -> float:
        return self.flops / self.time_s if self.time_s else 0.0

    def row(self) -> dict:
        return {
            "model": self.model,
            "recipe": self.recipe,
            "batch": self.batch,
            "tp": self.tp,
            "intensity": round(self.intensity, 2),
            "ridge": round(self.ridge, 1),
            "time_ms": round(self.time_s * 1e3, 3),
            "resident_MB": round(self.resident_bytes / 1e6, 1),
            "bound": self.bound,
        }


def resident_bytes(m: ModelAnalysis, tp: int, sequences: int, context: int) -> int:
    """Per device: the projection weights split over TP ranks, the rest replicated, the KV
    cache of `sequences` x `context` tokens split by KV heads, plus headroom."""
    weights = m.weight_bytes - m.projection_bytes + m.projection_bytes / tp
    kv = m.kv_bytes(sequences, context) / tp
    return int((weights + kv) * ACTIVATION_HEADROOM)


def run_time(
    m: ModelAnalysis,
    profile: Profile,
    batch: int,
    context: int = 0,
    tp: int = 1,
    threads: int | None = None,
    tokens: int | None = None,
) -> tuple[float, float, float, float]:
    """(compute_s, memory_s, allreduce_s, overhead_s) of one run."""
    flops, moved = m.run(batch, context, tokens)
    dtype = m.compute_dtype(profile.kind)
    compute_s = flops / tp / profile.peak(dtype, threads)
    weight_share = m.projection_bytes - m.projection_bytes / tp
    memory_s = (moved - weight_share) / profile.bandwidth(moved - weight_share)
    allreduce_s = 0.0
    if tp > 1:
        rows = batch * (1 if m.kind == DECODER else (tokens or m.default_tokens))
        size = rows * m.attention_width * 4
        per = 2 * (tp - 1) / tp * size / max(profile.interconnect_bandwidth, 1.0)
        allreduce_s = 2 * m.layers * (per + ALLREDUCE_LATENCY_S.get(profile.kind, 1e-4))
    return compute_s, memory_s, allreduce_s, profile.call_overhead_s


def run_seconds(
    m: ModelAnalysis,
    profile: Profile,
    batch: int,
    context: int = 0,
    tp: int = 1,
    threads: int | None = None,
    tokens: int | None = None,
) -> float:
    """The predicted time of one run: the Roofline's max(compute, memory) (the bytes stream
    while the arithmetic runs), then the all-reduces and the fixed cost per run, in series."""
    compute_s, memory_s, allreduce_s, overhead_s = run_time(
        m, profile, batch, context, tp, threads, tokens
    )
    return max(compute_s, memory_s) + allreduce_s + overhead_s


def _batch_to_ridge(m: ModelAnalysis, ridge: float, context: int) -> int | None:
    b = 1
    while b <= 4096:
        if m.intensity(b, context) >= ridge:
            return b
        b *= 2
    return None


def diagnose(
    m: ModelAnalysis,
    profile: Profile,
    batch: int,
    context: int = 0,
    tp: int = 1,
    concurrency: int | None = None,
    threads: int | None = None,
) -> Diagnosis:
    """One operating point. `concurrency` sequences of `context` tokens must fit beside the
    weights (a decoder's KV cache; default: the batch)."""
    compute_s, memory_s, allreduce_s, overhead_s = run_time(m, profile, batch, context, tp, threads)
    dtype = m.compute_dtype(profile.kind)
    flops, moved = m.run(batch, context)
    sequences = (concurrency or batch) if m.kind == DECODER else 0
    resident = resident_bytes(m, tp, sequences, context)
    fits = resident <= profile.memory_bytes
    ridge = profile.peak(dtype, threads) / profile.bandwidth(moved)
    if not fits:
        bound = "capacity"
    elif overhead_s > max(compute_s, memory_s):
        bound = "overhead"
    elif compute_s >= memory_s:
        bound = "compute"
    else:
        bound = "bandwidth"
    batch_hint = ""
    if bound == "bandwidth":
        to_ridge = _batch_to_ridge(m, ridge, context)
        batch_hint = (
            f" (the ridge, {ridge:.0f} FLOP/B, is reached at batch ~{to_ridge})"
            if to_ridge
            else f" (but no batch up to 4096 reaches the ridge, {ridge:.0f} FLOP/B: the KV "
            "cache's bytes grow with the batch too)"
        )
    int8_hint = ""
    if bound == "compute" and dtype != "int8":
        gain = profile.peak("int8", threads) / profile.peak(dtype, threads)
        int8_hint = f" (x{gain:.1f} here)"
    return Diagnosis(
        model=m.name,
        recipe=m.recipe,
        profile=profile.name,
        batch=batch,
        context=context,
        tp=tp,
        flops=flops,
        bytes_moved=moved,
        intensity=flops / moved if moved else 0.0,
        ridge=ridge,
        compute_s=compute_s,
        memory_s=memory_s,
        allreduce_s=allreduce_s,
        overhead_s=overhead_s,
        time_s=max(compute_s, memory_s) + allreduce_s + overhead_s,
        resident_bytes=resident,
        fits=fits,
        bound=bound,
        help=TECHNIQUES[bound].format(batch_hint=batch_hint, int8_hint=int8_hint),
    )
