"""The router's hot path, side by side in one run: a worker called directly, the router as
it was before (the tree at --baseline-ref, run from an export of it), and the router of this
tree in each of its accounting modes, all on one Redis and one worker serving `mlp` (the
MLP of `make run`).

    python -m benchmarks.router_hop [--seconds 4] [--rounds 3] [--baseline-ref REF]
        [--perf-analyzer PATH]

Per round, every path in turn (the order rotates from round to round):

- c=1: perf_analyzer (the C++ client, when one is found: --perf-analyzer, PATH, or
  build/genai-perf/bin) and the project's load tool (grpc.aio, closed loop): p50, req/s;
- c=32: the load tool, closed loop: req/s, p50;
- a stream, one request at a time: on one ModelStreamInfer, each request is written once
  the last one's response came back: p50 of that round trip (a response billed and gated
  as a streamed piece is);
- a stream, a burst: BURST requests written at once on one ModelStreamInfer, their
  responses coming back to back; per piece = the burst's wall time / BURST (each request
  of a stream costs the router a worker stream of its own: this is the cost per request
  on a stream, not per piece of one request);
- an LLM stream (SmolLM2, greedy, LLM_TOKENS tokens, built from the quantize cache; skipped
  with the reason when it cannot be built): time to first token and inter-token latency,
  (last piece - first piece) / (pieces - 1), median of LLM_CALLS requests. A piece of a
  generation is what the router bills and gates one by one.

Figures are medians over the rounds. Targets: c=1 p50 through the router <= direct + 1.0 ms;
per streamed piece <= direct + 0.3 ms (the LLM stream's inter-token latency, router minus
direct; without the LLM, the burst's time per piece);
c=32 throughput >= 1.1x the router before. The verdicts are computed from the numbers below;
client, router, Redis and worker share this machine's cores (and, on a shared machine,
whatever else runs: the run says which machine).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import ROOT, free_port, infer_request, machine, write_result
from benchmarks.idle import export
from common import llm_protocol as proto
from devmesh import toy_models
from devmesh.processes import LocalMesh, Process, router_process, wait_serving
from loadtest.calls import closed_loop
from protos import grpc_service_pb2 as pb
from quantize import llm as llm_model

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
BASELINE_REF = "757621b"  # main before the router's forward path was folded into one
BURST = 256
LLM_TOKENS = 48
LLM_CALLS = 3
STREAM_CALLS = 400
TARGET_C1_ADDED_MS = 1.0
TARGET_PIECE_ADDED_MS = 0.3
TARGET_C32_RATIO = 1.1

# label -> (from the baseline tree?, extra router flags)
ROUTERS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "before": (True, ()),
    "after": (False, ()),
    "after_reply_first": (False, ("--accounting-commit", "after-reply")),
    "after_no_accounting": (False, ("--no-accounting",)),
}


def request_bytes() -> bytes:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    return infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()


async def stream_one_at_a_time(address: str, raw: bytes, n: int) -> dict:
    """p50 of write -> response on one open ModelStreamInfer, n times (after 20 warm-up)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM)(timeout=60)
        times = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            await call.write(raw)
            response = await call.read()
            assert isinstance(response, bytes)
            if i >= 20:
                times.append(time.perf_counter() - t0)
        await call.done_writing()
        return {"p50_ms": round(statistics.median(times) * 1000, 3)}


async def stream_burst(address: str, raw: bytes, n: int) -> dict:
    """n requests written at once on one ModelStreamInfer; the wall time until the last
    response, per piece (a first burst warms the stream up, not measured)."""
    async with grpc.aio.insecure_channel(address) as channel:
        per_piece = []
        for _ in range(2):
            call = channel.stream_stream(STREAM)(timeout=60)
            t0 = time.perf_counter()
            for _ in range(n):
                await call.write(raw)
            await call.done_writing()
            got = 0
            while (response := await call.read()) is not grpc.aio.EOF:
                assert isinstance(response, bytes)
                error = pb.ModelStreamInferResponse.FromString(response).error_message
                assert not error, error
                got += 1
            assert got == n, got
            per_piece.append((time.perf_counter() - t0) / n)
        return {"per_piece_ms": round(per_piece[-1] * 1000, 4)}


