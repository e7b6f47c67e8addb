"""Model configuration: read config.pbtxt, complete it from the ONNX graph, check it.

The ModelConfig protobuf is the repository's file format, so it is parsed here; everything
past this module works on the small `ModelSpec` dataclass instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from common import dtypes, llm_protocol, model_keys
from common.model_config import config_text as config_text
from common.tenancy import PRICE_PER_1K_INPUT as PRICE_PER_1K_INPUT
from common.tenancy import PRICE_PER_1K_OUTPUT as PRICE_PER_1K_OUTPUT
from common.tenancy import PRICE_PER_CALL as PRICE_PER_CALL
from common.tenancy import TRAINING_COST as TRAINING_COST
from protos import model_config_pb2 as mc

# meshserve's own keys in ModelConfig.parameters (Triton ignores unknown parameters); the
# prices and training cost are in common.tenancy, which hides them from clients.
EXECUTION_PROVIDER = model_keys.EXECUTION_PROVIDER
CPU_MODEL_FILENAMES = model_keys.CPU_MODEL_FILENAMES
MODEL_FILE = model_keys.MODEL_FILE
DEFAULT_MODEL_FILENAME = "model.onnx"  # Triton's, for the onnxruntime backend
# Adds this many microseconds of waiting to every execution while holding the model
# instance, as an accelerator-bound model would. For benchmarks and balancing tests on a
# machine whose few cores cannot also host real compute for several replicas.
SIMULATED_COMPUTE_US = model_keys.SIMULATED_COMPUTE_US
# "true": a batch waits out max_queue_delay_microseconds for more requests even when nothing
# else of the model runs (Triton's rule, and meshserve's before it ran idle requests at once;
# see worker/batcher.py). "false", the default: the delay applies only while a batch runs.
DELAY_WHEN_IDLE = model_keys.DELAY_WHEN_IDLE
# Text serving (worker/text.py): a tokenizer.json in the model folder and what to do with
# the tokens. The worker then adds a BYTES input TEXT; the graph's token inputs become its
# optional alternative.
TOKENIZER = model_keys.TOKENIZER
TEXT_TASK = model_keys.TEXT_TASK  # embed (generation is the LLM engine's: ENGINE below)
TEXT_TASKS = ("embed",)
# meshserve.vocab_size.<input>: an integer input's values must be in 0..N-1 (token ids into
# an embedding). Found in the graph where an input indexes a constant table; may be set.
VOCAB_SIZE = model_keys.VOCAB_SIZE
TEXT_INPUT = llm_protocol.TEXT
# An LLM served by the generation engine (worker/llm/): the model folder holds the engine's
# step graph and a tokenizer; clients speak Triton's vLLM-backend tensors (decoupled).
ENGINE = model_keys.ENGINE
LLM_ENGINE = "llm"
LLM_INPUTS = (
    (llm_protocol.TEXT_INPUT, mc.TYPE_STRING, False),
    (llm_protocol.STREAM, mc.TYPE_BOOL, True),
    (llm_protocol.SAMPLING_PARAMETERS, mc.TYPE_STRING, True),
    (llm_protocol.EXCLUDE_INPUT_IN_OUTPUT, mc.TYPE_BOOL, True),
    (llm_protocol.MESSAGES, mc.TYPE_STRING, True),
    (llm_protocol.INPUT_IDS, mc.TYPE_INT64, True),  # INT32 accepted too (worker/codec.py)
    (llm_protocol.TOOLS, mc.TYPE_STRING, True),
)
LLM_OUTPUT = llm_protocol.TEXT_OUTPUT


class ConfigError(Exception):
    """A model whose config cannot be served; the message names the model and the field."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # v2 name: FP32, INT64, BYTES, ...
    dims: tuple[int, ...]  # without the batch dimension when the model batches; -1 = any
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    max_batch_size: int  # 0: the model takes no batch dimension
    dynamic_batching: bool
    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int
    instance_count: int
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphTensor:
    """A graph input or output as onnxruntime reports it (dims: int, or None when dynamic)."""

    name: str
    datatype: str
    dims: tuple[int | None, ...]


