"""Worker settings, declared once: CLI flags (derived by common/cli.py) over
MESHSERVE_WORKER_* environment variables over defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.rpc import MAX_MESSAGE_BYTES


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_WORKER_")

    model_repository: Path = Path("models")
    host: str = "127.0.0.1"
    port: int = 8001
    providers: Literal["auto", "cuda", "cpu"] = "auto"
    require_gpu: bool = Field(
        False, description="refuse to start when onnxruntime falls back to the CPU"
    )
    intra_op_threads: int = 0
    inter_op_threads: int = 1
    default_max_batch_size: int = 32  # for models whose config does not say
    default_max_queue_size: int = 512
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # BYTES elements per request tensor: each becomes a Python object and an onnxruntime
    # string, so a few bytes of request can cost ~100 bytes of memory and ~1 us of CPU, part
    # of it with the GIL held in onnxruntime's string conversion (which stalls health checks:
    # ~0.3 s at this default on a busy 2-core machine, under the router's 1 s health timeout).
    max_bytes_elements: int = Field(1 << 18, description="BYTES elements per tensor")
    grace_seconds: float = 10.0
    # Mesh membership: with a Redis URL the worker registers itself for routers to find.
    redis_url: str | None = Field(
        None, description="register in the mesh's Redis (redis://, rediss://, redis+sentinel://)"
    )  # the user in it: redis://worker@host:6379/0
    redis_password: SecretStr | None = None  # environment only, never a flag
    redis_password_file: Path | None = Field(
        None, description="else MESHSERVE_WORKER_REDIS_PASSWORD, else none"
    )
    # TLS: serve with this certificate; with a client CA, only clients holding a
    # certificate from it (the router's mesh certificate) are accepted: mutual TLS.
    tls_cert: Path | None = Field(None, description="serve TLS with this certificate (PEM)")
    tls_key: Path | None = None
    tls_client_ca: Path | None = Field(
        None, description="accept only clients with a certificate from this CA (mTLS)"
    )
    reflection: bool | None = Field(
        None, description="gRPC server reflection; default: on only when bound to 127.0.0.1"
    )  # gRPC server reflection; default: only on 127.0.0.1
    worker_id: str | None = None  # default: worker-<host>-<port>
    advertise_address: str | None = None  # default: host:port as bound
    heartbeat_seconds: float = 1.0
    registry_ttl_seconds: float = 5.0
    depth_interval_seconds: float = 0.1
    drain_seconds: float = 0.5  # after leaving the registry, before refusing new calls
    # Tensor parallelism (worker/tp/serve.py): tp >= 1 serves the models' tp<N> shard sets
    # with a group of N rank processes; 0 is the plain single-process worker.
    tp: int = Field(0, description="serve tp<N> shard sets with N ranks")
    tp_backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL when CUDA is active
    tp_master_addr: str = "127.0.0.1"
    # 0: rank 0 takes a free port and starts ranks 1..N-1 beside it. Set: the group spans
    # hosts (a Kubernetes StatefulSet, one pod per rank): rank 0 listens on this port at
    # tp_master_addr and starts no ranks; each other rank is `python -m worker --tp N
    # --tp-rank R` with the same master address and port.
    tp_master_port: int = Field(0, description="a group across hosts: rank 0's port")
    tp_rank: int = Field(
        0,
        description="run rank R (> 0) of a group: no gRPC, grpc.health.v1 on --port "
        "(0: none); across hosts with --tp-master-port",
    )
    tp_timeout_seconds: float = 10.0  # a collective slower than this fails the group
    memory_budget_bytes: int = Field(
        0, description="weight bytes per rank; 0: no limit"
    )  # weight bytes per rank; 0: no limit
    # The roof ModelStatistics measures each model against (perfmodel/profiles.py: H200,
    # H100, A100, L4 or a profile file); default: build/planner/profile.json when probed.
    roofline_profile: str | None = Field(
        None, description="H200, H100, A100, L4 or a profile file (planner probe)"
    )
    metrics_port: int = Field(
        0, description="Prometheus endpoint; 0 = off"
    )  # Prometheus endpoint; 0 = off
    metrics_host: str = Field("127.0.0.1", description="default 127.0.0.1")
    log_level: str = "info"
    log_json: bool | None = None  # default: JSON when stderr is not a terminal
