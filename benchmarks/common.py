"""Helpers the benchmark scripts share: processes, requests, CPU counters, results (the
machine facts and the JSON file are loadtest/results.py's; the load loops are
loadtest/calls.py's).

The results convention: `python -m benchmarks.<name>` writes benchmarks/results/<name>.json,
its data plus a top-level "summary" object that benchmarks/summary.py renders by discovery
(a new benchmark needs no edit there):

    "summary": {"title": str, "machine": str, "date": "YYYY-MM-DD", "command": str,
                "rows": [[label, value, target, verdict], ...]}

verdict is "met" / "missed", computed from the numbers (loadtest.results.check), or "" for a
figure without a target (loadtest.results.figure). An optional top-level "history" list keeps
earlier runs' headline rows: [{"date", "machine", "commit", "file", "rows"}, ...] (the
benchmark keeps it when it rewrites the file: `write_result`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import numpy as np

from common import paths
from common.net import free_port as free_port  # re-exported
from devmesh import processes
from loadtest import results
from loadtest.results import check as check  # re-exported
from loadtest.results import figure as figure  # re-exported
from loadtest.results import machine as machine  # re-exported
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
RESULTS = paths.results()


def wait_ready(address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not ready after {timeout}s")


async def wait_http(host: str, port: int, path: str, timeout_s: float, alive: Callable) -> None:
    """Until GET `path` answers 200 (a server that exited while starting raises)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited while starting")
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"http://{host}:{port}{path} not ready after {timeout_s}s")


async def http_exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> float:
    """Seconds one HTTP/1.1 request takes on a keep-alive connection: written, its head read,
    then its Content-Length bytes (a status other than 200 raises)."""
    t0 = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"HTTP answer {head[:200]!r}")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return time.perf_counter() - t0


@contextlib.asynccontextmanager
async def http_server(
    args: list[str], log: Path, port: int, ready_path: str, timeout_s: float, env: dict | None
) -> AsyncIterator[int]:
    """A server process on 127.0.0.1:`port`, its output in `log`: its pid once GET
    `ready_path` answers 200; terminated on leaving (killed after 20 s)."""
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            await wait_http("127.0.0.1", port, ready_path, timeout_s, lambda: proc.poll() is None)
            yield proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def spawn(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


@contextlib.contextmanager
def standalone_worker(repository: Path, log_dir: Path, *extra: str) -> Iterator[str]:
    """One worker process (no Redis) on a free port: its address while the block runs."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = processes.worker_process(repository, port, log_dir, None, *extra).start()
    try:
        processes.wait_serving(address, worker)
        yield address
    finally:
        worker.stop(30)


def infer_request(model: str, name: str, array: np.ndarray, datatype: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=array.shape)
    request.raw_input_contents.append(array.tobytes())
    return request


QUICK_RESULTS = paths.build_dir() / "bench-quick"  # --quick runs: not the committed results


def write_result(
    name: str,
    payload: dict,
    title: str | None = None,
    rows: list[list] | None = None,
    quick: bool = False,
    file: str | None = None,
) -> Path:
    """results/<file or name>.json (loadtest/results.py: non-finite numbers as null) with its
    summary object (built from `title` and `rows`, or the payload's own; its command
    `python -m benchmarks.<name>`) and history (the earlier file's, its headline rows added);
    a --quick run's file goes to QUICK_RESULTS instead, so that it never replaces a full
    run's (nor does a run that measured nothing: no rows)."""
    file = file or name
    if rows is not None:
        command = " ".join([f"python -m benchmarks.{name}", *sys.argv[1:]])
        payload = {
            **payload,
            "summary": results.summary_block(title or name, rows, payload["machine"], command),
        }
    if not payload.get("summary", {}).get("rows") and not quick:
        print(f"{name}: nothing measured: results/{file}.json kept, this run in {QUICK_RESULTS}")
        quick = True
    path = (QUICK_RESULTS if quick else RESULTS) / f"{file}.json"
    return results.write_json(path, {**payload, "history": [] if quick else history(path)})


def history(path: Path, keep: int = 24) -> list[dict]:
    """The history a rewrite of `path` keeps: the file's own, its summary's rows first."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    s = old.get("summary") or {}
    entry = {k: s.get(k) for k in ("date", "machine", "command", "rows")} | {"file": path.name}
    return ([entry] if s.get("rows") else []) + list(old.get("history", []))[: keep - 1]


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None, **quick: object):  # type: ignore[no-untyped-def]
    """The parser's arguments with --quick added: the benchmark's smallest meaningful run,
    the `quick` values over the flags (its file goes to QUICK_RESULTS: `write_result`)."""
    settings = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"the smallest run: {settings}")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(quick)
    return args


def print_points(results: dict[str, list[dict]]) -> None:
    """One line per measured point of a closed-loop sweep."""
    for key, points in results.items():
        for r in points:
            print(
                f"{key:28s} c={r['concurrency']:<3d} {r['throughput_rps']:8.1f} req/s  "
                f"p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms  errors {r['errors']}"
            )


def model_successes(address: str, model: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    return sum(s.inference_stats.success.count for s in reply.model_stats)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, as /proc shows them now."""
    pids, i = [pid], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pids[i]}/task").iterdir():
                pids += [int(p) for p in (task / "children").read_text().split()]
        i += 1
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (those still running)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def rss_tree_mb(pid: int) -> float | None:
    """Resident MB of a process and all its descendants (None: `pid` is gone). Reads the
    tree's own /proc files only (`process_tree`), not every process's: a sampler runs in the
    benchmark's client process twice a second per server, on the cores it measures."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            if p == pid:
                return None
    return round(total / 1024, 1)


class RssSampler:
    def __init__(self, pid: int | None) -> None:
        self.pid, self.samples, self.task = pid, [], None  # type: ignore[var-annotated]

    async def _loop(self) -> None:
        while True:
            if self.pid is not None and (v := rss_tree_mb(self.pid)) is not None:
                self.samples.append(v)
            await asyncio.sleep(0.5)

    def __enter__(self) -> RssSampler:
        self.task = asyncio.get_running_loop().create_task(self._loop())  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()

    def report(self) -> dict:
        if self.pid is None:
            return {"unavailable": "external server: pid unknown"}
        if not self.samples:
            return {}
        return {"start": self.samples[0], "peak": max(self.samples), "end": self.samples[-1]}
