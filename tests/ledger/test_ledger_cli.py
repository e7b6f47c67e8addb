"""`python -m ledger run | report`: flags derived from the ledger's settings, declared once;
every flag users, docs and deploy files type still parses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from common import cli
from ledger.__main__ import main, parse_args
from ledger.settings import LedgerCommon, LedgerSettings, ReportSettings
from ledger.store import BatchEntry, Store


@pytest.mark.parametrize("settings", [LedgerSettings, ReportSettings])
def test_every_setting_but_a_secret_is_a_flag(settings: type[LedgerCommon]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_flags(parser, settings)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(settings.model_fields) - {"redis_password"}


def test_the_flags_users_type_still_parse(tmp_path: Path) -> None:
    run = parse_args(
        [
            "run",
            "--redis-url",
            "redis://ledger@redis:6379/0",
            "--redis-password-file",
            str(tmp_path / "pw"),
            "--interval-seconds",
            "0.2",
            "--tenants-reconcile-seconds",
            "1",
            "--metrics-port",
            "9091",
            "--log-level",
            "debug",
            "--db",
            "sqlite:////data/ledger.db",
            "--config",
            str(tmp_path / "ledger.toml"),
        ]
    )
    assert isinstance(run, LedgerSettings)
    assert (run.redis_url, run.redis_password_file) == (
        "redis://ledger@redis:6379/0",
        tmp_path / "pw",
    )
    assert (run.interval_seconds, run.tenants_reconcile_seconds, run.metrics_port) == (0.2, 1, 9091)
    assert (run.log_level, run.db, run.config) == (
        "debug",
        "sqlite:////data/ledger.db",
        tmp_path / "ledger.toml",
    )
    flags = ["--db", "sqlite:///l.db", "--model", "mlp", "--json", "--tenants"]
    report = parse_args(["report", *flags, "--plot", "ledger.png", "--config", "p.toml"])
    assert isinstance(report, ReportSettings)
    assert (report.db, report.model, report.as_json, report.tenants) == (
        "sqlite:///l.db",
        "mlp",
        True,
        True,
    )
    assert (report.plot, report.config) == (Path("ledger.png"), Path("p.toml"))
    plain = parse_args(["report"])
    assert isinstance(plain, ReportSettings) and not plain.as_json and not plain.tenants


@pytest.mark.parametrize(
    "argv",
    [
        [],  # a command is required
        ["serve"],
        ["run", "--redis-password", "x"],  # a secret is never a flag
        ["run", "--redis-pass", "x"],  # no abbreviations: not --redis-password-file
        ["run", "--model", "mlp"],  # a report flag
        ["report", "--redis-url", "redis://x"],  # a run flag
        ["report", "--js"],
    ],
)
def test_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2


def test_flags_over_environment_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_LEDGER_DB", "sqlite:///env.db")
    monkeypatch.setenv("MESHSERVE_LEDGER_INTERVAL_SECONDS", "5")
    for command in ("run", "report"):  # one database for both
        s = parse_args([command])
        assert (s.db, s.interval_seconds, s.config) == ("sqlite:///env.db", 5.0, None)
    s = parse_args(["run", "--db", "sqlite:///flag.db"])
    assert isinstance(s, LedgerSettings)
    assert (s.db, s.interval_seconds, s.metrics_port) == ("sqlite:///flag.db", 5.0, 0)


def test_report_prints_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    store = Store(db)
    counts = [3, 2, 1, 300, 3000]
    store.apply("r1", [BatchEntry(1, {("mlp", "1", "acme"): counts}, 1)], 0)  # totals too
    store.close()
    assert main(["report", "--db", db, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["calls"]) for r in rows] == [("mlp", 2)]
    assert main(["report", "--db", db, "--tenants", "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert [(u["tenant"], u["calls"], u["errors"]) for u in usage] == [("acme", 2, 1)]
    assert main(["report", "--db", db, "--model", "mlp"]) == 0
    assert "mlp" in capsys.readouterr().out


def test_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ledger.toml"
    path.write_text("[models.mlp]\nprice_per_call_micro_usd = -1\ntraining_cost_micro_usd = 1\n")
    db = f"sqlite:///{tmp_path / 'l.db'}"
    assert main(["report", "--db", db, "--config", str(path)]) == 2
    assert "price_per_call_micro_usd must not be negative" in capsys.readouterr().err
