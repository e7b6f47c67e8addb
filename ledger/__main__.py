"""python -m ledger run | report

python -m ledger run --redis-url URL [--db sqlite:///build/ledger.db] [--config FILE.toml]
python -m ledger report [--db URL] [--config FILE.toml] [--model M] [--json] [--plot FILE.png]

Each command's flags are derived from its settings (ledger/settings.py) by common/cli.py.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import sys
import threading
from collections.abc import Sequence

import structlog
from prometheus_client import Gauge, start_http_server
from redis.exceptions import RedisError

from common import cli, logging
from common.outage import Outage
from common.redis_auth import read_password
from ledger import config as ledger_config
from ledger import report
from ledger.consumer import Consumer
from ledger.economics import Economics
from ledger.restarts import RestartLog
from ledger.settings import LedgerCommon, LedgerSettings, ReportSettings
from ledger.store import Store

log = structlog.get_logger()

GAUGES = {
    name: Gauge(f"meshserve_ledger_{name}", doc, ["model"])
    for name, doc in [
        ("calls", "Successful calls N in the durable ledger"),
        ("revenue_micro_usd", "Revenue p x N"),
        ("training_cost_micro_usd", "Training cost T"),
        ("recovered_fraction", "p x N / T"),
        ("serving_cost_micro_usd", "Machine time spent serving the model"),
        ("cost_per_call_micro_usd", "Serving cost per call c"),
        ("break_even_calls", "N* = T / (p - c); -1 when p <= c"),
    ]
}


# Per tenant and model; tenants are the ones the mesh knows (a batch naming another is
# quarantined), so the label set stays bounded.
TENANT_GAUGES = {
    name: Gauge(f"meshserve_ledger_tenant_{name}", doc, ["tenant", "model"])
    for name, doc in [
        ("calls", "Successful calls of the tenant"),
        ("errors", "Calls of the tenant that failed"),
        ("prompt_tokens", "Prompt tokens billed to the tenant"),
        ("completion_tokens", "Completion tokens billed to the tenant"),
        ("revenue_micro_usd", "Revenue from the tenant (per call + per token)"),
        ("serving_cost_micro_usd", "Machine time spent on the tenant's calls"),
    ]
}


def set_gauges(rows: list[Economics], tenants: Sequence[report.TenantUsage] = ()) -> None:
    for usage in tenants:
        for name, gauge in TENANT_GAUGES.items():
            gauge.labels(usage.tenant, usage.model).set(getattr(usage, name))
    for row in rows:
        values = row.as_dict()
        for name, gauge in GAUGES.items():
            value = values[name]
            if name == "break_even_calls" and row.never_breaks_even:
                value = -1
            gauge.labels(row.model).set(value or 0)


MAX_BACKOFF_S = 30.0


def _db_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg

        errors.append(psycopg.Error)
    except ImportError:
        pass
    return tuple(errors)


DB_ERRORS = _db_errors()


class Backoff:
    """The wait before the next pass: the interval, doubled after each failed pass (up to
    `max_s`), back to the interval after a pass that went through."""

    def __init__(self, interval_s: float, max_s: float) -> None:
        self.interval_s = interval_s
        self.max_s = max_s
        self.wait_s = interval_s

    def next(self, ok: bool) -> float:
        self.wait_s = self.interval_s if ok else min(self.max_s, max(self.wait_s, 0.05) * 2)
        return self.wait_s


def run(settings: LedgerSettings) -> int:
    config = ledger_config.load(settings.config)
    store = Store(settings.db)
    password = read_password(settings.redis_password, settings.redis_password_file)
    consumer = Consumer(
        settings.redis_url,
        store,
        config,
        password,
        settings.tenants_reconcile_seconds,
        settings.interval_seconds,
    )
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_host)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    log.info("ledger_running", db=settings.db, redis=settings.redis_url)
    redis_state = Outage("ledger_redis_unreachable", "ledger_redis_reconnected")
    db_state = Outage("ledger_db_error_retrying", "ledger_db_recovered")
    backoff = Backoff(settings.interval_seconds, MAX_BACKOFF_S)

    def one_pass() -> bool:
        """True when the pass went through; a failure is logged (once per outage) and the
        next pass retries it: the cursor makes a repeated pass a no-op."""
        try:
            applied = consumer.flush()
            if applied:
                log.debug("ledger_applied", batches=applied)
            redis_state.succeeded()
            if settings.metrics_port:  # otherwise nobody reads the gauges
                set_gauges(report.build(store, config), report.by_tenant(store, config))
            db_state.succeeded()
            return True
        except (RedisError, OSError) as error:
            redis_state.failed(error)
        except DB_ERRORS as error:
            db_state.failed(error)
            with contextlib.suppress(*DB_ERRORS):
                store.reconnect()
        except Exception as error:  # a bug: logged with its traceback, retried, never a crash
            log.exception("ledger_pass_failed", error=str(error)[:300])
        return False

    while not stop.is_set():
        stop.wait(backoff.next(one_pass()))
    one_pass()  # what the routers flushed on their way out, when they stopped first
    consumer.close()
    store.close()
    log.info("ledger_stopped")
    return 0


COMMANDS: dict[str, tuple[type[LedgerCommon], str]] = {
    "run": (LedgerSettings, "move the routers' counters into the durable ledger"),
    "report": (ReportSettings, "economics per model"),
}


def parse_args(argv: Sequence[str]) -> LedgerCommon:
    """LedgerSettings for `run`, ReportSettings for `report`."""
    _, settings = cli.parse_command(COMMANDS, argv, prog="python -m ledger", description=__doc__)
    assert isinstance(settings, LedgerCommon)
    return settings


def print_report(settings: ReportSettings) -> int:
    config = ledger_config.load(settings.config)
    store = Store(settings.db)
    if settings.tenants:
        usage = report.by_tenant(store, config)
        if settings.as_json:
            print(json.dumps([u.as_dict() for u in usage], indent=2))
        else:
            print(report.tenant_text(usage))
        return 0
    rows = report.build(store, config, settings.model)
    notices = RestartLog(store, settings.interval_seconds).notices()
    if settings.as_json:
        print(json.dumps([e.as_dict() for e in rows], indent=2))
    else:
        print("\n".join([report.text(rows), *notices]))
    if settings.plot:
        report.plot(store, config, rows, settings.plot)
        print(f"plot: {settings.plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    logging.configure(settings.log_level, settings.log_json)
    try:
        if isinstance(settings, LedgerSettings):
            return run(settings)
        assert isinstance(settings, ReportSettings)
        return print_report(settings)
    except ledger_config.LedgerConfigError as e:
        print(f"meshserve ledger: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
