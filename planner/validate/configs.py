"""What `python -m planner validate` checks: its settings, the configurations, the load each
call carries, the targets, and the model repositories each configuration is served from."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common import model_keys, paths
from quantize import llm, pipeline

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
TOKENS = 16  # MiniLM items: 16 tokens (the TEXT padding unit)
PROMPT, MAX_TOKENS = 64, 32  # SmolLM2 calls
STEP_CONTEXT = PROMPT + MAX_TOKENS // 2  # a decode step's mean context
TARGETS = {"throughput": 0.20, "p99": 0.30}
BEST = "served"  # the prediction judged against the targets
LLM_MODEL = "smollm2"


class ValidateSettings(BaseSettings):
    """The flags of `python -m planner validate` (common/cli.py derives them), over
    MESHSERVE_PLANNER_VALIDATE_* environment variables."""

    model_config = SettingsConfigDict(env_prefix="MESHSERVE_PLANNER_VALIDATE_")

    seconds: float = Field(5.0, gt=0, description="seconds of load per measured point")
    skip_llm: bool = Field(False, description="leave out the SmolLM2 configurations")
    cache: Path = Field(
        default_factory=lambda: paths.build("quantize"),
        description="the quantize cache (models built there when missing)",
    )
    results: Path = Field(
        default_factory=paths.results,
        description="where planner.json and the Roofline plots go",
    )
    reanalyse: bool = Field(
        False,
        description="recompute the predictions from the measurements in planner.json",
    )


@dataclass(frozen=True)
class Config:
    model: str
    recipe: str
    replicas: int
    max_batch: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.recipe} x{self.replicas} b{self.max_batch}"

    @property
    def key(self) -> str:
        """The model x recipe: what is analysed and calibrated once for every row of it."""
        return f"{self.model} {self.recipe}"

    @property
    def llm(self) -> bool:
        return self.model == LLM_MODEL


CONFIGS = [
    Config("minilm", "fp32", 1, 8),
    Config("minilm", "encoder-int8-dynamic", 1, 8),
    Config("minilm", "encoder-int8-dynamic", 2, 8),
    Config("minilm", "encoder-int8-dynamic", 3, 8),
    Config("minilm", "encoder-int8-dynamic", 1, 1),
    Config(LLM_MODEL, "decoder-int8-weight-only", 1, 4),
    Config(LLM_MODEL, "decoder-int8-weight-only", 1, 1),
]


def artifact(model: str, recipe: str, cache: Path) -> Path:
    """The recipe's ONNX file in the quantize cache; built there (and gated) when missing."""
    found = pipeline.artifact_for(cache, model, recipe)
    if found.exists():
        return found.model
    if model == LLM_MODEL:
        llm.build(Path(tempfile.mkdtemp()), recipe, cache)
    elif recipe == pipeline.FP32:
        pipeline.export_model(model, cache)
    else:
        pipeline.quantize_model(model, recipe, cache)
    return found.model


def repository(root: Path, c: Config, cache: Path) -> Path:
    """A model repository under `root` serving `c`'s model at its batch limit."""
    folder = root / c.label.replace(" ", "_") / c.model
    src = artifact(c.model, c.recipe, cache)  # built (and gated) when missing
    if c.llm:  # installed as for a worker: the graph with its weights beside it, the tokenizer
        llm.install(folder.parent, c.recipe, cache, c.model, 2048)
        seqs = f'value {{ string_value: "{c.max_batch}" }}'
        with (folder / "config.pbtxt").open("a") as config:
            config.write(f'parameters {{ key: "{model_keys.MAX_NUM_SEQS}" {seqs} }}\n')
        return folder.parent
    (folder / "1").mkdir(parents=True)
    paths.link_or_copy(src, folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        f'name: "{c.model}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {c.max_batch}\n'
        "dynamic_batching { default_queue_policy { max_queue_size: 1024 } }\n"
        f'parameters {{ key: "meshserve.version.1" value {{ string_value: "{c.recipe}" }} }}\n'
    )
    return folder.parent
