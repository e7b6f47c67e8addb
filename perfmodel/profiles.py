"""Hardware profiles: the roof a model runs under.

A profile is the few numbers the Roofline model needs: memory bandwidth (bytes/s), peak
FLOP/s by data type, memory capacity, and what a call costs besides its arithmetic (launch
and framework overhead). Named profiles for common accelerators come from the vendors'
datasheets (dense figures: the datasheets print tensor-core numbers "with sparsity", twice
the dense rate; we halve them); `python -m planner probe` measures this machine into a JSON
file, and any JSON file of the same shape is a profile too (`--profile path/to/file.json`).

`achievable` scales the datasheet roof to what real kernels reach: the issue's H200
reference measurements (bf16 matmul 770 TFLOP/s of 989 dense = 0.78; device copy 4.24 TB/s
of 4.8 = 0.88), assumed the same for the other NVIDIA parts. A probed profile is already
what this machine achieves, so its factors are 1, until planner/calibrate.py fits them (and
the fixed cost per run) to one model's standalone runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import paths

TERA = 1e12
GIGA = 1e9
DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")


class ProfileError(ValueError):
    """An unknown profile name or a profile file that does not parse; says what is known."""


@dataclass(frozen=True)
class Profile:
    name: str
    memory_bandwidth: float  # bytes/s from device memory (DRAM / HBM)
    flops: dict[str, float]  # peak FLOP/s (int: OP/s) by compute dtype, the whole device
    memory_bytes: int  # capacity for weights + KV cache + activations
    source: str  # where the numbers come from
    kind: str = "gpu"  # "gpu" or "cpu"
    cores: int = 1  # CPU cores; a CPU worker with t threads gets t / cores of `flops`
    # A last-level cache the weights may fit in (CPU): its bandwidth applies when they do.
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0
    interconnect_bandwidth: float = 0.0  # bytes/s between devices, for TP all-reduces
    call_overhead_s: float = 0.0  # fixed time per model run (launch / framework)
    mesh_latency_s: float = 0.0  # client -> router -> worker -> back, beside the run
    mesh_latency_p99_s: float = 0.0  # that trip's 99th percentile under load (0: not probed)
    mesh_cpu_s: float = 0.0  # host CPU seconds per call for gRPC, codec, router, client
    mesh_router_cpu_s: float = 0.0  # the router's and Redis' part of mesh_cpu_s
    mesh_max_rps: float = 0.0  # the most tiny calls/s the mesh answers (0: not measured)
    # Under Poisson arrivals (an open loop), the mesh and its client's CPU: a fixed part
    # plus a part per call (0, 0: not probed; mesh_cpu_s then serves for both).
    mesh_open_cores: float = 0.0
    mesh_open_cpu_s: float = 0.0
    background_cores: float = 0.0  # other jobs' mean CPU demand on a shared host (probed)
    # The mesh trip's p99 under Poisson arrivals by the host cores busy: [[cores, p99_s]...]
    mesh_tail: list[list[float]] = field(default_factory=list)
    achievable: dict[str, float] = field(default_factory=lambda: {"compute": 1.0, "bandwidth": 1.0})

    def peak(self, dtype: str, threads: int | None = None) -> float:
        """Achievable FLOP/s for `dtype` (falls back to fp32), for `threads` CPU threads."""
        flops = self.flops.get(dtype) or self.flops["fp32"]
        share = (
            1.0 if self.kind != "cpu" or threads is None else min(threads, self.cores) / self.cores
        )
        return flops * share * self.achievable.get("compute", 1.0)

    def bandwidth(self, resident_bytes: float = float("inf")) -> float:
        """Achievable bytes/s for a working set of `resident_bytes`: the cache's when it fits."""
        scale = self.achievable.get("bandwidth", 1.0)  # a calibration applies to both
        if self.cache_bytes and resident_bytes <= self.cache_bytes and self.cache_bandwidth:
            return self.cache_bandwidth * scale
        return self.memory_bandwidth * scale

    def open_cpu(self) -> tuple[float, float] | None:
        """(fixed cores, CPU seconds per call) of the mesh under Poisson arrivals, if probed."""
        if self.mesh_open_cores or self.mesh_open_cpu_s:
            return self.mesh_open_cores, self.mesh_open_cpu_s
        return None

    def trip_p99(self, busy_cores: float) -> float:
        """The mesh trip's 99th percentile while `busy_cores` of the host's cores are busy
        (ours and other jobs'): through the probed points made non-decreasing (adjacent
        points that fall are pooled to their mean: one noisy window must not make a busier
        host faster), linear in 1 / (cores - busy) between them, as a wait for one of n
        servers grows (M/M/n); flat below the least busy point, the last two points' line
        beyond the busiest; unbounded once the cores are full. Without probed points,
        mesh_latency_p99_s."""
        points = sorted((c, p) for c, p in self.mesh_tail if c < self.cores)
        if not points:
            return self.mesh_latency_p99_s or self.mesh_latency_s
        if busy_cores >= self.cores:
            return math.inf
        x = [1 / (self.cores - c) for c, _ in points]
        y = _non_decreasing([p for _, p in points])
        if busy_cores <= points[0][0] or len(points) == 1:
            return y[0]
        at = 1 / (self.cores - busy_cores)
        i = next((k for k in range(1, len(x)) if at <= x[k]), len(x) - 1)
        if x[i] <= x[i - 1]:
            return y[i]
        return max(0.0, y[i - 1] + (y[i] - y[i - 1]) * (at - x[i - 1]) / (x[i] - x[i - 1]))

    def ridge(self, dtype: str = "fp32") -> float:
        """FLOP per byte where the roof turns from bandwidth-bound to compute-bound."""
        return self.peak(dtype) / self.bandwidth()

    def as_dict(self) -> dict:
        return asdict(self)


