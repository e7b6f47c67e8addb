"""The models the planner reasons about: a repository's versions, the recipes each could be
served as, and the prices in its config."""

from __future__ import annotations

from pathlib import Path

from common import model_keys
from perfmodel.analysis import (
    DECODER,
    AnalysisError,
    ModelAnalysis,
    analyse_file,
    read_config,
)
from planner.plan import Prices

# Recipes that pass their accuracy gate, by kind (decoder-int8-dynamic is refused).
GATED = {
    False: ("encoder-fp16", "encoder-int8-dynamic"),
    True: ("decoder-fp16", "decoder-int8-weight-only", "decoder-int4-weight-only"),
}
PRICE_KEYS = {
    "per_call_micro_usd": model_keys.PRICE_PER_CALL,
    "training_cost_micro_usd": model_keys.TRAINING_COST,
    "per_1k_input_micro_usd": model_keys.PRICE_PER_1K_INPUT,
    "per_1k_output_micro_usd": model_keys.PRICE_PER_1K_OUTPUT,
}


def model_versions(repository: Path, model: str) -> list[ModelAnalysis]:
    folder = repository / model
    if not folder.is_dir():
        known = (
            sorted(p.name for p in repository.iterdir() if p.is_dir())
            if repository.is_dir()
            else []
        )
        raise AnalysisError(
            f"no model {model!r} in {repository}; expected {repository}/{model}/<version>/"
            f"model.onnx (models there: {known})"
        )
    config = read_config(folder)
    found = [
        analyse_file(v / "model.onnx", model, v.name, config)
        for v in sorted(folder.iterdir(), key=lambda p: (len(p.name), p.name))
        if v.is_dir() and v.name.isdigit() and (v / "model.onnx").exists()
    ]
    if not found:
        raise AnalysisError(f"{folder}: no <version>/model.onnx")
    return found


def with_recipes(versions: list[ModelAnalysis]) -> list[ModelAnalysis]:
    """The versions the repository holds (measured bytes), plus every other gated recipe for
    the model's kind, predicted from the parameter count (of the fp32 version if any)."""
    out = list(versions)
    have = {v.recipe for v in versions}
    base = next((v for v in versions if v.recipe == "fp32"), versions[0])
    for recipe in GATED[base.kind == DECODER]:
        if recipe not in have:
            out.append(base.as_recipe(recipe))
    return out


def prices(repository: Path, model: str, per_device_hour_usd: float) -> Prices:
    config = read_config(repository / model)
    values = {}
    for field_name, key in PRICE_KEYS.items():
        p = config.parameters.get(key)
        values[field_name] = int(p.string_value) if p is not None and p.string_value else 0
    return Prices(per_device_hour_usd, **values)
