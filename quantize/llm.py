"""SmolLM2 for the LLM engine: the step graph, quantized by a decoder recipe, gated, installed.

The same recipes and gate as the exported decoder (quantize/recipes.py), applied to the
engine's own graph (quantize/llm_graph.py), which is what the worker serves. The gate runs
the graphs the way the engine does — one token at a time into an in-place cache — so it
judges exactly the artifact that is installed:

    CACHE/smollm2/engine-fp32/     the step graph in fp32, the parent
    CACHE/smollm2/engine-<recipe>/ a recipe applied to it
    OUTPUT/<name>/1/model.onnx     the accepted artifact, with tokenizer.json and a
                                   decoupled config.pbtxt (Triton's vLLM-backend tensors)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tokenizers import Tokenizer

from protos import model_config_pb2 as mc
from quantize import evaluate, llm_graph, weights
from quantize.models import LlamaDecoder
from quantize.pipeline import (
    FP32,
    MODEL_FILE,
    TOKENIZER_FILE,
    Artifact,
    BuildError,
    _quiet_quantizers,
    _staged,
)
from quantize.recipes import DECODER, RECIPES, Recipe
from worker import config as cfg

MODEL = "smollm2"
DEFAULT_RECIPE = "decoder-int8-weight-only"
MAX_POSITIONS = 8192  # SmolLM2's trained context; the serving limit is max_model_len
# Per-token prices in micro-USD per 1k tokens and the training cost estimate (pipeline.py).
PARAMETERS = {
    cfg.PRICE_PER_CALL: "200",
    cfg.TRAINING_COST: "2500000000",
    "meshserve.price_per_1k_input_tokens_micro_usd": "50",
    "meshserve.price_per_1k_output_tokens_micro_usd": "200",
}


def folder(cache: Path, label: str) -> Artifact:
    return Artifact(cache / MODEL / f"engine-{label}")


def export_step_graph(cache: Path, force: bool = False) -> Artifact:
    artifact = folder(cache, FP32)
    if artifact.exists() and not force:
        return artifact
    try:
        loaded = weights.load_smollm2()
    except weights.MissingWeights as e:
        raise BuildError(str(e)) from e

    def write(tmp: Path) -> None:
        loaded.tokenizer.no_padding()
        loaded.tokenizer.save(str(tmp / TOKENIZER_FILE))
        model = loaded.model
        assert isinstance(model, LlamaDecoder)
        llm_graph.save(llm_graph.build(model, MAX_POSITIONS), tmp / MODEL_FILE)

    _staged(artifact.folder, write)
    return artifact


def recipe(name: str) -> Recipe:
    r = RECIPES.get(name)
    if r is None or r.kind != DECODER:
        known = sorted(k for k, v in RECIPES.items() if v.kind == DECODER)
        raise BuildError(f"unknown decoder recipe {name!r}; known: {known}")
    return r


def quantize_step_graph(recipe_name: str, cache: Path, force: bool = False) -> Artifact:
    r = recipe(recipe_name)
    parent = export_step_graph(cache)
    artifact = folder(cache, r.name)
    if artifact.exists() and not force:
        return artifact
    _quiet_quantizers()

    def write(tmp: Path) -> None:
        shutil.copy(parent.tokenizer, tmp / TOKENIZER_FILE)
        try:
            r.apply(parent.model, tmp / MODEL_FILE)
        except Exception as e:  # onnxruntime's quantizers raise anything
            raise BuildError(f"recipe {r.name!r} failed on the engine graph: {e}") from e

    _staged(artifact.folder, write)
    return artifact


def _runner(path: Path) -> Callable[[list[int], int], tuple[np.ndarray, list[int]]]:
    """(prompt, new_tokens) -> (teacher-forced logits of prompt + greedy continuation,
    the greedy continuation), through the engine's step model and cache."""
    from worker.llm.cache import CacheShape, KVCache
    from worker.llm.model import StepModel
    from worker.runtime import RuntimeOptions

    model = StepModel.load(path, RuntimeOptions(), ["CPUExecutionProvider"])
    f = model.facts

    def run(prompt: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
        cache = KVCache(CacheShape(f.layers, f.kv_heads, f.head_dim, 1, 256), 256)
        try:
            logits, tokens = [], list(prompt)
            for i, token in enumerate(tokens):  # the prompt, one position at a time
                logits.append(model.run(cache, np.array([[token]]), np.array([i + 1]), 0, 1)[0])
            out: list[int] = []
            while len(out) < new_tokens:
                out.append(int(logits[-1].argmax()))
                tokens.append(out[-1])
                step = np.array([[out[-1]]])
                logits.append(model.run(cache, step, np.array([len(tokens)]), 0, 1)[0])
            return np.stack(logits[:-1]), out
        finally:
            cache.close()

    return run


def gate(recipe_name: str, cache: Path) -> tuple[dict, list[str]]:
    """The recipe's decoder gate on the engine graphs: (metrics, failures). The verdict is
    kept beside the artifact (gate.json) and reused while the artifact is unchanged."""
    r = recipe(recipe_name)
    parent, candidate = folder(cache, FP32), folder(cache, r.name)
    kept = candidate.folder / "gate.json"
    stamp = candidate.model.stat().st_mtime_ns
    if kept.exists():
        saved = json.loads(kept.read_text())
        if saved.get("model_mtime_ns") == stamp:
            return saved["metrics"], saved["failures"]
    metrics, failures = _gate(r, parent, candidate)
    body = {"model_mtime_ns": stamp, "metrics": metrics, "failures": failures}
    kept.write_text(json.dumps(body, indent=2) + "\n")
    return metrics, failures


def _gate(r: Recipe, parent: Artifact, candidate: Artifact) -> tuple[dict, list[str]]:
    tokenizer = Tokenizer.from_file(str(parent.tokenizer))
    data = evaluate.load_set("decoder")
    ref, cand = _runner(parent.model), _runner(candidate.model)
    logits_r, logits_c, greedy_r, greedy_c = [], [], [], []
    for prompt in data["prompts"]:
        ids = tokenizer.encode(prompt).ids
        lr, cont_r = ref(ids, data["new_tokens"])
        # the candidate is scored on the reference's continuation (teacher forcing), and
        # its own greedy continuation is compared separately
        lc, _ = cand(ids + cont_r, 0)
        _, cont_c = cand(ids, data["new_tokens"])
        logits_r.append(lr)
        logits_c.append(lc[: len(lr)])
        greedy_r.append(cont_r)
        greedy_c.append(cont_c)
    metrics = evaluate.decoder_metrics(logits_r, logits_c, greedy_r, greedy_c)
    failures = [t.describe(metrics[t.metric]) for t in r.gate if not t.passes(metrics[t.metric])]
    return metrics, failures


def config_text(name: str, label: str, max_model_len: int) -> str:
    config = mc.ModelConfig(name=name, platform="onnxruntime_onnx", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    params = {
        **PARAMETERS,
        cfg.ENGINE: cfg.LLM_ENGINE,
        cfg.TOKENIZER: TOKENIZER_FILE,
        "meshserve.max_model_len": str(max_model_len),
        "meshserve.version.1": label,
    }
    for key, value in params.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)


def install(
    output: Path, recipe_name: str, cache: Path, name: str = MODEL, max_model_len: int = 2048
) -> Path:
    """Write OUTPUT/<name>/ with the recipe's engine graph as version 1."""
    label = recipe_name
    src = folder(cache, FP32 if recipe_name == FP32 else recipe(recipe_name).name)

    def write(tmp: Path) -> None:
        shutil.copy(src.tokenizer, tmp / TOKENIZER_FILE)
        (tmp / "1").mkdir()
        try:
            (tmp / "1" / MODEL_FILE).hardlink_to(src.model)
        except OSError:
            shutil.copy(src.model, tmp / "1" / MODEL_FILE)
        (tmp / "config.pbtxt").write_text(config_text(name, label, max_model_len))

    _staged(output / name, write)
    return output / name


def build(output: Path, recipe_name: str, cache: Path, name: str = MODEL) -> tuple[Path, dict]:
    """Export, quantize, gate and install; a refused recipe installs nothing."""
    export_step_graph(cache)
    metrics: dict = {}
    if recipe_name != FP32:
        quantize_step_graph(recipe_name, cache)
        metrics, failures = gate(recipe_name, cache)
        if failures:
            raise BuildError(
                f"recipe {recipe_name!r} refused on the engine graph: " + "; ".join(failures)
            )
    return install(output, recipe_name, cache, name), metrics
