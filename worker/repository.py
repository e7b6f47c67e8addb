"""The model repository in Triton's layout, loaded: DIR/<model>/<version>/model.onnx (or the
file the model's config chooses for this CPU: worker/config.model_filename).

Each loaded model version owns its onnxruntime session, its batcher and its statistics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import structlog

from common import cpu, model_keys
from common.errors import NotFound
from protos import model_config_pb2 as mc
from worker import config as cfg
from worker.backends import BatchedBackend, LLMBackend, ModelBackend, TextBackend
from worker.batcher import Batcher
from worker.llm.model import Model, StepModel, is_step_graph
from worker.llm.serving import LLMServing, draft_path
from worker.runtime import CPU, OnnxSession, RuntimeOptions, requested_providers
from worker.stats import ModelStats
from worker.text import TextModel

log = structlog.get_logger()


@dataclass
class LoadedModel:
    spec: cfg.ModelSpec
    config: mc.ModelConfig  # completed, as ModelConfig answers it
    session: OnnxSession
    stats: ModelStats
    backend: ModelBackend  # what runs it: worker/backends.py

    @property
    def llm(self) -> LLMServing | None:
        """The generation engine's serving, for an LLM (its metrics read the engine)."""
        return self.backend.serving if isinstance(self.backend, LLMBackend) else None

    @property
    def depth(self) -> int:
        return self.backend.depth

    @property
    def max_queue_size(self) -> int:
        return self.backend.max_queue_size

    @property
    def kv_tokens(self) -> tuple[int, int]:
        return self.backend.kv_tokens

    async def close(self) -> None:
        await self.backend.close()


def _versions(model_dir: Path, config: mc.ModelConfig) -> list[str]:
    default = cfg.default_filename(config)
    found = sorted(
        int(p.name) for p in model_dir.iterdir() if p.name.isdigit() and (p / default).exists()
    )
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        chosen = found
    elif choice == "specific":
        chosen = [v for v in found if v in set(policy.specific.versions)]
    else:
        chosen = found[-(policy.latest.num_versions or 1) :]
    return [str(v) for v in chosen]


def serve_llm(
    spec: cfg.ModelSpec,
    model: Model,
    model_dir: Path,
    draft: Model | None = None,
    **facts: object,
) -> tuple[LLMServing, ModelStats]:
    """The engine over `model` (one session, or a shard group's TPStepModel), with its draft
    model for speculative decoding if any, started, its runs counted in Triton's statistics
    fields; `facts` go into the load log line."""
    llm = LLMServing(spec, model, model_dir, draft)
    stats = ModelStats()
    llm.engine.on_execution = lambda kind, rows, tokens, ns: stats.record_execution(
        rows, rows, 0, ns, 0, kind, tokens, llm.engine.cached_tokens() if kind == "decode" else 0
    )
    llm.engine.on_admit = stats.queue.add
    llm.engine.start()
    log.info(
        "model_loaded",
        model=spec.name,
        version=spec.version,
        engine="llm",
        max_model_len=llm.config.max_model_len,
        max_num_seqs=llm.config.max_num_seqs,
        kv_cache_tokens=llm.config.kv_cache_tokens,
        kv_cache_bytes=llm.config.kv_cache_tokens * llm.engine.cache.shape.bytes_per_token,
        num_speculative_tokens=llm.engine.drafter.num_tokens if llm.engine.drafter else 0,
        **facts,
    )
    return llm, stats


