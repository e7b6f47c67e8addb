"""What an idle mesh costs, before and after registry changes were pushed (pub/sub) instead
of polled, in one run; and what one full registry read costs the router.

    python -m benchmarks.idle [--seconds 10] [--baseline-ref REF]

For this tree and for REF (default: where this branch left main, `git merge-base HEAD
main`; its files exported with `git archive`, the generated stubs copied in), one mesh:
a private Redis, one real worker (toy `mlp`) and a router, measured in three phases:
1. idle: no calls at all;
2. plus 100 fake workers registered (heartbeats only, as real idle workers send);
3. the 100 fake workers' depths changing 10 times a second each (1,000 changes/s, each
   written to its depth key and published, as a busy worker does).
CPU is user+system seconds from /proc over `--seconds` per phase, in cores. Then, in this
process with this tree's code, the time of one full registry read (`Registry.refresh`) with
the 100 fakes registered: the router did one 20 times a second before, once a second now.
Writes benchmarks/results/idle.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from io import BytesIO
from pathlib import Path

from benchmarks.common import ROOT, cpu_seconds, machine, write_result
from benchmarks.readings import table
from common import mesh_state, redis_conn, rpc
from common.mesh_state import DepthSample, ModelEntry, RegistryEvent, WorkerInfo, now_ms
from devmesh import toy_models
from devmesh.processes import LocalMesh, free_port, router_process, wait_serving, worker_process
from router.forwarding.registry import Registry

FAKES = 100
CHURN_HZ = 10.0
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")


def export(ref: str, dest: Path) -> Path:
    """The tree at `ref`, with this tree's generated stubs (they are not committed)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    for stub in (ROOT / "protos").glob("*_pb2*.py*"):
        shutil.copy(stub, dest / "protos" / stub.name)
    return dest