_NVIDIA_ACHIEVABLE = {"compute": 0.78, "bandwidth": 0.88}
# A GPU call's fixed cost: MiniLM at batch 1 on the H200 ran 430 items/s (2.3 ms) where its
# FLOPs and bytes take microseconds, so it is launch/framework-bound (the figure;
# assumed for every GPU profile). A decode step in a CUDA graph pays far less of it.
_GPU_CALL_OVERHEAD_S = 2.3e-3

# H200 and H100 (SXM) share the Hopper tensor cores: the same dense peaks by dtype.
_HOPPER_FLOPS = {
    "fp32": 67 * TERA,
    "fp16": 989.5 * TERA,
    "bf16": 989.5 * TERA,
    "int8": 1979 * TERA,
    "int4": 1979 * TERA,
}

NAMED: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "H200",
            memory_bandwidth=4.8 * TERA,
            flops=_HOPPER_FLOPS,
            memory_bytes=141 * 10**9,
            interconnect_bandwidth=900 * GIGA,
            call_overhead_s=_GPU_CALL_OVERHEAD_S,
            achievable=_NVIDIA_ACHIEVABLE,
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, FP32 67 "
                "TFLOPS, BF16/FP16 1,979 and INT8 3,958 TFLOPS/TOPS with sparsity (halved "
                "here: dense), NVLink 900 GB/s; int4 runs on the int8 path"
            ),
        ),
        Profile(
            "H100",
            memory_bandwidth=3.35 * TERA,
            flops=_HOPPER_FLOPS,
            memory_bytes=80 * 10**9,
            interconnect_bandwidth=900 * GIGA,
            call_overhead_s=_GPU_CALL_OVERHEAD_S,
            achievable=_NVIDIA_ACHIEVABLE,
            source=(
                "NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3, 3.35 TB/s, FP32 67 "
                "TFLOPS, BF16/FP16 1,979 and INT8 3,958 with sparsity (halved: dense), "
                "NVLink 900 GB/s"
            ),
        ),
        Profile(
            "A100",
            memory_bandwidth=2.039 * TERA,
            flops={
                "fp32": 19.5 * TERA,
                "fp16": 312 * TERA,
                "bf16": 312 * TERA,
                "int8": 624 * TERA,
                "int4": 1248 * TERA,
            },
            memory_bytes=80 * 10**9,
            interconnect_bandwidth=600 * GIGA,
            call_overhead_s=_GPU_CALL_OVERHEAD_S,
            achievable=_NVIDIA_ACHIEVABLE,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): HBM2e 2,039 GB/s, FP32 "
                "19.5 TFLOPS, BF16/FP16 312, INT8 624, INT4 1,248 dense, NVLink 600 GB/s"
            ),
        ),
        Profile(
            "L4",
            memory_bandwidth=300 * GIGA,
            flops={
                "fp32": 30.3 * TERA,
                "fp16": 121 * TERA,
                "bf16": 121 * TERA,
                "int8": 242.5 * TERA,
                "int4": 242.5 * TERA,
            },
            memory_bytes=24 * 10**9,
            interconnect_bandwidth=64 * GIGA,
            call_overhead_s=_GPU_CALL_OVERHEAD_S,
            achievable=_NVIDIA_ACHIEVABLE,
            source=(
                "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, FP32 30.3 "
                "TFLOPS, BF16/FP16 242 and INT8 485 with sparsity (halved: dense), PCIe "
                "Gen4 x16 64 GB/s (no NVLink)"
            ),
        ),
    )
}


def default_probed() -> Path:
    """Where `python -m planner probe` writes this machine's profile by default."""
    return paths.build("planner", "profile.json")


def save(profile: Profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.as_dict(), indent=2) + "\n")
    return path


def load(name_or_path: str) -> Profile:
    """A named profile (H200, H100, A100, L4; case-insensitive), `local` (the probed one at
    build/planner/profile.json), or a JSON file written by `planner probe` or by hand."""
    by_upper = {k.upper(): v for k, v in NAMED.items()}
    if name_or_path.upper() in by_upper:
        return by_upper[name_or_path.upper()]
    path = default_probed() if name_or_path == "local" else Path(name_or_path)
    if not path.is_file():
        hint = "run `python -m planner probe` first" if name_or_path == "local" else ""
        raise ProfileError(
            f"unknown profile {name_or_path!r}: expected one of {sorted(NAMED)}, 'local', "
            f"or a profile JSON file {hint}".rstrip()
        )
    try:
        body = json.loads(path.read_text())
        return Profile(**body)
    except (ValueError, TypeError) as e:
        raise ProfileError(
            f"{path}: not a profile ({e}); expected the fields of perfmodel.profiles.Profile: "
            "name, memory_bandwidth, flops {dtype: FLOP/s}, memory_bytes, source, ..."
        ) from e


def _non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]