class Repository:
    def __init__(
        self,
        root: Path,
        options: RuntimeOptions,
        default_max_batch_size: int = 32,
        default_max_queue_size: int = 512,
    ) -> None:
        self.root = root
        self.options = options
        self.default_max_batch_size = default_max_batch_size
        self.default_max_queue_size = default_max_queue_size
        self.models: dict[str, dict[str, LoadedModel]] = {}
        self._providers = requested_providers(options.providers)

    def load(self) -> None:
        if not self.root.is_dir():
            raise cfg.ConfigError(f"model repository {self.root} is not a directory")
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            config = cfg.read(model_dir)
            versions = _versions(model_dir, config)
            if not versions:
                raise cfg.ConfigError(
                    f"model {model_dir.name!r}: no version folder with a "
                    f"{cfg.default_filename(config)} in {model_dir}"
                )
            for version in versions:
                self.models.setdefault(model_dir.name, {})[version] = self._load_version(
                    model_dir, version, config
                )

    def _load_version(self, model_dir: Path, version: str, config: mc.ModelConfig) -> LoadedModel:
        file = cfg.model_filename(config, cpu.flags())
        path = model_dir / version / file
        if not path.is_file():
            raise cfg.ConfigError(
                f"model {config.name!r} version {version}: {file}, the file "
                f"{cfg.CPU_MODEL_FILENAMES} chooses for this CPU, is not in {path.parent}"
            )
        options = self.options
        if cfg.is_llm(config):
            # Off unless the model says `meshserve.intra_op_spinning: "true"`: a pool spinning
            # after its run takes the cores the event loop and a draft model need next; on a
            # machine of its own spinning is faster (docs/decisions.md, "Spinning off by default").
            options = dataclasses.replace(
                options,
                allow_spinning=_spinning(config),
                cuda_graph=_flag(config, model_keys.CUDA_GRAPH, default=True),
            )
        session = OnnxSession(path, options, self._providers)
        if session.provider == CPU:  # CUDA did not come up: do not retry it for every model
            self._providers = [CPU]
        if cfg.is_llm(config):
            return self._load_llm(model_dir, version, config, session, file)
        completed = cfg.complete(
            config,
            session.inputs,
            session.outputs,
            self.default_max_batch_size,
            self.default_max_queue_size,
        )
        completed.parameters[cfg.EXECUTION_PROVIDER].string_value = session.provider
        completed.parameters[cfg.MODEL_FILE].string_value = file
        cfg.add_index_bounds(completed, session.index_bounds)
        cfg.add_text_tensors(completed)
        spec = cfg.spec(completed, version)
        stats = ModelStats()
        batcher = Batcher(
            spec, session.run, stats, spec.max_queue_size or self.default_max_queue_size
        )
        text = None
        backend: ModelBackend = BatchedBackend(spec, batcher)
        if cfg.TOKENIZER in spec.parameters:
            text = TextModel(spec, model_dir, batcher.submit)
            text.warm_up(session.run)
            backend = TextBackend(spec, batcher, text)
        else:
            session.warm_up(spec)
        log.info(
            "model_loaded",
            model=spec.name,
            version=version,
            model_file=file,
            provider=session.provider,
            max_batch_size=spec.max_batch_size,
            dynamic_batching=spec.dynamic_batching,
            max_queue_delay_us=spec.max_queue_delay_us,
            instances=spec.instance_count,
            text_task=text.task if text else None,
        )
        return LoadedModel(spec, completed, session, stats, backend)

    def _load_llm(
        self,
        model_dir: Path,
        version: str,
        config: mc.ModelConfig,
        session: OnnxSession,
        file: str,
    ) -> LoadedModel:
        if not is_step_graph(session):
            raise cfg.ConfigError(
                f"model {config.name!r}: {cfg.ENGINE} is 'llm' but {session.path} is not an "
                "engine step graph (no seqlens_k input); build it with `python -m quantize "
                "build-repository`"
            )
        completed = cfg.complete_llm(config, self.default_max_queue_size)
        completed.parameters[cfg.EXECUTION_PROVIDER].string_value = session.provider
        completed.parameters[cfg.MODEL_FILE].string_value = file
        spec = cfg.spec(completed, version)
        path = draft_path(spec, model_dir)
        draft = None
        if path is not None:  # on the target's provider, not spinning (see _load_version)
            options = dataclasses.replace(self.options, allow_spinning=False)
            draft = StepModel(OnnxSession(path, options, [session.provider]))
        model = StepModel(session)
        llm, stats = serve_llm(
            spec, model, model_dir, draft, provider=session.provider, model_file=file
        )
        return LoadedModel(spec, completed, session, stats, LLMBackend(spec, llm))

    def get(self, name: str, version: str = "") -> LoadedModel:
        versions = self.models.get(name)
        if versions is None:
            raise NotFound(f"unknown model {name!r}; this worker serves {sorted(self.models)}")
        if not version:
            return versions[max(versions, key=int)]
        model = versions.get(version)
        if model is None:
            raise NotFound(
                f"model {name!r} has no version {version!r}; loaded versions: "
                f"{sorted(versions, key=int)}"
            )
        return model

    def all(self) -> list[LoadedModel]:
        return [m for versions in self.models.values() for m in versions.values()]

    @property
    def providers(self) -> set[str]:
        return {m.session.provider for m in self.all()}

    async def close(self) -> None:
        for model in self.all():
            await model.close()


def _spinning(config: mc.ModelConfig) -> bool:
    """An LLM's `meshserve.intra_op_spinning` parameter (default false)."""
    return _flag(config, model_keys.INTRA_OP_SPINNING, default=False)


def _flag(config: mc.ModelConfig, key: str, default: bool) -> bool:
    """A model's "true" / "false" parameter `key` (`default` when unset)."""
    value = config.parameters[key].string_value if key in config.parameters else None
    return cfg.bool_parameter(config.name, key, value, default=default)