class FakeWorkers:
    """`n` registrations no process serves (addresses nothing listens on, never called):
    heartbeats every second; with `churn_hz`, each one's depth changes that often."""

    def __init__(self, redis_url: str, n: int) -> None:
        self.client = redis_conn.connect(redis_url)
        self.infos = [
            WorkerInfo(
                id=f"fake-{i:03d}",
                address=f"127.0.0.1:{40000 + i}",
                models={"fake": ModelEntry(versions=["1"], max_queue=64)},
                provider="CPUExecutionProvider",
                started_ms=now_ms(),
            )
            for i in range(n)
        ]
        self.churn_hz = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        last_beat, tick = 0.0, 0
        while not self.stop.is_set():
            now = time.monotonic()
            pipe = self.client.pipeline(transaction=False)
            if now - last_beat >= 1.0:
                last_beat = now
                for info in self.infos:
                    pipe.set(mesh_state.worker_key(info.id), info.to_json(), px=5000)
                    pipe.zadd(mesh_state.WORKERS, {info.id: now_ms()})
            if self.churn_hz:
                tick += 1
                for info in self.infos:
                    sample = DepthSample(tick % 5, now_ms()).encode()
                    pipe.set(mesh_state.depth_key(info.id), sample, px=5000)
                    event = RegistryEvent("depth", info.id, sample).encode()
                    pipe.publish(mesh_state.REGISTRY_EVENTS, event)
            pipe.execute()
            self.stop.wait(1 / self.churn_hz if self.churn_hz else 0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def phases(code: Path, tmp: Path, seconds: float) -> dict[str, dict[str, float]]:
    """The three phases on one mesh whose worker and router run the code in `code`."""
    repo = tmp / "models"
    toy_models.write(repo / "mlp", toy_models.mlp(), toy_models.MLP_CONFIG)
    mesh = LocalMesh(tmp / "logs")
    mesh.start_redis()
    port, router_port = free_port(), free_port()
    worker = worker_process(repo, port, mesh.log_dir, mesh.redis_url, *WORKER_ARGS)
    router = router_process(router_port, mesh.redis_url, mesh.log_dir)
    worker.cwd = router.cwd = code
    fakes = FakeWorkers(mesh.redis_url, FAKES)
    out: dict[str, dict[str, float]] = {}
    try:
        worker.start()
        wait_serving(f"127.0.0.1:{port}", worker)
        router.start()
        wait_serving(f"127.0.0.1:{router_port}", router)
        assert worker.popen and router.popen and mesh.redis_server and mesh.redis_server.popen
        pids = {
            "worker": [worker.popen.pid],
            "router": [router.popen.pid],
            "redis": [mesh.redis_server.popen.pid],
        }

        def measure(label: str) -> None:
            time.sleep(2.0)  # settle
            before = {part: cpu_seconds(p) for part, p in pids.items()}
            time.sleep(seconds)
            out[label] = {
                part: round((cpu_seconds(p) - before[part]) / seconds, 4)
                for part, p in pids.items()
            }
            print(f"{code.name:>12s} {label:28s} {out[label]}", flush=True)

        measure("idle")
        fakes.start()
        measure(f"{FAKES}_fake_workers_idle")
        fakes.churn_hz = CHURN_HZ
        measure(f"{FAKES}_fake_workers_{CHURN_HZ:g}hz_depth")
    finally:
        fakes.close()
        for process in (router, worker):
            process.stop()
        mesh.stop()
    return out


def refresh_cost(tmp: Path, n: int = 50) -> dict[str, float]:
    """One full registry read with FAKES workers registered, in this process (this tree)."""
    mesh = LocalMesh(tmp / "logs-refresh")
    mesh.start_redis()
    fakes = FakeWorkers(mesh.redis_url, FAKES)
    fakes.start()
    try:
        time.sleep(0.5)

        async def run() -> float:
            registry = Registry(mesh.redis_url, rpc.message_options())
            await registry.refresh()  # admits the fakes (channels, first parse)
            assert len(registry.replicas) == FAKES
            t0 = time.perf_counter()
            for _ in range(n):
                await registry.refresh()
            elapsed = (time.perf_counter() - t0) / n
            await registry.close()
            return elapsed

        per_refresh = asyncio.run(run())
    finally:
        fakes.close()
        mesh.stop()
    # Measured in this process, beside the fakes' writer thread: an upper bound on what a
    # router process pays per read (the phases above measure the routers themselves).
    return {"refresh_ms": round(per_refresh * 1000, 3), "before_per_s": 20.0, "after_per_s": 1.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--baseline-ref", help="default: git merge-base HEAD main")
    args = parser.parse_args()
    ref = (
        args.baseline_ref
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        baseline = export(ref, tmp / "baseline")
        results = {
            "before": phases(baseline, tmp / "before", args.seconds),
            "after": phases(ROOT, tmp / "after", args.seconds),
        }
        refresh = refresh_cost(tmp)
    summary = {
        phase: {
            part: {
                "before": results["before"][phase][part],
                "after": results["after"][phase][part],
            }
            for part in ("worker", "router", "redis")
        }
        for phase in results["after"]
    }
    path = write_result(
        "idle",
        {
            "benchmark": "idle",
            "baseline_ref": ref,
            "seconds_per_phase": args.seconds,
            "cpu_unit": "cores (CPU seconds per second)",
            "machine": machine(),
            "results": results,
            "refresh": refresh,
            "summary": summary,
        },
    )
    print(summary)
    print(refresh)
    print(f"wrote {path}")


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    rows = [
        [phase, part, v["before"], v["after"]]
        for phase, parts in r["summary"].items()
        for part, v in parts.items()
    ]
    f = r["refresh"]
    return "\n\n".join(
        [
            "## Idle cost: registry pushed (pub/sub) against polled",
            f"`python -m benchmarks.idle` — one real worker and a router, before (`"
            f"{r['baseline_ref'][:10]}`) and after, CPU in {r['cpu_unit']} over "
            f"{r['seconds_per_phase']} s per phase.",
            table(["phase", "process", "before", "after"], rows),
            f"One full registry read with 100 registered workers: {f['refresh_ms']} ms, "
            "timed in the benchmark's own process beside the fakes' writer thread (an upper "
            f"bound: the phases above measure the router itself); the router did "
            f"{f['before_per_s']:g} a second before, {f['after_per_s']:g} now.",
        ]
    )


if __name__ == "__main__":
    main()
