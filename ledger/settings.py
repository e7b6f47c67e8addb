"""Ledger settings: CLI flags over MESHSERVE_LEDGER_* environment variables over defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class LedgerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_LEDGER_")

    redis_url: str = "redis://127.0.0.1:6379/0"  # the user in it: redis://ledger@host/0
    redis_password: SecretStr | None = None  # environment only, never a flag
    redis_password_file: Path | None = None
    db: str = "sqlite:///build/ledger.db"  # or postgresql://user@host:5432/db
    config: Path | None = None  # TOML: machine prices, per-model p and T
    interval_seconds: float = 1.0
    # a full comparison of Redis's tenant records with the database's, this often (and at
    # once whenever Redis's tenants version differs from the database's)
    tenants_reconcile_seconds: float = 60.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
    log_json: bool | None = None
