"""meshserve side by side with MLServer 1.7.1, same ONNX model, same load tool.

    python -m benchmarks.mlserver [--seconds 5] [--quick]

(1) one worker process vs MLServer with parallel_workers=0 (inference in its one process);
(2) router + 2 workers vs MLServer with 2 parallel workers. Closed loop at concurrency 1, 8
and 32 from `loadtest`, requests built from each server's model metadata. MLServer runs a
minimal onnxruntime runtime (benchmarks/mlserver_runtime.py), one onnxruntime thread like
the workers. MLServer lives in its own venv (build/mlserver-venv, created here when
missing: it pins grpcio/protobuf of its own, and uvloop==0.21.0 for its worker processes).
Writes benchmarks/results/mlserver.json and mlserver_latency.png, mlserver_cdf_c8.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    ROOT,
    check,
    figure,
    free_port,
    machine,
    parse,
    print_points,
    standalone_worker,
    wait_ready,
    write_result,
)
from client.client import Client
from devmesh import toy_models
from devmesh.processes import LocalMesh
from loadtest import inputs, plots
from loadtest.runner import Load, closed_loop, measured

VENV = ROOT / "build" / "mlserver-venv"
PACKAGES = ["mlserver==1.7.1", "onnxruntime==1.23.2", "uvloop==0.21.0"]
INSTALL_TIMEOUT_S = 900
CONCURRENCY = [1, 8, 32]
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
WORKER_CONFIG = "max_batch_size: 64\ndynamic_batching { max_queue_delay_microseconds: 0 }\n"
MLP_IO = {
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}],
}


def ensure_venv() -> Path:
    """build/mlserver-venv with PACKAGES, created or repaired when the stamp disagrees."""
    stamp = VENV / ".meshserve-stamp"
    if stamp.exists() and stamp.read_text() == "\n".join(PACKAGES):
        return VENV / "bin" / "mlserver"
    print(f"creating {VENV} with {' '.join(PACKAGES)} (a few minutes on a cold cache)")
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True, timeout=INSTALL_TIMEOUT_S)
    subprocess.run([*pip, *PACKAGES], check=True, timeout=INSTALL_TIMEOUT_S)
    stamp.write_text("\n".join(PACKAGES))
    return VENV / "bin" / "mlserver"


def mlserver_folder(root: Path, model: Path, parallel_workers: int) -> tuple[Path, str]:
    """settings.json, the runtime and mlp/model-settings.json; returns (folder, grpc addr)."""
    root.mkdir(parents=True)
    grpc_port = free_port()
    settings = {
        "host": "127.0.0.1",
        "http_port": free_port(),
        "grpc_port": grpc_port,
        "metrics_port": free_port(),
        "parallel_workers": parallel_workers,
        "debug": False,
    }
    (root / "settings.json").write_text(json.dumps(settings))
    shutil.copy(ROOT / "benchmarks" / "mlserver_runtime.py", root / "mlserver_runtime.py")
    (root / "mlp").mkdir()
    shutil.copy(model, root / "mlp" / "model.onnx")
    model_settings = {
        "name": "mlp",
        "implementation": "mlserver_runtime.OnnxRuntime",
        "parameters": {"uri": "./model.onnx", "extra": {"intra_op_threads": 1}},
        **MLP_IO,
    }
    (root / "mlp" / "model-settings.json").write_text(json.dumps(model_settings))
    return root, f"127.0.0.1:{grpc_port}"


@contextmanager
def mlserver(binary: Path, folder: Path, address: str) -> Iterator[str]:
    log = (folder / "mlserver.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    process = subprocess.Popen(
        [str(binary), "start", str(folder)],
        cwd=folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its worker processes share the group; stopped together
    )
    try:
        wait_ready(address, timeout=120)
        wait_model(address, "mlp")
        yield address
    except Exception:
        print((folder / "mlserver.log").read_text()[-4000:])
        raise
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


def wait_model(address: str, model: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with Client(address, timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                if client.model_ready(model):
                    return
            except Exception:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{model} not ready at {address}")


def sweep(address: str, seconds: float) -> list[dict]:
    """The load tool at each concurrency, requests from the server's own metadata."""
    with Client(address) as client:
        meta = client.model_metadata("mlp")
    requests = inputs.serialize("mlp", inputs.from_metadata(meta, batch=1))
    load = Load(address, requests, duration=seconds, warmup=1.0, timeout=30.0)
    return [asyncio.run(closed_loop(load, c)) for c in CONCURRENCY]


