"""Router settings, declared once: CLI flags (derived by common/cli.py) over
MESHSERVE_ROUTER_* environment variables over defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.rpc import MAX_MESSAGE_BYTES
from router.forwarding.policies import PolicyName


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ROUTER_")

    host: str = "127.0.0.1"
    port: int = 8001
    redis_url: str = "redis://127.0.0.1:6379/0"  # the user in it: redis://router@host/0
    redis_password: SecretStr | None = None  # environment only, never a flag
    redis_password_file: Path | None = Field(
        None, description="else MESHSERVE_ROUTER_REDIS_PASSWORD, else none"
    )
    processes: int = Field(
        1,
        ge=1,
        description="router processes sharing the port (SO_REUSEPORT), each with its own router id "
        "(<router-id>-<i>) and metrics port (<metrics-port>+i); 1 = this process serves",
    )
    shared_port: bool = Field(
        False, description="bind with SO_REUSEPORT (set by --processes for its processes)"
    )
    router_id: str | None = None  # default: router-<host>-<port>-<pid>
    policy: PolicyName = Field(
        "prefix",
        description="prefix (the default): cache-aware for LLM replicas (the prompt blocks a "
        "replica holds against its load, one cost), p2c for other models and where loads are "
        "unknown; p2c is KV-aware for replicas that report KV occupancy; p2c_depth ignores it",
    )
    prefix_weight: float = Field(
        4.0,
        ge=0,
        description="policy prefix: what one uncached prompt block costs, in KV blocks held by a "
        "replica's running sequences",
    )
    prefix_index_blocks: int = Field(
        200_000, ge=0, description="policy prefix: prompt blocks the router's index remembers"
    )
    max_sessions: int = Field(
        100_000,
        ge=0,
        description="sessions (request parameter session_id) remembered for affinity; 0 = off",
    )
    poll_seconds: float = 1.0  # full registry read: the safety net under pushed events
    registry_ttl_seconds: float = 5.0
    sample_max_age_ms: int = 1000  # an older depth sample counts as unknown
    default_timeout_seconds: float = 60.0  # for callers that set no deadline
    eject_base_seconds: float = 1.0
    eject_max_seconds: float = 30.0
    # a replica with calls in flight and no depth sample for this long gets a health probe
    # with this timeout; no answer: ejected, its calls retried elsewhere
    stall_seconds: float = Field(
        1.0,
        gt=0,
        description="a replica with calls in flight and no fresh depth sample for this long gets a "
        "health probe with this timeout; no answer ejects it and retries its calls "
        "elsewhere",
    )
    migration_limit: int = Field(
        2,
        ge=0,
        description="times one LLM stream may move to another replica when its worker dies "
        "mid-way, resumed from the token ids its client was sent; 0 = off",
    )
    accounting: bool = Field(
        True, description="count calls (--no-accounting only to measure what accounting costs)"
    )
    accounting_wait_seconds: float = 0.25  # longest a reply waits for its record to be in Redis
    # ...and then: "answer" (the record stays in memory until Redis is back) or "unavailable"
    # (the call is answered UNAVAILABLE and not billed)
    accounting_when_slow: Literal["answer", "unavailable"] = Field(
        "answer",
        description="when a success's record is not in Redis after --accounting-wait-seconds: "
        "answer anyway (kept in memory) or answer UNAVAILABLE (not billed)",
    )
    accounting_commit: Literal["before-reply", "after-reply"] = Field(
        "before-reply",
        description="before-reply: a success is answered once its record is in Redis (a kill "
        "-9 loses no count); after-reply: answered at once, its record in the next group "
        "commit (a kill -9 loses at most --accounting-max-unwritten records); docs/router.md",
    )
    accounting_max_unwritten: int = Field(
        1000, ge=0, description="after-reply: records not yet in Redis beyond which replies wait"
    )
    max_inflight: int = Field(
        1024, ge=1, description="calls in the router at once; beyond: RESOURCE_EXHAUSTED"
    )
    max_inflight_per_model: int = Field(512, ge=1)
    queue_wait_bound_seconds: float = Field(
        0.0,
        ge=0,
        description="refuse a call (RESOURCE_EXHAUSTED / HTTP 429 with retry-after) whose model's "
        "predicted queue wait is over this, for normal-priority tenants (high: x2, low: x0.5); "
        "0 = off (router/forwarding/shedding.py)",
    )
    answer_margin_ms: float = Field(
        2.0, ge=0, description="deadline left below which no OK is sent"
    )
    max_message_bytes: int = MAX_MESSAGE_BYTES
    metrics_port: int = 0  # Prometheus endpoint; 0 = off
    # The HTTP front door (router/http/, docs/http.md).
    http_port: int = Field(
        0, ge=0, description="serve OpenAI's API and KServe v2 REST on this port too (0 = off)"
    )
    http_host: str | None = Field(None, description="default: --host")
    http_max_body_bytes: int = Field(
        64 << 20, ge=1024, description="an HTTP body over this is refused (413)"
    )
    http_body_timeout_seconds: float = Field(
        30.0, gt=0, description="an HTTP body must arrive within this (else 408)"
    )
    http_header_timeout_seconds: float = Field(
        10.0, gt=0, description="an HTTP request's headers must arrive within this (else 408)"
    )
    http_model_aliases: str = Field(
        "",
        description="OpenAI model names served as others: 'gpt-4o=smollm2,text-embedding-3-small"
        "=minilm' (router/http/model_names.py)",
    )
    # Tenants (router/tenancy/auth.py): API keys, models, limits. Off only on 127.0.0.1 (make run).
    auth: bool = Field(
        True, description="API keys (--no-auth: refused unless --host is 127.0.0.1, as make run)"
    )
    auth_cache_seconds: float = Field(1.0, ge=0)  # a revoked key works at most this long
    # TLS to clients when both are given; mutual TLS to the workers with the mesh CA and
    # the router's client certificate.
    tls_cert: Path | None = Field(None, description="serve TLS with this certificate (PEM)")
    tls_key: Path | None = None
    mesh_ca: Path | None = Field(
        None, description="CA of the workers' certificates: mutual TLS to them"
    )
    mesh_cert: Path | None = Field(
        None, description="the router's client certificate for the workers"
    )
    mesh_key: Path | None = None
    reflection: bool | None = Field(
        None, description="gRPC server reflection; default: on only when bound to 127.0.0.1"
    )
    metrics_host: str = Field("127.0.0.1", description="default 127.0.0.1")
    grace_seconds: float = 10.0
    log_level: str = "info"
    log_json: bool | None = None