def read(model_dir: Path) -> mc.ModelConfig:
    """The model's config.pbtxt, or an empty config named after the folder."""
    path = model_dir / "config.pbtxt"
    config = mc.ModelConfig()
    if path.exists():
        try:
            text_format.Parse(path.read_text(), config)
        except text_format.ParseError as e:
            raise ConfigError(f"{path}: not a valid ModelConfig text proto: {e}") from e
    if config.name and config.name != model_dir.name:
        raise ConfigError(
            f"{path}: name {config.name!r} does not match its folder {model_dir.name!r}"
        )
    config.name = model_dir.name
    return config


def complete(
    config: mc.ModelConfig,
    inputs: list[GraphTensor],
    outputs: list[GraphTensor],
    default_max_batch_size: int,
    default_max_queue_size: int,
) -> mc.ModelConfig:
    """Fill what config.pbtxt left out from the ONNX graph, and check what it did say."""
    config = mc.ModelConfig.FromString(config.SerializeToString())
    config.platform = config.platform or "onnxruntime_onnx"
    config.backend = config.backend or "onnxruntime"
    graph = [*inputs, *outputs]
    batchable = all(t.dims and t.dims[0] is None for t in graph)
    if not config.input and not config.output and config.max_batch_size == 0 and batchable:
        config.max_batch_size = default_max_batch_size
    if config.max_batch_size > 0 and not batchable:
        bad = [t.name for t in graph if not t.dims or t.dims[0] is not None]
        raise ConfigError(
            f"model {config.name!r}: max_batch_size is {config.max_batch_size} but tensors "
            f"{bad} have no dynamic first dimension to batch along"
        )
    _complete_tensors(config, config.input, inputs, "input")
    _complete_tensors(config, config.output, outputs, "output")
    if config.max_batch_size > 0 and config.WhichOneof("scheduling_choice") is None:
        config.dynamic_batching.SetInParent()
    if config.HasField("dynamic_batching"):
        policy = config.dynamic_batching.default_queue_policy
        if policy.max_queue_size == 0:
            policy.max_queue_size = default_max_queue_size
    if not config.instance_group:
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    _check_parameters(config)
    return config


def _complete_tensors(config, declared, graph: list[GraphTensor], kind: str) -> None:  # type: ignore[no-untyped-def]
    by_name = {t.name: t for t in graph}
    skip = 1 if config.max_batch_size > 0 else 0
    for tensor in declared:
        actual = by_name.get(tensor.name)
        if actual is None:
            raise ConfigError(
                f"model {config.name!r}: config {kind} {tensor.name!r} is not in the ONNX graph, "
                f"which has {kind}s {sorted(by_name)}"
            )
        datatype = dtypes.from_config(mc.DataType.Name(tensor.data_type))
        if datatype != actual.datatype:
            raise ConfigError(
                f"model {config.name!r}: config {kind} {tensor.name!r} is {datatype}, "
                f"the ONNX graph has {actual.datatype}"
            )
        graph_dims = actual.dims[skip:]
        if len(tensor.dims) != len(graph_dims) or any(
            g is not None and d not in (-1, g)
            for d, g in zip(tensor.dims, graph_dims, strict=False)
        ):
            raise ConfigError(
                f"model {config.name!r}: config {kind} {tensor.name!r} has dims "
                f"{list(tensor.dims)}, the ONNX graph has {_show(graph_dims)}"
                + (" after the batch dimension" if skip else "")
            )
    if not declared:
        for t in graph:
            declared.add(
                name=t.name,
                data_type=mc.DataType.Value(dtypes.to_config(t.datatype)),
                dims=[-1 if d is None else d for d in t.dims[skip:]],
            )


def _show(dims: tuple[int | None, ...]) -> list[int]:
    return [-1 if d is None else d for d in dims]


