"""The steps behind the CLI: export, quantize, evaluate + gate (installing the accepted
versions as a model repository: quantize/repository.py).

Intermediate files live in a cache folder (default build/quantize): CACHE/<model>/fp32/ and
CACHE/<model>/<recipe>/, each with model.onnx and tokenizer.json. Every file is written
under a temporary name and renamed into place, so a failed step leaves nothing half-written.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from common import model_keys
from quantize import distill, distill_text, encoder_graph, evaluate, llm_graph, report, weights
from quantize.models import BertEncoder, LlamaDecoder
from quantize.recipes import DECODER, ENCODER, RECIPES, Recipe, lookup

MAX_POSITIONS = 8192  # SmolLM2's trained context; the serving limit is max_model_len
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
FP32 = "fp32"


class BuildError(Exception):
    """Bad input or a failed step; the message says what and how to fix it."""


@dataclass(frozen=True)
class Source:
    name: str
    kind: str
    load: Callable[[], weights.Loaded]
    recipes: tuple[str, ...]  # built by default, in version order after fp32
    config: dict[str, str] = field(default_factory=dict)  # extra meshserve parameters
    max_batch_size: int = 32
    max_queue_delay_us: int = 2000


# Prices and training costs are integers in micro-USD. Training costs are estimates:
# MiniLM-L6 (fine-tuned on 1B pairs, a TPU v3-8 for about a day) and SmolLM2-135M
# (6 * 135M params * 2T tokens ~ 1.6e21 FLOP, ~1,100 H100-hours at 40% utilisation).
SOURCES = {
    s.name: s
    for s in (
        Source(
            "minilm",
            ENCODER,
            weights.load_minilm,
            ("encoder-fp16", "encoder-int8-dynamic"),
            {
                model_keys.PRICE_PER_CALL: "20",
                model_keys.TRAINING_COST: "300000000",
                model_keys.TEXT_TASK: "embed",
                model_keys.MAX_INPUT_TOKENS: "512",  # BERT's position table
            },
        ),
        Source(
            "smollm2",
            DECODER,
            weights.load_smollm2,
            ("decoder-int8-weight-only", "decoder-int4-weight-only", "decoder-int8-dynamic"),
            {
                model_keys.PRICE_PER_CALL: "200",
                model_keys.TRAINING_COST: "2500000000",
                model_keys.PRICE_PER_1K_INPUT: "50",
                model_keys.PRICE_PER_1K_OUTPUT: "200",
                model_keys.ENGINE: model_keys.LLM_ENGINE,
                model_keys.MAX_MODEL_LEN: "2048",
            },
            max_batch_size=16,
            max_queue_delay_us=1000,
        ),
    )
}


def source(name: str) -> Source:
    if name not in SOURCES:
        raise BuildError(f"unknown model {name!r}; known models: {sorted(SOURCES)}")
    return SOURCES[name]


def recipe_named(name: str) -> Recipe:
    recipe = lookup(name)
    if recipe is None:
        raise BuildError(
            f"unknown recipe {name!r}; known recipes: {sorted(RECIPES)} "
            "(or <encoder|decoder>-distill-l<K>[-int8] for a student of K layers)"
        )
    return recipe


def recipe_for(model: Source, name: str) -> Recipe:
    recipe = recipe_named(name)
    if recipe.kind != model.kind:
        raise BuildError(
            f"recipe {name!r} is for {recipe.kind} models; {model.name!r} is an {model.kind}"
        )
    return recipe


def _quiet_quantizers() -> None:
    for name in ("onnxruntime.quantization", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)


@dataclass
class Artifact:
    folder: Path

    @property
    def model(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def tokenizer(self) -> Path:
        return self.folder / TOKENIZER_FILE

    def exists(self) -> bool:
        return self.model.exists() and self.tokenizer.exists()


def artifact_for(cache: Path, name: str, label: str) -> Artifact:
    """CACHE/<model>/<label>; a decoder's files are the LLM engine's step graphs, kept
    apart (engine-<label>) from any other export of the same model."""
    kind = SOURCES[name].kind if name in SOURCES else ENCODER
    return Artifact(cache / name / (f"engine-{label}" if kind == DECODER else label))


def _staged(target: Path, write: Callable[[Path], None]) -> None:
    """write(tmp_folder), then rename tmp_folder to target (replacing it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def export_model(name: str, cache: Path, force: bool = False) -> Artifact:
    model = source(name)
    artifact = artifact_for(cache, name, FP32)
    if artifact.exists() and not force:
        return artifact
    try:
        loaded = model.load()
    except weights.MissingWeights as e:
        raise BuildError(str(e)) from e

    _staged(artifact.folder, lambda tmp: _write_model(model, loaded, tmp))
    return artifact


def _write_model(model: Source, loaded: weights.Loaded, tmp: Path) -> None:
    """tokenizer.json and model.onnx of a torch model (the teacher or a student) into tmp."""
    loaded.tokenizer.no_padding()
    loaded.tokenizer.save(str(tmp / TOKENIZER_FILE))
    if model.kind == DECODER:  # what the LLM engine serves
        assert isinstance(loaded.model, LlamaDecoder)
        llm_graph.save(llm_graph.build(loaded.model, MAX_POSITIONS), tmp / MODEL_FILE)
        return
    assert isinstance(loaded.model, BertEncoder)
    encoder_graph.save(encoder_graph.build(loaded.model), tmp / MODEL_FILE)


STUDENT_FILE = "student.json"  # how a student was trained: its plan, text and losses


def training_text(
    cache: Path, per_topic: int | None = None, progress: Callable[[], None] | None = None
) -> list[str]:
    """Distillation text for every student, built once into
    CACHE/distill/text-g<N>-<recipe>.json: N answers per topic and template
    that the smollm2 source writes (default distill_text.PER_TOPIC; 0: none, SmolLM2 is not even
    loaded), Python's language reference and the standard library's docstrings."""
    count = distill_text.PER_TOPIC if per_topic is None else per_topic

    def generator() -> tuple[LlamaDecoder, Tokenizer]:
        loaded = source("smollm2").load()
        assert isinstance(loaded.model, LlamaDecoder)
        return loaded.model, loaded.tokenizer

    path = cache / "distill" / f"text-g{count}-{distill_text.text_recipe()}.json"
    return distill_text.training_text(path, generator, count, progress)


def distill_model(
    name: str,
    layers: int,
    cache: Path,
    steps: int | None = None,
    on_step: distill.StepCallback | None = None,
    on_text: Callable[[], None] | None = None,
    per_topic: int | None = None,
) -> Artifact:
    """The fp32 student of `layers` layers, trained against the teacher and exported to
    CACHE/<name>/<kind>-distill-l<layers>/ (reused when trained under the same plan and
    text; training resumes from CACHE/<name>/distill-l<layers>.pt after an interruption)."""
    model = source(name)
    recipe = recipe_for(model, f"{model.kind}-distill-l{layers}")
    artifact = artifact_for(cache, name, recipe.name)
    plan = distill.plan_for(model.kind, layers, steps)
    record = artifact.folder / STUDENT_FILE

    @functools.cache
    def texts() -> list[str]:  # read (or generated) once, and only when needed
        return training_text(cache, per_topic, on_text)

    if artifact.exists() and record.exists():
        built = json.loads(record.read_text())
        if built["plan"] == asdict(plan) and built["text_sha256"] == distill_text.digest(texts()):
            return artifact
    try:
        loaded = model.load()
        kept = distill.kept_layers(loaded.model.config.layers, layers)  # type: ignore[union-attr, arg-type]
    except weights.MissingWeights as e:
        raise BuildError(str(e)) from e
    except distill.DistillError as e:
        raise BuildError(f"model {name!r}: {e}") from e
    try:
        trained = distill.train(
            loaded.model,
            loaded.tokenizer,
            texts(),
            plan,
            cache / name / f"distill-l{layers}.pt",
            on_step,
        )
    except distill.DistillError as e:
        raise BuildError(f"model {name!r}: {e}") from e
    body = {
        "teacher": name,
        "plan": asdict(plan),
        "kept_layers": kept,
        "texts": len(texts()),
        "text_sha256": distill_text.digest(texts()),
        "loss_first": trained.losses[0] if trained.losses else None,
        "loss_last": trained.losses[-1] if trained.losses else None,
        "losses": [round(x, 5) for x in trained.losses],
        "resumed_from_step": trained.resumed_from,
        "train_seconds": round(trained.seconds, 1),
        "torch_threads": trained.threads,
    }

    def write(tmp: Path) -> None:
        _write_model(model, weights.Loaded(trained.student, loaded.tokenizer), tmp)
        (tmp / STUDENT_FILE).write_text(json.dumps(body, indent=1) + "\n")

    _staged(artifact.folder, write)
    return artifact


def quantize_model(
    name: str,
    recipe_name: str,
    cache: Path,
    force: bool = False,
    steps: int | None = None,
    on_step: distill.StepCallback | None = None,
) -> Artifact:
    """CACHE/<name>/<recipe>: the recipe applied to the fp32 export, or for a distillation
    recipe, the trained student (`steps`, `on_step`), with the recipe's int8 on top."""
    model = source(name)
    recipe = recipe_for(model, recipe_name)
    if recipe.student_layers is not None:
        parent = distill_model(name, recipe.student_layers, cache, steps, on_step)
    else:
        parent = export_model(name, cache)
    if recipe.apply is None:  # the student itself
        return parent
    apply = recipe.apply
    artifact = artifact_for(cache, name, recipe.name)
    lineage = parent.folder / STUDENT_FILE  # a student's int8 follows its retraining
    fresh = not lineage.exists() or (
        (artifact.folder / STUDENT_FILE).exists()
        and (artifact.folder / STUDENT_FILE).read_bytes() == lineage.read_bytes()
    )
    if artifact.exists() and fresh and not force:
        return artifact
    _quiet_quantizers()

    def write(tmp: Path) -> None:
        shutil.copy(parent.tokenizer, tmp / TOKENIZER_FILE)
        if lineage.exists():
            shutil.copy(lineage, tmp / STUDENT_FILE)
        try:
            apply(parent.model, tmp / MODEL_FILE)
        except Exception as e:  # onnxruntime's quantizers raise anything
            raise BuildError(f"recipe {recipe.name!r} failed on {name!r}: {e}") from e

    _staged(artifact.folder, write)
    return artifact


@dataclass
class Verdict:
    model: str
    recipe: Recipe
    metrics: dict
    failures: list[str]
    report: dict

    @property
    def accepted(self) -> bool:
        return not self.failures


def evaluate_model(
    name: str,
    recipe_name: str,
    cache: Path,
    reports: Path,
    progress: Callable[[], None] | None = None,
) -> Verdict:
    """Evaluate CACHE/<name>/<recipe> against its fp32 parent, apply the gate, write the report."""
    model = source(name)
    recipe = recipe_for(model, recipe_name)
    parent, candidate = artifact_for(cache, name, FP32), artifact_for(cache, name, recipe.name)
    for a in (parent, candidate):
        if not a.exists():
            raise BuildError(
                f"{a.model} does not exist; run `python -m quantize quantize --model {name} "
                f"--recipe {recipe.name}` first"
            )
    tokenizer = Tokenizer.from_file(str(parent.tokenizer))
    start = time.perf_counter()
    if model.kind == ENCODER:
        metrics = evaluate.evaluate_encoder(
            parent.model, candidate.model, tokenizer, recipe.provider
        )
    else:
        metrics = evaluate.evaluate_decoder(
            parent.model, candidate.model, tokenizer, recipe.provider, progress
        )
    failures = [
        t.describe(metrics[t.metric]) for t in recipe.gate if not t.passes(metrics[t.metric])
    ]
    paths = {FP32: parent.model, recipe.name: candidate.model}
    vocab = tokenizer.get_vocab_size()
    latency: dict[str, dict] = {}
    if not failures:
        for batch in (1, 16):
            if model.kind == ENCODER:
                latency[f"batch_{batch}"] = evaluate.encoder_latency(paths, batch, vocab)
            else:
                latency[f"batch_{batch}"] = evaluate.decoder_latency(paths, batch, vocab)
    body = report.build(
        name, recipe, metrics, failures, paths, latency, time.perf_counter() - start
    )
    report.write(reports / name, recipe.name, body)
    return Verdict(name, recipe, metrics, failures, body)


def summary(verdicts: list[Verdict], versions: dict[str, dict[int, str]]) -> dict:
    return {
        "models": {m: {str(v): label for v, label in vs.items()} for m, vs in versions.items()},
        "accepted": [f"{v.model}/{v.recipe.name}" for v in verdicts if v.accepted],
        "refused": {f"{v.model}/{v.recipe.name}": v.failures for v in verdicts if not v.accepted},
        "metrics": {f"{v.model}/{v.recipe.name}": v.metrics for v in verdicts},
    }


def write_summary(reports: Path, body: dict) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "summary.json").write_text(json.dumps(body, indent=2) + "\n")