def llm_request(max_tokens: int) -> bytes:
    r = pb.ModelInferRequest(model_name=llm_model.MODEL, id="r1")
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    for name, dtype, value in (
        (proto.TEXT_INPUT, "BYTES", b"Once upon a time"),
        (proto.STREAM, "BOOL", None),
        (proto.SAMPLING_PARAMETERS, "BYTES", sampling.encode()),
    ):
        r.inputs.add(name=name, datatype=dtype, shape=[1])
        raw = b"\x01" if value is None else len(value).to_bytes(4, "little") + value
        r.raw_input_contents.append(raw)
    return r.SerializeToString()


async def llm_stream(address: str, raw: bytes, calls: int) -> dict:
    """TTFT and inter-token latency of `calls` streamed generations, one after another
    (after one not measured), medians."""
    ttft, itl = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        for i in range(calls + 1):
            call = channel.stream_stream(STREAM)(timeout=120)
            t0 = time.perf_counter()
            await call.write(raw)
            await call.done_writing()
            arrivals = []
            while (response := await call.read()) is not grpc.aio.EOF:
                assert isinstance(response, bytes)
                r = pb.ModelStreamInferResponse.FromString(response)
                assert not r.error_message, r.error_message
                arrivals.append(time.perf_counter())
            if i and len(arrivals) > 2:
                ttft.append(arrivals[0] - t0)
                itl.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
    return {
        "ttft_ms": round(statistics.median(ttft) * 1000, 3),
        "itl_ms": round(statistics.median(itl) * 1000, 4),
        "pieces": LLM_TOKENS,
    }


