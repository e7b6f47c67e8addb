from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ledger.config import LedgerConfigError, load

ROOT = Path(__file__).resolve().parents[2]


def test_good_config(tmp_path: Path) -> None:
    path = tmp_path / "ledger.toml"
    path.write_text(
        "[machines]\ncpu = 200_000\n[models.mlp]\n"
        "price_per_call_micro_usd = 100\ntraining_cost_micro_usd = 5_000_000\n"
    )
    config = load(path)
    assert config.machine_prices["cpu"] == 200_000
    assert config.machine_prices["gpu"] == 2_500_000  # default kept
    assert config.models["mlp"].training_cost_micro_usd == 5_000_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[models.mlp]\nprice_per_call_micro_usd = -5\ntraining_cost_micro_usd = 1\n",
            "models.mlp.price_per_call_micro_usd must not be negative, got -5",
        ),
        (
            "[models.mlp]\nprice_per_call_micro_usd = 5\n",
            "models.mlp has no training_cost_micro_usd",
        ),
        ("[machines]\ncpu = 0.5\n", "machines.cpu must be an integer number of micro-USD"),
        ("[pricing]\n", "unknown section(s) ['pricing']"),
        ("[models.mlp\n", "Expected ']'"),
    ],
)
def test_bad_config_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "ledger.toml"
    path.write_text(text)
    with pytest.raises(LedgerConfigError) as info:
        load(path)
    assert message in str(info.value)


def test_ledger_refuses_to_start_on_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "ledger.toml"
    path.write_text("[models.mlp]\nprice_per_call_micro_usd = -1\ntraining_cost_micro_usd = 1\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ledger",
            "run",
            "--config",
            str(path),
            "--db",
            f"sqlite:///{tmp_path / 'l.db'}",
            "--redis-url",
            "redis://127.0.0.1:1/0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "price_per_call_micro_usd must not be negative" in done.stderr
