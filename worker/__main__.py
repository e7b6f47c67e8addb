"""python -m worker --model-repository DIR --host 127.0.0.1 --port PORT"""

from __future__ import annotations

import argparse
import asyncio
import sys

from common import logging
from planner.profiles import ProfileError
from worker.config import ConfigError
from worker.runtime import GpuRequired, ModelLoadError
from worker.server import GroupFailed, serve
from worker.settings import WorkerSettings


def parse_args(argv: list[str]) -> WorkerSettings:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Serve an ONNX model repository over the KServe v2 gRPC API. "
        "Every flag can also be set as MESHSERVE_WORKER_<FLAG>.",
    )
    parser.add_argument("--model-repository")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--providers", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--require-gpu", action="store_true", default=None)
    parser.add_argument("--intra-op-threads", type=int)
    parser.add_argument("--inter-op-threads", type=int)
    parser.add_argument("--default-max-batch-size", type=int)
    parser.add_argument("--default-max-queue-size", type=int)
    parser.add_argument("--max-message-bytes", type=int)
    parser.add_argument("--max-bytes-elements", type=int, help="BYTES elements per tensor")
    parser.add_argument("--grace-seconds", type=float)
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--redis-password-file", help="else MESHSERVE_WORKER_REDIS_PASSWORD, else none"
    )
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key")
    parser.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gRPC server reflection; default: on only when bound to 127.0.0.1",
    )
    parser.add_argument(
        "--tls-client-ca", help="accept only clients with a certificate from this CA (mTLS)"
    )
    parser.add_argument("--worker-id")
    parser.add_argument("--advertise-address")
    parser.add_argument("--heartbeat-seconds", type=float)
    parser.add_argument("--registry-ttl-seconds", type=float)
    parser.add_argument("--tp", type=int, help="serve tp<N> shard sets with N ranks")
    parser.add_argument("--tp-backend", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--tp-master-addr")
    parser.add_argument("--tp-master-port", type=int, help="a group across hosts: rank 0's port")
    parser.add_argument("--tp-rank", type=int, help="run rank R (> 0) of a group across hosts")
    parser.add_argument("--tp-timeout-seconds", type=float)
    parser.add_argument("--memory-budget-bytes", type=int, help="weight bytes per rank")
    parser.add_argument(
        "--roofline-profile", help="H200, H100, A100, L4 or a profile file (planner probe)"
    )
    parser.add_argument("--metrics-port", type=int, help="Prometheus endpoint; 0 = off")
    parser.add_argument("--metrics-host", help="default 127.0.0.1")
    parser.add_argument("--log-level")
    args = parser.parse_args(argv)
    return WorkerSettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    if settings.tp_rank:
        return run_rank(settings)
    logging.configure(settings.log_level, settings.log_json)
    try:
        asyncio.run(serve(settings))
    except (ConfigError, GpuRequired, ModelLoadError, ProfileError) as e:
        print(f"meshserve worker: {e}", file=sys.stderr)
        return 2
    except GroupFailed as e:
        print(f"meshserve worker: tensor-parallel group failed: {e}", file=sys.stderr)
        return 3
    return 0


def run_rank(settings: WorkerSettings) -> int:
    """A non-zero rank of a group whose ranks are started one per host (--tp-master-port)."""
    if not 0 < settings.tp_rank < settings.tp or not settings.tp_master_port:
        print(
            f"meshserve worker: --tp-rank {settings.tp_rank} needs --tp N with N > "
            f"{settings.tp_rank} and --tp-master-port (rank 0's port), got --tp {settings.tp} "
            f"--tp-master-port {settings.tp_master_port}",
            file=sys.stderr,
        )
        return 2
    from worker.tp import rank as tp_rank  # torch: only a shard group needs it

    return tp_rank.main(
        [
            "--model-repository",
            str(settings.model_repository),
            "--tp",
            str(settings.tp),
            "--rank",
            str(settings.tp_rank),
            "--master-addr",
            settings.tp_master_addr,
            "--master-port",
            str(settings.tp_master_port),
            "--health-host",
            settings.host,
            "--health-port",
            str(settings.port),
            *tp_rank.group_args(settings),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
