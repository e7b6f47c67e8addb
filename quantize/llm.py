"""SmolLM2 for the LLM engine in one call: export, quantize, gate, install one version.

The steps are the pipeline's (quantize/pipeline.py): a decoder is exported as the engine's
step graph (quantize/llm_graph.py), a recipe quantizes it, and the gate judges it the way the
worker serves it (quantize/evaluate.py runs the engine). This module only picks one recipe
and installs it alone, as `make run` and the tests want it:

    OUTPUT/<name>/1/model.onnx   the accepted artifact (its weights in model.onnx.data
                                 beside it), with tokenizer.json, a decoupled
                                 config.pbtxt (Triton's vLLM-backend tensors) and
                                 tokenizer_config.json (the GGUF's chat template)

or, built `by_cpu` (BY_CPU), with each other recipe's graph in 1/<recipe>/model.onnx and the
config's meshserve.cpu_model_filenames saying which one a worker serves on which CPU.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import onnx

from common import cpu, model_keys, paths
from quantize import checkpoint, checkpoints, embedding, int4, llm_graph, pipeline, weights
from quantize.pipeline import FP32, MODEL_FILE, TOKENIZER_FILE, BuildError
from quantize.repository import llm_config_text

MODEL = "smollm2"
DEFAULT_RECIPE = "decoder-int8-weight-only"
MAX_POSITIONS = pipeline.MAX_POSITIONS
MAX_MODEL_LEN = model_keys.MAX_MODEL_LEN
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # Hugging Face's name


# The recipe to serve by CPU (`build(by_cpu=True)`), in order; the first flag the CPU has
# wins, "*" any. W8A8's int8 QGEMM pays with AMX; MatMulNBits' int8 kernel needs VNNI, and
# without it the int4 kernel is faster (docs/decisions.md, "W8A8 where the CPU has AMX" and
# "int4 weights where the CPU lacks VNNI"). A CPU with VNNI but no AMX keeps int8: W8A8 was
# not measured there.
W8A8_RECIPE = "decoder-w8a8"
BY_CPU = (
    ("amx_int8", W8A8_RECIPE),
    ("avx512_vnni", DEFAULT_RECIPE),
    ("avx_vnni", DEFAULT_RECIPE),
    ("*", "decoder-int4-weight-only"),
)
# Recipes whose numbers hold only on a CPU with their rule's flag (W8A8's QGEMM saturates
# without VNNI): built, gated and listed only where this CPU has it.
CPU_BOUND = frozenset({W8A8_RECIPE})


def buildable(by_cpu: Sequence[tuple[str, str]], flags: frozenset[str]) -> list[tuple[str, str]]:
    """BY_CPU's rules less those for a CPU-bound recipe whose flag this CPU lacks."""
    return [(flag, r) for flag, r in by_cpu if r not in CPU_BOUND or flag in flags]


def recipes_of(recipe_name: str, by_cpu: Sequence[tuple[str, str]]) -> list[str]:
    """The main recipe, then each other one `by_cpu` names, once each."""
    return list(dict.fromkeys([recipe_name, *(recipe for _, recipe in by_cpu)]))


def variant_file(recipe_name: str, main: str) -> str:
    """Where a recipe's graph lives in the version folder: the main one as model.onnx, each
    other in a folder named after it (its weights file beside it keeps its own name)."""
    return MODEL_FILE if recipe_name == main else f"{recipe_name}/{MODEL_FILE}"


def config_text(
    name: str,
    label: str,
    max_model_len: int,
    by_cpu: Sequence[tuple[str, str]] = (),
    parameters: Mapping[str, str] | None = None,
) -> str:
    """The served model's config.pbtxt; `parameters`: config keys set besides (e.g.
    meshserve.max_num_seqs), over the defaults."""
    params = {
        **pipeline.source(MODEL).config,
        MAX_MODEL_LEN: str(max_model_len),
        **(parameters or {}),
    }
    if by_cpu:
        params[model_keys.CPU_MODEL_FILENAMES] = " ".join(
            f"{flag}:{variant_file(recipe, label)}" for flag, recipe in by_cpu
        )
    source = replace(pipeline.source(MODEL), name=name, config=params)
    return llm_config_text(source, {1: label})


def gate(recipe_name: str, cache: Path, reports: Path) -> tuple[dict, list[str]]:
    """The recipe's verdict on the engine graph: (metrics, failures). A report newer than
    the artifact is reused rather than measured again."""
    candidate = pipeline.artifact_for(cache, MODEL, recipe_name)
    kept = reports / MODEL / f"{recipe_name}.json"
    if kept.exists() and kept.stat().st_mtime_ns > candidate.model.stat().st_mtime_ns:
        body = json.loads(kept.read_text())
        return body["metrics"], body["failures"]
    verdict = pipeline.evaluate_model(MODEL, recipe_name, cache, reports)
    return verdict.metrics, verdict.failures