def llm_repository(tmp: Path) -> tuple[Path | None, str]:
    """SmolLM2 built from the quantize cache (ROOT/build/quantize), or None and why not."""
    try:
        llm_model.build(tmp / "llm", llm_model.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    return tmp / "llm", ""


def find_perf_analyzer(given: str | None) -> Path | None:
    for candidate in (
        given,
        shutil.which("perf_analyzer"),
        ROOT / "build/genai-perf/bin/perf_analyzer",
    ):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def perf_analyzer(binary: Path, address: str, seconds: float, out: Path) -> dict:
    """perf_analyzer at concurrency 1, one measurement window of `seconds` (stability
    checks off: a shared machine never looks stable), its p50 and throughput."""
    venv = binary.parent.parent
    libs = ":".join(str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/*/lib"))
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    args = [str(binary), "-m", "mlp", "-u", address, "-i", "grpc", "--concurrency-range", "1"]
    args += ["--measurement-interval", str(int(seconds * 1000)), "-s", "1000", "-f", str(out)]
    try:
        subprocess.run(args, env=env, check=True, capture_output=True, timeout=seconds * 10 + 30)
        with out.open() as f:
            row = next(csv.DictReader(f))
    except (subprocess.SubprocessError, OSError, StopIteration) as e:
        return {"error": str(e)[:300]}
    return {
        "p50_ms": round(int(row["p50 latency"]) / 1000, 3),
        "throughput_rps": round(float(row["Inferences/Second"]), 1),
    }


def measure(
    address: str, raw: bytes, seconds: float, pa: Path | None, tmp: Path, llm: str | None
) -> dict:
    """Every figure of one path; `llm`: where its LLM streams go (None: no LLM)."""
    request = pb.ModelInferRequest.FromString(raw)
    out: dict = {}
    if llm:
        out["llm"] = asyncio.run(llm_stream(llm, llm_request(LLM_TOKENS), LLM_CALLS))
    if pa is not None:
        out["perf_analyzer_c1"] = perf_analyzer(pa, address, seconds, tmp / "pa.csv")
    for c in (1, 32):
        r = asyncio.run(closed_loop(address, request, c, seconds))
        out[f"c{c}"] = {k: r[k] for k in ("p50_ms", "p99_ms", "throughput_rps", "errors")}
    out["stream_one_at_a_time"] = asyncio.run(stream_one_at_a_time(address, raw, STREAM_CALLS))
    out["stream_burst"] = asyncio.run(stream_burst(address, raw, BURST))
    return out


def start_routers(mesh: LocalMesh, baseline: Path) -> dict[str, tuple[str, Process]]:
    routers = {}
    for label, (old, flags) in ROUTERS.items():
        port = free_port()
        process = router_process(
            port, mesh.redis_url, mesh.log_dir, "--no-auth", "--router-id", label, *flags
        )
        if old:
            process.cwd = baseline
        process.start()
        wait_serving(f"127.0.0.1:{port}", process)
        routers[label] = (f"127.0.0.1:{port}", process)
    return routers


FIGURES = (
    ("perf_analyzer_c1", "p50_ms"),
    ("perf_analyzer_c1", "throughput_rps"),
    ("c1", "p50_ms"),
    ("c1", "throughput_rps"),
    ("c32", "throughput_rps"),
    ("c32", "p50_ms"),
    ("stream_one_at_a_time", "p50_ms"),
    ("stream_burst", "per_piece_ms"),
    ("llm", "ttft_ms"),
    ("llm", "itl_ms"),
)


def medians(rounds: list[dict], paths: list[str]) -> dict:
    out: dict = {}
    for path in paths:
        out[path] = {}
        for what, figure in FIGURES:
            values = [r[path][what][figure] for r in rounds if figure in r[path].get(what, {})]
            if values:
                out[path][f"{what}.{figure}"] = round(statistics.median(values), 4)
    return out


def verdicts(m: dict) -> dict:
    direct, before = m["direct"], m["before"]
    c1 = "perf_analyzer_c1.p50_ms" if "perf_analyzer_c1.p50_ms" in m["after"] else "c1.p50_ms"
    piece = "llm.itl_ms" if "llm.itl_ms" in m["after"] else "stream_burst.per_piece_ms"
    out: dict = {"c1_measured_with": c1.split(".")[0], "piece_measured_with": piece}
    for label in ("before", *[k for k in ROUTERS if k != "before"]):
        r = m[label]
        out[label] = {
            "c1_p50_added_ms": round(r[c1] - direct[c1], 3),
            "c1_p50_added_ms_load_tool": round(r["c1.p50_ms"] - direct["c1.p50_ms"], 3),
            "stream_piece_added_ms": round(r[piece] - direct[piece], 4),
            "stream_request_added_ms": round(
                r["stream_burst.per_piece_ms"] - direct["stream_burst.per_piece_ms"], 4
            ),
            "stream_one_at_a_time_added_ms": round(
                r["stream_one_at_a_time.p50_ms"] - direct["stream_one_at_a_time.p50_ms"], 3
            ),
            "c32_over_before": round(r["c32.throughput_rps"] / before["c32.throughput_rps"], 3),
        }
        v = out[label]
        v["meets_c1"] = v["c1_p50_added_ms"] <= TARGET_C1_ADDED_MS
        v["meets_piece"] = v["stream_piece_added_ms"] <= TARGET_PIECE_ADDED_MS
        v["meets_c32"] = v["c32_over_before"] >= TARGET_C32_RATIO
    out["default_meets_all"] = all(
        out["after"][k] for k in ("meets_c1", "meets_piece", "meets_c32")
    )
    return out


def section(r: dict) -> str:
    """This benchmark's part of benchmarks/README.md, every sentence from its numbers."""
    m, v = r["medians"], r["verdicts"]
    c1 = v["c1_measured_with"]
    rows = []
    for label in ("direct", *ROUTERS):
        f = m[label]
        rows.append(
            f"| {label} | {f.get(c1 + '.p50_ms', '-')} | {f['c1.p50_ms']} | "
            f"{f['c32.throughput_rps']} | {f['stream_one_at_a_time.p50_ms']} | "
            f"{f['stream_burst.per_piece_ms']} |"
        )
    lines = [
        "## Router hot path",
        f"`python -m benchmarks.router_hop` — medians of {r['rounds']} rounds, "
        f"{r['seconds_per_point']} s a point; `before` is the router at {r['baseline_ref']}, "
        "run in the same mesh. Client, router, Redis and worker share the machine"
        + (" (shared with other jobs while it ran)." if r.get("shared_machine") else "."),
        f"| path | c=1 p50 ms ({c1}) | c=1 p50 ms (load tool) | c=32 req/s | "
        "stream one at a time p50 ms | stream burst ms per piece |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    for label in ROUTERS:
        x = v[label]
        lines.append(
            f"- {label}: c=1 adds {x['c1_p50_added_ms']} ms "
            f"({'meets' if x['meets_c1'] else 'misses'} <= {TARGET_C1_ADDED_MS}); a streamed "
            f"piece adds {x['stream_piece_added_ms']} ms "
            f"({'meets' if x['meets_piece'] else 'misses'} <= {TARGET_PIECE_ADDED_MS}); c=32 "
            f"throughput {x['c32_over_before']}x before "
            f"({'meets' if x['meets_c32'] else 'misses'} >= {TARGET_C32_RATIO}x)."
        )
    return "\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--perf-analyzer", help="its binary (tritonclient[all]==2.50.0 has one)")
    parser.add_argument("--shared-machine", action="store_true", help="say so in the results")
    parser.add_argument("--no-llm", action="store_true", help="skip the LLM stream")
    args = parser.parse_args()
    pa = find_perf_analyzer(args.perf_analyzer)
    raw = request_bytes()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        baseline = export(args.baseline_ref, tmp / "baseline")
        toy_models.write(tmp / "models" / "mlp", toy_models.mlp(), toy_models.MLP_CONFIG)
        mesh = LocalMesh(tmp / "logs", worker_args=WORKER_ARGS)
        mesh.start_redis()
        try:
            worker = mesh.add_worker(tmp / "models")
            llm_repo, llm_skipped = (None, "--no-llm") if args.no_llm else llm_repository(tmp)
            llm_worker = mesh.add_worker(llm_repo) if llm_repo else None
            mesh.wait_registered(2 if llm_worker else 1)
            routers = start_routers(mesh, baseline)
            addresses = {"direct": worker, **{k: a for k, (a, _) in routers.items()}}
            direct_llm = llm_worker
            paths = list(addresses)
            rounds = []
            for i in range(args.rounds):
                result = {}
                order = paths[i % len(paths) :] + paths[: i % len(paths)]
                for path in order:
                    address = addresses[path]
                    llm = (direct_llm if path == "direct" else address) if llm_worker else None
                    result[path] = measure(address, raw, args.seconds, pa, tmp, llm)
                    print(f"round {i + 1} {path}: {result[path]}", flush=True)
                rounds.append(result)
        finally:
            mesh.stop()
    m = medians(rounds, paths)
    out: dict = {
        "benchmark": "router_hop",
        "machine": machine(),
        "shared_machine": args.shared_machine,
        "baseline_ref": args.baseline_ref,
        "perf_analyzer": str(pa) if pa else None,
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "burst": BURST,
        "llm_tokens": LLM_TOKENS,
        "llm_skipped": llm_skipped,
        "targets": {
            "c1_p50_added_ms": TARGET_C1_ADDED_MS,
            "stream_piece_added_ms": TARGET_PIECE_ADDED_MS,
            "c32_over_before": TARGET_C32_RATIO,
        },
        "per_round": rounds,
        "medians": m,
        "verdicts": verdicts(m),
    }
    written = write_result("router_hop", out)
    print(section(out))
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
