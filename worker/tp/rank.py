"""One non-zero rank of a shard group: `python -m worker --tp N --tp-rank R` (rank 0 starts
these beside it; in a group across hosts, one runs on each other host).

Verifies and loads its shard files for every model with a tp<N> shard set, joins the group,
reports its weight bytes and RSS, then runs what rank 0 broadcasts until told to stop.
Exit 3 when the group breaks (a peer died or a collective timed out).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from common import logging
from worker.config import ConfigError
from worker.runtime import RuntimeOptions, requested_providers
from worker.settings import WorkerSettings
from worker.tp.leader import die_with_parent, follow
from worker.tp.load import load_rank
from worker.tp.parallel import CollectiveError, destroy_tp_group, init_tp_group
from worker.tp.runtime import find_shard_sets, rss_bytes

log = structlog.get_logger()


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


def run(s: WorkerSettings) -> int:
    """Rank s.tp_rank of the group: load, join, report, follow rank 0 until told to stop."""
    die_with_parent()
    logging.configure(s.log_level, s.log_json)
    structlog.contextvars.bind_contextvars(rank=s.tp_rank)
    options = RuntimeOptions(providers=s.providers, intra_op_threads=s.intra_op_threads)
    try:
        shard_sets = find_shard_sets(s.model_repository, s.tp)
        providers = requested_providers(s.providers)
        models = [load_rank(x, s.tp_rank, options, providers) for x in shard_sets]
    except ConfigError as e:
        print(f"meshserve tp rank {s.tp_rank}: {e}", file=sys.stderr)
        return 2
    served = serve_health(s.host, s.port) if s.port else None
    try:
        group = init_tp_group(
            s.tp_rank, s.tp, s.tp_backend, s.tp_master_addr, s.tp_master_port, s.tp_timeout_seconds
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