def install(
    output: Path,
    recipe_name: str,
    cache: Path,
    name: str = MODEL,
    max_model_len: int = 2048,
    by_cpu: Sequence[tuple[str, str]] = (),
    parameters: Mapping[str, str] | None = None,
) -> Path:
    """Write OUTPUT/<name>/ with the recipe's engine graph as version 1; with `by_cpu`
    ((flag, recipe) pairs, as BY_CPU), every recipe named there too, and the config's
    meshserve.cpu_model_filenames choosing among them (worker/config.model_filename);
    `parameters`, more config keys (config_text)."""
    src = pipeline.artifact_for(cache, MODEL, recipe_name)

    chat = json.dumps(weights.smollm2_tokenizer_config(), indent=2) + "\n"

    recipes = recipes_of(recipe_name, by_cpu)
    served = {r: served_graph(pipeline.artifact_for(cache, MODEL, r)) for r in recipes}

    def write(tmp: Path) -> None:
        shutil.copy(src.tokenizer, tmp / TOKENIZER_FILE)
        (tmp / TOKENIZER_CONFIG_FILE).write_text(chat)  # the chat template (worker/llm/chat.py)
        for recipe, graph in served.items():
            folder = (tmp / "1" / variant_file(recipe, recipe_name)).parent
            folder.mkdir(parents=True, exist_ok=True)
            for file in llm_graph.served_files(graph):
                paths.link_or_copy(file, folder / file.name)
        text = config_text(name, recipe_name, max_model_len, by_cpu, parameters)
        (tmp / "config.pbtxt").write_text(text)

    pipeline._staged(output / name, write)
    return output / name


def served_graph(artifact: pipeline.Artifact) -> Path:
    """The artifact's graph with its weights beside it (llm_graph.save_served), written once
    into the cache (ARTIFACT/served/) and again whenever the artifact is newer."""
    path = artifact.folder / "served" / MODEL_FILE
    if not path.exists() or path.stat().st_mtime_ns < artifact.model.stat().st_mtime_ns:
        proto = onnx.load(str(artifact.model))

        def write(tmp: Path) -> None:
            llm_graph.save_served(proto, tmp / MODEL_FILE)

        pipeline._staged(path.parent, write)
    return path


def build(
    output: Path,
    recipe_name: str,
    cache: Path,
    name: str = MODEL,
    reports: Path | None = None,
    max_model_len: int = 2048,
    by_cpu: Sequence[tuple[str, str]] = (),
    parameters: Mapping[str, str] | None = None,
) -> tuple[Path, dict]:
    """Export, quantize, gate and install (with `by_cpu`, every recipe named there too;
    `parameters`, more config keys); a refused recipe installs nothing. Returns the main
    recipe's gate metrics."""
    by_cpu = buildable(by_cpu, cpu.flags())
    pipeline.export_model(MODEL, cache)
    found: dict[str, dict] = {}
    for recipe in recipes_of(recipe_name, by_cpu):
        if recipe == FP32:
            continue
        pipeline.quantize_model(MODEL, recipe, cache)
        found[recipe], failures = gate(recipe, cache, reports or cache / "reports")
        if failures:
            refused = "; ".join(failures)
            raise BuildError(f"recipe {recipe!r} refused on the engine graph: {refused}")
    path = install(output, recipe_name, cache, name, max_model_len, by_cpu, parameters)
    return path, found.get(recipe_name, {})


# ---- any Llama-family checkpoint, from its own metadata (quantize/checkpoint.py) -----------

AS_STORED = "as-stored"  # the checkpoint's own numbers: GGUF codes kept exactly, floats fp32


def checkpoint_graph(
    ck: checkpoint.Checkpoint, kv_dtype: str = "float32", custom_op: bool | None = None
) -> onnx.ModelProto:
    """The step graph of a checkpoint as stored: RoPE tables for its context length, and
    every GGUF block-quantized weight (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, the K-quants)
    over the file's very codes (quantize/int4.py, quantize/gguf_blocks.py; int8 activations
    per block as llama.cpp's own kernels): meshserve's MatMulQ for blocks of 32 where its
    library is built (custom_op, see int4.quantize_matmuls), else MatMulNBits; F32 / F16
    weights (and every Hugging Face weight) as float32 MatMuls. The embedding table keeps the
    file's codes where its block type is symmetric (quantize/embedding.py), else, and in a
    build without the custom op (custom_op False: a GPU's), fp32."""
    proto = llm_graph.build(ck.model(), kv_dtype=kv_dtype)
    if ck.gguf is not None:
        try:
            int4.quantize_matmuls(
                proto, gguf_path=ck.gguf, otherwise="keep", accuracy_level=4, custom_op=custom_op
            )
            if custom_op is not False:  # a GPU's build keeps the fp32 table (see embedding.py)
                embedding.gather_from_gguf(proto, ck.gguf)
        except (int4.QuantizeError, embedding.EmbeddingError) as e:
            raise checkpoint.CheckpointError(str(e)) from e
    return proto


def build_checkpoint(
    path: Path,
    output: Path,
    name: str,
    max_model_len: int | None = None,
    kv_dtype: str = "float32",
    custom_op: bool | None = None,
) -> Path:
    """OUTPUT/<name>/ serving the checkpoint as stored (version 1). Without max_model_len,
    the worker serves the model's own context length, bounded by its KV budget."""
    ck = checkpoints.load(path)
    proto = checkpoint_graph(ck, kv_dtype, custom_op)
    params = dict(pipeline.source(MODEL).config)
    params.pop(MAX_MODEL_LEN)
    if max_model_len is not None:
        params[MAX_MODEL_LEN] = str(max_model_len)
    source = replace(pipeline.source(MODEL), name=name, config=params)

    def write(tmp: Path) -> None:
        ck.tokenizer.no_padding()
        ck.tokenizer.no_truncation()
        ck.tokenizer.save(str(tmp / TOKENIZER_FILE))
        (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(ck.tokenizer_config, indent=2) + "\n")
        llm_graph.save_served(proto, tmp / "1" / MODEL_FILE)
        label = f"{AS_STORED}-{ck.architecture}"
        (tmp / "config.pbtxt").write_text(llm_config_text(source, {1: label}))

    pipeline._staged(output / name, write)
    return output / name