def _check_parameters(config: mc.ModelConfig) -> None:
    vocab = [k for k in config.parameters if k.startswith(VOCAB_SIZE)]
    for key in (
        PRICE_PER_CALL,
        PRICE_PER_1K_INPUT,
        PRICE_PER_1K_OUTPUT,
        model_keys.PRICE_PER_1K_CACHED_INPUT,
        TRAINING_COST,
        SIMULATED_COMPUTE_US,
        *vocab,
    ):
        if key in config.parameters:
            raw = config.parameters[key].string_value
            if not raw.isdigit():
                raise ConfigError(
                    f"model {config.name!r}: parameter {key} must be a non-negative integer, "
                    f"got {raw!r}"
                )
    cpu_filenames(config)
    if DELAY_WHEN_IDLE in config.parameters:
        raw = config.parameters[DELAY_WHEN_IDLE].string_value
        if raw not in ("true", "false"):
            raise ConfigError(
                f"model {config.name!r}: parameter {DELAY_WHEN_IDLE} must be true or false, "
                f"got {raw!r}"
            )


def default_filename(config: mc.ModelConfig) -> str:
    """The file a version folder must hold: Triton's default_model_filename, or model.onnx."""
    return config.default_model_filename or DEFAULT_MODEL_FILENAME


def cpu_filenames(config: mc.ModelConfig) -> list[tuple[str, str]]:
    """The model's `meshserve.cpu_model_filenames` as (flag, file) pairs, in order."""
    if CPU_MODEL_FILENAMES not in config.parameters:  # (reading a map key would add it)
        return []
    raw = config.parameters[CPU_MODEL_FILENAMES].string_value
    pairs = []
    for entry in raw.split():
        flag, sep, file = entry.partition(":")
        parts = Path(file).parts
        if not sep or not flag or not file or Path(file).is_absolute() or ".." in parts:
            raise ConfigError(
                f"model {config.name!r}: parameter {CPU_MODEL_FILENAMES} entry {entry!r} must "
                "be FLAG:FILE with FILE relative to the version folder (e.g. "
                "'avx512_vnni:model.onnx *:int4/model.onnx')"
            )
        pairs.append((flag, file))
    if not pairs:
        raise ConfigError(f"model {config.name!r}: parameter {CPU_MODEL_FILENAMES} is empty")
    return pairs


def model_filename(config: mc.ModelConfig, cpu_flags: AbstractSet[str]) -> str:
    """The file to serve on a CPU with `cpu_flags`: the first `meshserve.cpu_model_filenames`
    entry whose flag it has ("*": any), else the default file."""
    for flag, file in cpu_filenames(config):
        if flag == "*" or flag in cpu_flags:
            return file
    return default_filename(config)


def bool_parameter(model: str, key: str, value: str | None, default: bool) -> bool:
    """A model's "true" / "false" parameter (any case); `value` None: unset, the default."""
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise ConfigError(f"model {model!r}: parameter {key} must be true or false, got {value!r}")
    return value.lower() == "true"


def add_index_bounds(config: mc.ModelConfig, bounds: Mapping[str, int]) -> None:
    """Record the vocabulary sizes found in the graph, unless the config set them."""
    for name, size in bounds.items():
        key = VOCAB_SIZE + name
        if key not in config.parameters:
            config.parameters[key].string_value = str(size)


def vocab_sizes(spec: ModelSpec) -> dict[str, int]:
    return {
        k.removeprefix(VOCAB_SIZE): int(v)
        for k, v in spec.parameters.items()
        if k.startswith(VOCAB_SIZE)
    }