def run_all(tmp: Path, binary: Path, seconds: float) -> dict[str, list[dict]]:
    repo = tmp / "models"
    toy_models.write(repo / "mlp", toy_models.mlp(), WORKER_CONFIG)
    model = repo / "mlp" / "1" / "model.onnx"
    results: dict[str, list[dict]] = {}

    with standalone_worker(repo, tmp, *WORKER_ARGS) as address:
        results["worker"] = sweep(address, seconds)

    folder, address = mlserver_folder(tmp / "mls0", model, parallel_workers=0)
    with mlserver(binary, folder, address):
        results["mlserver"] = sweep(address, seconds)

    mesh = LocalMesh(tmp / "mesh-logs", worker_args=WORKER_ARGS)
    mesh.start_redis()
    try:
        mesh.add_worker(repo)
        mesh.add_worker(repo)
        mesh.wait_registered(2)
        results["router_2_workers"] = sweep(mesh.start_router(), seconds)
    finally:
        mesh.stop()

    folder, address = mlserver_folder(tmp / "mls2", model, parallel_workers=2)
    with mlserver(binary, folder, address):
        results["mlserver_2_workers"] = sweep(address, seconds)
    return results


def summarize(results: dict[str, list[dict]]) -> dict:
    def at(key: str, c: int) -> dict:
        return next(r for r in results[key] if r["concurrency"] == c)

    out: dict[str, dict] = {}
    for ours, theirs in (("worker", "mlserver"), ("router_2_workers", "mlserver_2_workers")):
        for c in CONCURRENCY:
            a, b = at(ours, c), at(theirs, c)
            out[f"{ours}_over_{theirs}_c{c}"] = {
                "throughput_ratio": round(a["throughput_rps"] / max(b["throughput_rps"], 1e-9), 2),
                "p99_ratio": round(a["p99_ms"] / b["p99_ms"], 2) if b["p99_ms"] else None,
            }
    c8 = out["worker_over_mlserver_c8"]
    met = c8["throughput_ratio"] >= 2.0 and c8["p99_ratio"] is not None and c8["p99_ratio"] <= 1.0
    return {**out, "target_met": bool(met)}


def plot(results: dict[str, list[dict]]) -> None:
    plots.latency_vs_load(
        {k: [measured(r) for r in v] for k, v in results.items()},
        RESULTS / "mlserver_latency.png",
        "meshserve vs MLServer: p50/p99 against throughput (c = 1, 8, 32)",
    )
    c8 = [(k, next(r for r in v if r["concurrency"] == 8)) for k, v in results.items()]
    plots.latency_cdf(c8, RESULTS / "mlserver_cdf_c8.png", "Latency CDF at concurrency 8")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parse(parser, seconds=1.0)  # and no plots
    binary = ensure_venv()
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60
    ).stdout.split()[-1]  # "mlserver, version 1.7.1"
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(Path(tmp), binary, args.seconds)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot(results)
    payload = {
        "benchmark": "mlserver",
        "model": "tiny MLP 16->64->4 fp32, batch 1 per request",
        "mlserver": version,
        "mlserver_packages": PACKAGES,
        "seconds_per_point": args.seconds,
        "machine": machine(),
        "results": {k: [measured(r) for r in v] for k, v in results.items()},
        "ratios": summarize(results),
    }
    path = write_result("mlserver", payload, TITLE, rows(payload), args.quick)
    print_points(results)
    print(f"wrote {path}")


TITLE = "Side by side with MLServer 1.7.1 (tiny MLP)"


def rows(r: dict) -> list[list]:
    """Headline rows: the target at c=8 (>= 2x MLServer's throughput, p99 no worse), and the
    two-process pair at c=32."""
    s = r["ratios"]
    c8, pair = s["worker_over_mlserver_c8"], s["router_2_workers_over_mlserver_2_workers_c32"]
    return [
        check("worker / MLServer req/s at c=8", c8["throughput_ratio"], 2.0, False, "x"),
        check("worker / MLServer p99 at c=8", c8["p99_ratio"], 1.0, True, "x"),
        figure(
            "router + 2 workers / MLServer 2 workers req/s at c=32", pair["throughput_ratio"], "x"
        ),
        figure("router + 2 workers / MLServer 2 workers p99 at c=32", pair["p99_ratio"], "x"),
    ]


if __name__ == "__main__":
    main()
