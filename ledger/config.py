"""Ledger inputs: per model the price per call p and training cost T, per worker kind the
price of a machine-hour. Money is integer micro-USD everywhere.

A TOML file (all optional; models not in it take p and T from their config.pbtxt
parameters, as the workers publish them in the registry):

    [machines]            # micro-USD per machine-hour, by worker kind
    cpu = 100_000         # $0.10
    gpu = 2_500_000       # $2.50

    [models.mlp]
    price_per_call_micro_usd = 100
    training_cost_micro_usd = 5_000_000_000

    [models.smollm2]      # an LLM: per-token prices as well (optional, default 0)
    price_per_call_micro_usd = 0
    training_cost_micro_usd = 50_000_000
    price_per_1k_input_tokens_micro_usd = 50
    price_per_1k_output_tokens_micro_usd = 200
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MACHINE_PRICES = {"cpu": 100_000, "gpu": 2_500_000}
TOKEN_PRICES = ("price_per_1k_input_tokens_micro_usd", "price_per_1k_output_tokens_micro_usd")


class LedgerConfigError(Exception):
    """A config the ledger refuses to start with; the message names the key and the value."""


@dataclass(frozen=True)
class ModelTerms:
    price_micro_usd: int
    training_cost_micro_usd: int
    price_per_1k_input_tokens_micro_usd: int = 0
    price_per_1k_output_tokens_micro_usd: int = 0


@dataclass(frozen=True)
class LedgerConfig:
    machine_prices: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MACHINE_PRICES))
    models: dict[str, ModelTerms] = field(default_factory=dict)


def _money(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LedgerConfigError(f"{where} must be an integer number of micro-USD, got {value!r}")
    if value < 0:
        raise LedgerConfigError(f"{where} must not be negative, got {value}")
    return value


def load(path: Path | None) -> LedgerConfig:
    if path is None:
        return LedgerConfig()
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LedgerConfigError(f"{path}: {e}") from e
    prices = dict(DEFAULT_MACHINE_PRICES)
    for kind, value in raw.get("machines", {}).items():
        prices[kind] = _money(value, f"{path}: machines.{kind}")
    models = {}
    for name, terms in raw.get("models", {}).items():
        for key in ("price_per_call_micro_usd", "training_cost_micro_usd"):
            if key not in terms:
                raise LedgerConfigError(f"{path}: models.{name} has no {key}")
        models[name] = ModelTerms(
            _money(
                terms["price_per_call_micro_usd"], f"{path}: models.{name}.price_per_call_micro_usd"
            ),
            _money(
                terms["training_cost_micro_usd"], f"{path}: models.{name}.training_cost_micro_usd"
            ),
            *(_money(terms.get(key, 0), f"{path}: models.{name}.{key}") for key in TOKEN_PRICES),
        )
    unknown = set(raw) - {"machines", "models"}
    if unknown:
        raise LedgerConfigError(f"{path}: unknown section(s) {sorted(unknown)}")
    return LedgerConfig(prices, models)