def add_text_tensors(config: mc.ModelConfig) -> None:
    """For a config naming a tokenizer: the TEXT input, required; the token inputs stay,
    marked optional (the alternative to TEXT).
    Call after `complete`, which checks tensors against the graph."""
    params = config.parameters
    if TOKENIZER not in params and TEXT_TASK not in params:
        return
    task = params[TEXT_TASK].string_value if TEXT_TASK in params else ""
    if task == "generate":
        raise ConfigError(
            f"model {config.name!r}: text_task 'generate' is served by the LLM engine now: "
            f"set {ENGINE}: {LLM_ENGINE!r} and build the model with `python -m quantize "
            "build-llm` (its step graph, a decoupled config)"
        )
    if TOKENIZER not in params or task not in TEXT_TASKS:
        raise ConfigError(
            f"model {config.name!r}: text serving needs both {TOKENIZER} (a tokenizer.json in "
            f"the model folder) and {TEXT_TASK} in {list(TEXT_TASKS)}; got "
            f"tokenizer={params[TOKENIZER].string_value if TOKENIZER in params else None!r}, "
            f"task={task!r}"
        )
    # TEXT is the input a request needs; the token inputs are the alternative, marked
    # optional as Triton does (perf_analyzer and generic clients then send TEXT alone).
    dims = [1] if config.max_batch_size > 0 else [-1, 1]
    for tensor in config.input:
        tensor.optional = True
    config.input.add(name=TEXT_INPUT, data_type=mc.TYPE_STRING, dims=dims)


def is_llm(config: mc.ModelConfig) -> bool:
    return ENGINE in config.parameters and config.parameters[ENGINE].string_value == LLM_ENGINE


def complete_llm(config: mc.ModelConfig, default_max_queue_size: int) -> mc.ModelConfig:
    """An LLM's config as Triton's vLLM backend declares it: decoupled, no batch dimension
    (the engine batches sequences itself), the four inputs and text_output."""
    config = mc.ModelConfig.FromString(config.SerializeToString())
    config.platform = config.platform or "onnxruntime_onnx"
    config.backend = config.backend or "onnxruntime"
    if config.max_batch_size != 0:
        raise ConfigError(
            f"model {config.name!r}: an LLM engine model has max_batch_size 0 (the engine "
            f"batches sequences itself), got {config.max_batch_size}"
        )
    config.model_transaction_policy.decoupled = True
    if not config.input:
        for name, data_type, optional in LLM_INPUTS:
            dims = [-1] if name == llm_protocol.INPUT_IDS else [1]
            config.input.add(name=name, data_type=data_type, dims=dims, optional=optional)
    if not config.output:
        config.output.add(name=LLM_OUTPUT, data_type=mc.TYPE_STRING, dims=[-1])
    declared = {t.name: t.data_type for t in config.input}
    expected = {name: data_type for name, data_type, _ in LLM_INPUTS}
    if declared != expected or [t.name for t in config.output] != [LLM_OUTPUT]:
        raise ConfigError(
            f"model {config.name!r}: an LLM engine model takes inputs "
            f"{sorted(expected)} and returns [{LLM_OUTPUT!r}]; the config declares inputs "
            f"{sorted(declared)} and outputs {[t.name for t in config.output]}"
        )
    if not config.instance_group:
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if config.dynamic_batching.default_queue_policy.max_queue_size == 0:
        config.dynamic_batching.default_queue_policy.max_queue_size = default_max_queue_size
    _check_parameters(config)
    return config


def spec(config: mc.ModelConfig, version: str) -> ModelSpec:
    def tensors(declared) -> dict[str, TensorSpec]:  # type: ignore[no-untyped-def]
        return {
            t.name: TensorSpec(
                t.name,
                dtypes.from_config(mc.DataType.Name(t.data_type)),
                tuple(t.dims),
                getattr(t, "optional", False),
            )
            for t in declared
        }

    batching = config.dynamic_batching
    enabled = config.HasField("dynamic_batching") and config.max_batch_size > 0
    return ModelSpec(
        name=config.name,
        version=version,
        inputs=tensors(config.input),
        outputs=tensors(config.output),
        max_batch_size=config.max_batch_size,
        dynamic_batching=enabled,
        max_queue_delay_us=batching.max_queue_delay_microseconds,
        preferred_batch_sizes=tuple(batching.preferred_batch_size),
        max_queue_size=batching.default_queue_policy.max_queue_size,
        instance_count=sum(g.count or 1 for g in config.instance_group) or 1,
        parameters={k: v.string_value for k, v in config.parameters.items()},
    )
