"""Ledger settings, declared once: CLI flags (derived by common/cli.py) over
MESHSERVE_LEDGER_* environment variables over defaults. `python -m ledger run` takes
LedgerSettings, `python -m ledger report` ReportSettings; both share LedgerCommon (the
database, the prices, logging), so MESHSERVE_LEDGER_DB names the same database for both."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class LedgerCommon(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_LEDGER_")

    db: str = Field(
        "sqlite:///build/ledger.db",
        description="the durable ledger: sqlite:///FILE or postgresql://user@host:5432/db",
    )
    config: Path | None = Field(None, description="TOML: machine prices, per-model p and T")
    interval_seconds: float = Field(
        1.0, description="the ledger's pass interval (report: the loss bound without an AOF)"
    )
    log_level: str = "info"
    log_json: bool | None = None


class LedgerSettings(LedgerCommon):
    """python -m ledger run"""

    redis_url: str = "redis://127.0.0.1:6379/0"  # the user in it: redis://ledger@host/0
    redis_password: SecretStr | None = None  # environment only, never a flag
    redis_password_file: Path | None = Field(
        None, description="else MESHSERVE_LEDGER_REDIS_PASSWORD, else none"
    )
    tenants_reconcile_seconds: float = Field(
        60.0,
        description="a full comparison of Redis's tenant records with the database's, this "
        "often (and at once whenever Redis's tenants version differs from the database's)",
    )
    metrics_port: int = Field(0, description="Prometheus metrics on this port; 0: none")
    metrics_host: str = "127.0.0.1"


class ReportSettings(LedgerCommon):
    """python -m ledger report"""

    model: str | None = Field(None, description="only this model")
    as_json: bool = Field(
        False,
        description="JSON instead of text (MESHSERVE_LEDGER_AS_JSON)",
        json_schema_extra={"flag": "json"},
    )
    tenants: bool = Field(False, description="revenue, calls, tokens and cost per tenant")
    plot: Path | None = Field(None, description="write a PNG of revenue vs T and cost per call")
