"""Router settings: CLI flags over MESHSERVE_ROUTER_* environment variables over defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.rpc import MAX_MESSAGE_BYTES


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ROUTER_")

    host: str = "127.0.0.1"
    port: int = 8001
    redis_url: str = "redis://127.0.0.1:6379/0"  # the user in it: redis://router@host/0
    redis_password: SecretStr | None = None  # environment only, never a flag
    redis_password_file: Path | None = None
    processes: int = Field(1, ge=1)  # router processes sharing the port (SO_REUSEPORT)
    shared_port: bool = False  # bind with SO_REUSEPORT: set by --processes for its processes
    router_id: str | None = None  # default: router-<host>-<port>-<pid>
    policy: Literal["p2c", "p2c_depth", "least_loaded", "round_robin", "random"] = "p2c"
    max_sessions: int = Field(100_000, ge=0)  # session affinity LRU size; 0 = no affinity
    poll_seconds: float = 1.0  # full registry read: the safety net under pushed events
    registry_ttl_seconds: float = 5.0
    sample_max_age_ms: int = 1000  # an older depth sample counts as unknown
    default_timeout_seconds: float = 60.0  # for callers that set no deadline
    eject_base_seconds: float = 1.0
    eject_max_seconds: float = 30.0
    # a replica with calls in flight and no depth sample for this long gets a health probe
    # with this timeout; no answer: ejected, its calls retried elsewhere
    stall_seconds: float = Field(1.0, gt=0)
    accounting: bool = True  # off only to measure what accounting costs
    accounting_wait_seconds: float = 0.25  # longest a reply waits for its record to be in Redis
    # ...and then: "answer" (the record stays in memory until Redis is back) or "unavailable"
    # (the call is answered UNAVAILABLE and not billed)
    accounting_when_slow: Literal["answer", "unavailable"] = "answer"
    max_inflight: int = Field(1024, ge=1)  # calls in the router at once; beyond: RESOURCE_EXHAUSTED
    max_inflight_per_model: int = Field(512, ge=1)
    answer_margin_ms: float = Field(2.0, ge=0)  # a reply needs this much deadline left to be sent
    max_message_bytes: int = MAX_MESSAGE_BYTES
    metrics_port: int = 0  # Prometheus endpoint; 0 = off
    # The HTTP front door (router/http/): OpenAI's API and KServe v2 REST; 0 = off.
    http_port: int = Field(0, ge=0)
    http_host: str | None = None  # default: --host
    http_max_body_bytes: int = Field(64 << 20, ge=1024)  # 413 past it
    http_body_timeout_seconds: float = Field(30.0, gt=0)  # a body must arrive in this (408)
    http_header_timeout_seconds: float = Field(10.0, gt=0)  # and its headers in this (408)
    # Tenants (router/auth.py): API keys, models, limits. Off only on 127.0.0.1 (make run).
    auth: bool = True
    auth_cache_seconds: float = Field(1.0, ge=0)  # a revoked key works at most this long
    # TLS to clients when both are given; mutual TLS to the workers with the mesh CA and
    # the router's client certificate.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    mesh_ca: Path | None = None
    mesh_cert: Path | None = None
    mesh_key: Path | None = None
    reflection: bool | None = None  # default: on only when bound to 127.0.0.1
    metrics_host: str = "127.0.0.1"
    grace_seconds: float = 10.0
    log_level: str = "info"
    log_json: bool | None = None
