"""python -m worker.tp.rank: one non-zero rank of a shard group (rank 0 starts these; in a
group across hosts, `python -m worker --tp N --tp-rank R` runs one on each other host).

Verifies and loads its shard files for every model with a tp<N> shard set, joins the group,
reports its weight bytes and RSS, then runs what rank 0 broadcasts until told to stop.
Exit 3 when the group breaks (a peer died or a collective timed out).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from common import logging
from worker.config import ConfigError
from worker.runtime import RuntimeOptions, requested_providers
from worker.settings import WorkerSettings
from worker.tp.leader import follow
from worker.tp.load import load_rank
from worker.tp.parallel import CollectiveError, destroy_tp_group, init_tp_group
from worker.tp.runtime import find_shard_sets, rss_bytes

log = structlog.get_logger()


def group_args(settings: WorkerSettings) -> list[str]:
    """The flags every rank takes from rank 0's settings, beside its rank and master."""
    return [
        "--backend",
        settings.tp_backend,
        "--timeout-seconds",
        str(settings.tp_timeout_seconds),
        "--providers",
        settings.providers,
        "--intra-op-threads",
        str(settings.intra_op_threads),
        "--log-level",
        settings.log_level,
    ]


def serve_health(host: str, port: int) -> tuple[grpc.Server, HealthServicer]:
    """grpc.health.v1 for a rank on a host of its own: NOT_SERVING until it has joined the
    group, SERVING after (the process exits when the group breaks). Keep the server
    referenced: it stops when collected."""
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    health = HealthServicer()
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, health


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker.tp.rank", description=__doc__)
    p.add_argument("--model-repository", type=Path, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout-seconds", type=float, default=10.0)
    p.add_argument("--providers", default="auto")
    p.add_argument("--intra-op-threads", type=int, default=0)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--health-port", type=int, default=0, help="serve grpc.health.v1 here (a rank's own pod)"
    )
    p.add_argument("--health-host", default="0.0.0.0")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.configure(args.log_level, None)
    structlog.contextvars.bind_contextvars(rank=args.rank)
    options = RuntimeOptions(providers=args.providers, intra_op_threads=args.intra_op_threads)
    try:
        shard_sets = find_shard_sets(args.model_repository, args.tp)
        providers = requested_providers(args.providers)
        models = [load_rank(s, args.rank, options, providers) for s in shard_sets]
    except ConfigError as e:
        print(f"meshserve tp rank {args.rank}: {e}", file=sys.stderr)
        return 2
    served = serve_health(args.health_host, args.health_port) if args.health_port else None
    try:
        group = init_tp_group(
            args.rank,
            args.tp,
            args.backend,
            args.master_addr,
            args.master_port,
            args.timeout_seconds,
        )
        weights = sum(m.weight_bytes for m in models)
        group.gather_ints([weights, rss_bytes()])
        log.info("tp_rank_ready", backend=group.backend, weight_bytes=weights, rss=rss_bytes())
        if served is not None:
            served[1].set("", health_pb2.HealthCheckResponse.SERVING)
        follow(models, group)
    except CollectiveError as e:
        log.error("tp_rank_failed", error=str(e))
        return 3
    destroy_tp_group()
    log.info("tp_rank_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
