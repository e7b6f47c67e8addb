"""`python -m planner probe`: measure this machine's roof into a profile file.

- Memory bandwidth: a STREAM-like copy (a -> b: 16 bytes moved per 8-byte element... read
  one array and write another) and triad (a = b + s*c) over arrays far larger than the
  last-level cache, split across one thread per core (numpy releases the GIL in its loops);
  the best of a few bounded repetitions, as STREAM reports. The same with a working set that
  fits the last-level cache gives the cache's bandwidth.
- GEMM FLOP/s through onnxruntime: fp32 MatMul and int8 MatMulInteger (u8 x s8 -> s32) at
  1024^3, with intra-op threads = cores.
- Capacity: MemTotal from /proc/meminfo.
- With `--mesh`: the serving stack's own cost per call on this machine, measured on a real
  mesh (private Redis, one worker, the router) serving a tiny MLP whose arithmetic is
  negligible: latency at one caller (mesh_latency_s), its 99th percentile under a Poisson
  stream at a quarter of the mesh's top rate (mesh_latency_p99_s: the tail a call's trip
  through client, router and worker adds), host CPU seconds per call at saturation
  (mesh_cpu_s; the router's and Redis' part of it: mesh_router_cpu_s, what a hop through
  the router adds to a call served by a worker alone), and in an open loop at an eighth and
  a quarter of that rate: a fixed part (mesh_open_cores) and a part per call
  (mesh_open_cpu_s); and the trip's p99 at an eighth, a quarter and half of it, with the
  host cores the mesh kept busy meanwhile (mesh_tail: waiting for a core makes the tail).
- Other jobs on a shared host: their mean CPU demand, from /proc/stat over a window in which
  the probe itself sleeps (background_cores). What the mesh can use is the rest.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from common import cpu
from perfmodel.profiles import Profile

GEMM_N = 1024


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _best_seconds(fn, repeats: int, budget_s: float) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    stop = time.monotonic() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.monotonic() > stop:
            break
    return best


def stream_bandwidth(elements: int, threads: int, budget_s: float = 3.0) -> dict[str, float]:
    """Best copy and triad bytes/s (float64, bytes counted as STREAM does)."""
    a = np.ones(elements)
    b = np.full(elements, 2.0)
    c = np.full(elements, 0.5)  # touched: no first-write page faults in the timing
    chunks = np.array_split(np.arange(elements), threads)
    bounds = [(int(ch[0]), int(ch[-1]) + 1) for ch in chunks if len(ch)]
    pool = ThreadPoolExecutor(threads)

    def copy() -> None:
        list(pool.map(lambda r: np.copyto(c[r[0] : r[1]], a[r[0] : r[1]]), bounds))

    def triad() -> None:
        def part(r: tuple[int, int]) -> None:
            lo, hi = r
            np.multiply(c[lo:hi], 3.0, out=a[lo:hi])
            np.add(a[lo:hi], b[lo:hi], out=a[lo:hi])

        list(pool.map(part, bounds))

    try:
        copy_s = _best_seconds(copy, 20, budget_s / 2)
        triad_s = _best_seconds(triad, 20, budget_s / 2)
    finally:
        pool.shutdown()
    # STREAM's accounting: copy moves 2 arrays, triad 3 (our triad's in-place pass re-reads
    # a, so its figure is a lower bound on the hardware's triad).
    return {"copy": 16 * elements / copy_s, "triad": 24 * elements / triad_s}


def _gemm_model(dtype: str) -> bytes:
    rng = np.random.default_rng(0)
    n = GEMM_N
    if dtype == "int8":
        w = rng.integers(-127, 127, (n, n), dtype=np.int8)
        node = helper.make_node("MatMulInteger", ["A", "W"], ["Y"])
        a_type, y_type = TensorProto.UINT8, TensorProto.INT32
    else:
        w = rng.standard_normal((n, n)).astype(np.float32)
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
        a_type, y_type = TensorProto.FLOAT, TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("A", a_type, [n, n])],
        [helper.make_tensor_value_info("Y", y_type, [n, n])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return model.SerializeToString()


def gemm_flops(dtype: str, threads: int, budget_s: float = 3.0) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    session = ort.InferenceSession(
        _gemm_model(dtype), sess_options=so, providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(1)
    if dtype == "int8":
        a = rng.integers(0, 255, (GEMM_N, GEMM_N), dtype=np.uint8)
    else:
        a = rng.standard_normal((GEMM_N, GEMM_N)).astype(np.float32)
    session.run(None, {"A": a})  # warm-up
    seconds = _best_seconds(lambda: session.run(None, {"A": a}), 50, budget_s)
    return 2 * GEMM_N**3 / seconds


def memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def llc_bytes() -> int:
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024**2}.get(size[-1], 1)
        best = max(best, int(size.rstrip("KM")) * unit)
    return best


def probe(budget_s: float = 3.0) -> Profile:
    background = background_cores(min(budget_s, 1.0))
    cores = _cores()
    llc = llc_bytes()
    dram = stream_bandwidth(16 * 1024**2, cores, budget_s)  # 3 x 128 MiB arrays
    cache = stream_bandwidth(max(llc // 8 // 4, 1024), cores, budget_s)  # 3 arrays in 3/4 LLC
    fp32 = gemm_flops("fp32", cores, budget_s)
    int8 = gemm_flops("int8", cores, budget_s)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return Profile(
        name=f"local ({cpu.name()}, {cores} cores)",
        kind="cpu",
        cores=cores,
        memory_bandwidth=dram["copy"],
        cache_bytes=llc,
        cache_bandwidth=cache["copy"],
        flops={"fp32": fp32, "fp16": fp32, "bf16": fp32, "int8": int8, "int4": int8},
        memory_bytes=memory_total(),
        background_cores=background,
        source=(
            f"measured by `python -m planner probe` on {when}: "
            f"STREAM-like copy {dram['copy'] / 1e9:.1f} GB/s, triad {dram['triad'] / 1e9:.1f} GB/s "
            f"(LLC {llc >> 20} MiB: copy {cache['copy'] / 1e9:.1f} GB/s); onnxruntime {GEMM_N}^3 "
            f"GEMM fp32 {fp32 / 1e9:.1f} GFLOP/s, int8 {int8 / 1e9:.1f} GOP/s, {cores} threads; "
            "fp16/bf16 run as fp32 and int4 weights as int8 on a CPU"
        ),
    )


def mesh_overhead(log_dir: Path, seconds: float = 4.0) -> dict[str, float]:
    """The serving stack's cost per call: a real mesh (private Redis, one worker, the router)
    serving the toy MLP (16 -> 64 -> 4: ~2 kFLOP, nothing to compute). Returns the median
    latency at one caller (mesh_latency_s) and the host CPU seconds per call at saturation
    (cores / throughput at 16 callers: client, router and worker all on this host)."""
    import asyncio

    from devmesh import toy_models
    from devmesh.processes import LocalMesh
    from loadtest.runner import Load, closed_loop, open_loop
    from protos import grpc_service_pb2 as pb

    repo = log_dir / "repo"
    toy_models.write(repo / "mlp", toy_models.mlp(), "max_batch_size: 1\ndynamic_batching { }\n")
    request = pb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    body = request.SerializeToString()
    mesh = LocalMesh(log_dir, worker_args=("--providers", "cpu", "--intra-op-threads", "1"))
    mesh.start_redis()
    try:
        mesh.add_worker(repo)
        mesh.wait_registered(1)
        router = mesh.start_router()
        pids = [p.popen.pid for p in [*mesh.workers.values(), mesh.router] if p and p.popen]
        hop = [p.popen.pid for p in (mesh.router, mesh.redis_server) if p and p.popen]
        one = asyncio.run(closed_loop(Load(router, [body], seconds, 1.0, 10.0), 1))
        before, hop_before = cpu_seconds(pids), cpu_seconds(hop, client=False)
        many = asyncio.run(closed_loop(Load(router, [body], seconds, 0.0, 10.0), 16))
        cpu, hop_cpu = cpu_seconds(pids) - before, cpu_seconds(hop, client=False) - hop_before
        # The open loop (Poisson arrivals: what a p99 is measured under) at two rates: its
        # CPU is a fixed part (the client's schedule, every process woken per call rather
        # than per burst) plus a part per call; the faster run's p99 is the trip's tail.
        opened = []
        for share in (8, 4, 2):
            rate = many["throughput_rps"] / share
            before = cpu_seconds(pids)
            result = asyncio.run(open_loop(Load(router, [body], seconds, 0.0, 10.0), rate))
            opened.append((rate, (cpu_seconds(pids) - before) / seconds, result))
    finally:
        mesh.stop()
    (slow, slow_cores, _), (fast, fast_cores, tail), _ = opened
    per_call = max(0.0, (fast_cores - slow_cores) / (fast - slow))
    return {
        "mesh_latency_s": one["p50_ms"] / 1e3,
        "mesh_latency_p99_s": tail["p99_ms"] / 1e3,
        "mesh_tail": [[round(cores, 3), r["p99_ms"] / 1e3] for _, cores, r in opened],
        "mesh_cpu_s": cpu / max(many["requests"], 1.0),
        "mesh_router_cpu_s": hop_cpu / max(many["requests"], 1.0),
        "mesh_max_rps": many["throughput_rps"],
        "mesh_open_cpu_s": per_call,
        "mesh_open_cores": max(0.0, fast_cores - per_call * fast),
    }


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host so far, from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is inside user already


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The host's mean busy cores (every process's) between two host_cpu() samples."""
    cores = os.cpu_count() or 1
    return cores * (after[0] - before[0]) / max(after[1] - before[1], 1)


def background_cores(seconds: float = 1.0) -> float:
    """Other jobs' mean CPU demand, in cores: the host's busy time in /proc/stat over
    `seconds` during which this process only sleeps (and the mesh is stopped)."""
    before = host_cpu()
    time.sleep(seconds)
    return busy_cores(before, host_cpu())


def cpu_seconds(pids: list[int], client: bool = True) -> float:
    """CPU seconds (user + system) used so far by `pids` and, with `client`, by this process
    (the load tool's client runs in it)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2]) if client else 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total
