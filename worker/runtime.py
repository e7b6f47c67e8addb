"""onnxruntime sessions: CUDA first, CPU fallback reported loudly, warm-up before ready."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import structlog
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from common import custom_ops, dtypes
from common.errors import Internal, InvalidArgument, MeshError, ResourceExhausted
from worker.config import GraphTensor, ModelSpec

if TYPE_CHECKING:
    from onnx import NodeProto

log = structlog.get_logger()

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class GpuRequired(Exception):
    """require_gpu is set and onnxruntime fell back to the CPU."""


@dataclass(frozen=True)
class RuntimeOptions:
    providers: str = "auto"  # auto | cuda | cpu
    require_gpu: bool = False
    intra_op_threads: int = 0  # 0: onnxruntime's default (one per core)
    inter_op_threads: int = 1
    # Idle intra-op threads spin for a while by default. A shard group runs dozens of small
    # sessions one after another, whose spinning pools starve each other: off there.
    allow_spinning: bool = True
    # On CUDA, let runs replay CUDA graphs (onnxruntime's enable_cuda_graph; a run chooses
    # its graph by gpu_graph_id): the LLM step graph's decode steps (worker/llm/model.py).
    cuda_graph: bool = False
    # onnxruntime's profiler on, its trace files named with this prefix (benchmarks.llm_profile)
    profile_prefix: str | None = None


def requested_providers(choice: str) -> list[str]:
    available = ort.get_available_providers()
    if choice == "cpu":
        return [CPU]
    if choice == "cuda" or (choice == "auto" and CUDA in available):
        return [CUDA, CPU]
    return [CPU]


class ModelLoadError(Exception):
    """onnxruntime could not load a model file."""


class OnnxSession:
    """One onnxruntime InferenceSession and what it reports about itself."""

    def __init__(self, path: Path, options: RuntimeOptions, requested: list[str]) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if custom_ops.available():  # a graph may hold meshserve's MatMulQ (quantize/int4.py)
            custom_ops.register(so)
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if options.profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = options.profile_prefix
        self.path = path
        # whether runs may replay CUDA graphs; every run then names its graph (gpu_graph_id)
        self.cuda_graph = options.cuda_graph and CUDA in requested
        if self.cuda_graph:
            try:
                graphs = [(CUDA, {"enable_cuda_graph": "1"}), *requested[1:]]
                self.session = ort.InferenceSession(str(path), so, providers=graphs)
            except Exception as e:  # a node outside the CUDA provider: none to capture
                log.warning("cuda_graph_off", model=str(path), reason=str(e)[:300])
                self.cuda_graph = False
        if not self.cuda_graph:
            try:
                self.session = ort.InferenceSession(str(path), sess_options=so, providers=requested)
            except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
                hint = (
                    " (it uses meshserve's custom ops, whose library is not built: `make ops`)"
                    if custom_ops.DOMAIN in str(e) and not custom_ops.available()
                    else ""
                )
                raise ModelLoadError(f"{path}: onnxruntime cannot load it: {e}{hint}") from e
        # onnxruntime drops a provider it cannot load (no CUDA libraries, no device) without
        # raising: what it actually runs on is what get_providers() says afterwards.
        self.provider = self.session.get_providers()[0]
        self.cuda_graph = self.cuda_graph and self.provider == CUDA
        if CUDA in requested and self.provider != CUDA:
            log.warning(
                "cuda_fallback_to_cpu",
                model=str(path),
                requested=requested,
                active=self.session.get_providers(),
                hint="CUDA libraries or a GPU are missing; this worker computes on the CPU",
            )
            if options.require_gpu:
                raise GpuRequired(
                    f"{path}: require_gpu is set but onnxruntime runs on {self.provider} "
                    f"(asked for {requested}); install onnxruntime-gpu[cuda,cudnn] on a "
                    "machine with a GPU or unset require_gpu"
                )
        elif options.require_gpu and self.provider != CUDA:
            raise GpuRequired(
                f"{path}: require_gpu is set but providers={options.providers!r} "
                f"selects {self.provider}"
            )
        self.inputs = [_graph_tensor(a) for a in self.session.get_inputs()]
        self.outputs = [_graph_tensor(a) for a in self.session.get_outputs()]
        self.model = path.parent.parent.name
        # How v2 BYTES cross into onnxruntime's string tensors (see strings_reader).
        self.text_op: str | None = None
        if any(t.datatype == "BYTES" for t in self.inputs + self.outputs):
            self.text_op = strings_reader(path)

    @functools.cached_property
    def index_bounds(self) -> dict[str, int]:
        """Integer inputs that index a table (token ids into an embedding): their bound. Read
        when first asked: the LLM engine feeds its graph token ids from its own tokenizer
        and never asks, so an LLM worker neither parses its graph nor imports onnx (17 MB)."""
        if any(t.datatype.startswith(("INT", "UINT")) for t in self.inputs):
            return index_bounds(self.path)
        return {}

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        # v2 BYTES arrive as `bytes`; onnxruntime's string tensors take and give `str`.
        feeds = {
            name: self._to_str(name, a) if a.dtype == object else a for name, a in feeds.items()
        }
        try:
            outputs = self.session.run(output_names, feeds)
        except Exception as e:
            raise run_error(self.model, e) from e
        return [self._to_bytes(a) if a.dtype == object else a for a in outputs]

    def _to_str(self, name: str, array: np.ndarray) -> np.ndarray:
        """Bytes -> str. A graph that only moves strings gets each byte as one code point
        (latin-1), so any bytes come back exactly; a graph that reads text gets the UTF-8
        text, and bytes that are not UTF-8 are the client's error."""
        flat = array.reshape(-1).tolist()
        out = np.empty(array.shape, dtype=object)
        if self.text_op is None:
            out.reshape(-1)[:] = [x.decode("latin-1") if type(x) is bytes else x for x in flat]
            return out
        try:
            out.reshape(-1)[:] = [x.decode("utf-8") if type(x) is bytes else x for x in flat]
        except UnicodeDecodeError:
            index = next(i for i, x in enumerate(flat) if not _is_utf8(x))
            raise InvalidArgument(
                f"input {name!r}: BYTES element {index} is not valid UTF-8, and model "
                f"{self.model!r} reads its strings as text (its graph runs {self.text_op} on "
                "them); send UTF-8 text"
            ) from None
        return out

    def _to_bytes(self, array: np.ndarray) -> np.ndarray:
        encoding = "latin-1" if self.text_op is None else "utf-8"
        out = np.empty(array.shape, dtype=object)
        out.reshape(-1)[:] = [
            x.encode(encoding) if type(x) is str else x for x in array.reshape(-1).tolist()
        ]
        return out

    def warm_up(self, spec: ModelSpec) -> None:
        """One run on zeros of the smallest shape, so the first client call is not slow."""
        batch = (1,) if spec.max_batch_size > 0 else ()
        feeds = {}
        for t in spec.inputs.values():
            shape = batch + tuple(1 if d < 0 else d for d in t.dims)
            if t.datatype == "BYTES":
                feeds[t.name] = np.full(shape, "", dtype=object)
            else:
                feeds[t.name] = np.zeros(shape, dtype=dtypes.NUMPY[t.datatype])
        self.run(list(spec.outputs), feeds)


# Allocation failures, as onnxruntime's CPU arena, CUDA, cuDNN and cuBLAS word them.
_ALLOCATION = (
    "failed to allocate memory",
    "bad allocation",
    "bad_alloc",
    "out of memory",
    "alloc_failed",
    "cudaerrormemoryallocation",
)
# What onnxruntime raises for a run that this input made impossible: shapes that do not fit
# the graph, indices out of range, sizes that overflow. Kernel failures come as Fail or
# RuntimeException, input checks as InvalidArgument.
_INPUT_ERRORS = (ort_errors.InvalidArgument, ort_errors.Fail, ort_errors.RuntimeException)


def run_error(model: str, e: Exception) -> MeshError:
    """A failed session run as the status the client should get:
    RESOURCE_EXHAUSTED for an allocation failure (another replica, or later, may have the
    memory: the router retries it), INVALID_ARGUMENT with onnxruntime's words for what the
    input made impossible, INTERNAL for the rest (the provider failed, or a bug of ours)."""
    if isinstance(e, MeshError):
        return e
    message = str(e)
    if isinstance(e, MemoryError) or any(a in message.lower() for a in _ALLOCATION):
        log.warning("run_out_of_memory", model=model, error=message[:500])
        return ResourceExhausted(
            f"model {model!r} ran out of memory on this request ({_brief(message)}); "
            "retry later or send a smaller batch"
        )
    if isinstance(e, _INPUT_ERRORS):
        return InvalidArgument(f"model {model!r} cannot run on this input: {_brief(message)}")
    log.error("run_failed", model=model, error_type=type(e).__name__, error=message[:2000])
    return Internal(f"model {model!r} failed: {type(e).__name__}: {_brief(message)}")


def _brief(message: str, limit: int = 600) -> str:
    """onnxruntime's message without its source paths and C++ signatures, cut to `limit`."""
    message = message.replace("[ONNXRuntimeError] : ", "")
    if "Status Message: " in message:
        head, _, status = message.partition("Status Message: ")
        # "/onnxruntime_src/.../bfc_arena.cc:359 void* ...::AllocateRawInternal(...) Failed to"
        status = status.rsplit(") ", 1)[-1] if status.startswith("/") else status
        message = head + status
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _graph_tensor(arg: ort.NodeArg) -> GraphTensor:
    if arg.type not in dtypes.FROM_ONNX:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which v2 cannot carry")
    dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return GraphTensor(arg.name, dtypes.FROM_ONNX[arg.type], dims)


def _is_utf8(item: object) -> bool:
    if not isinstance(item, bytes):
        return True
    try:
        item.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# Operators that move, select or reshape tensor elements without reading them: a graph whose
# strings meet only these treats them as opaque values.
OPAQUE_OPS = frozenset(
    {
        "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice",
        "Gather", "GatherElements", "GatherND", "Transpose", "Expand", "Tile", "Shape", "Size",
        "Compress", "Where",
    }
)  # fmt: skip


_PASS_THROUGH = ("Identity", "Cast", "DequantizeLinear")
# gathers over a table: op -> the attribute naming the gathered axis (GatherBlockQuantized,
# an embedding in 8-bit blocks, keeps its codes unpacked along that axis: one row per id)
GATHERS = {"Gather": "axis", "GatherBlockQuantized": "gather_axis"}


def index_bounds(path: Path) -> dict[str, int]:
    """Graph inputs used as the indices of a Gather over a constant table (an embedding,
    perhaps quantized): input name -> rows of the table. onnxruntime reads a negative index
    from the end and fails on one past the end, so a token id outside 0..rows-1 is either
    silently wrong or an error deep in the graph; the codec rejects it up front."""
    import onnx  # here, not at the top: see OnnxSession.index_bounds

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # unreadable here: nothing known, onnxruntime still checks
        return {}
    tables = {t.name: list(t.dims) for t in graph.initializer}
    produced = {o: n for n in graph.node for o in n.output}
    for name in list(produced):  # Constant nodes and table -> Dequantize/Cast chains
        node = produced[name]
        if node.op_type == "Constant" and node.attribute and node.attribute[0].t.dims:
            tables[name] = list(node.attribute[0].t.dims)
    inputs = {i.name for i in graph.input} - set(tables)
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type not in GATHERS or len(node.input) < 2:
            continue
        indices = node.input[1]
        source = produced.get(indices)
        if source is not None and source.op_type in ("Identity", "Cast"):
            indices = source.input[0]
        dims = _table(node.input[0], tables, produced)
        if indices not in inputs or not dims:
            continue
        key = GATHERS[node.op_type]
        axis = next((a.i for a in node.attribute if a.name == key), 0) % len(dims)
        bounds[indices] = min(dims[axis], bounds.get(indices, dims[axis]))
    return bounds


def _table(
    name: str, tables: dict[str, list[int]], produced: dict[str, NodeProto], hops: int = 3
) -> list[int] | None:
    """The dims of the constant table `name` comes from, through up to `hops` pass-through
    nodes. A function of its own, not a closure in index_bounds: a recursive closure is a
    reference cycle, which kept the loaded graph (the whole model file, 267 MB for SmolLM2)
    alive until the collector's next full pass."""
    for _ in range(hops + 1):
        if name in tables:
            return tables[name]
        node = produced.get(name)
        if node is None or node.op_type not in _PASS_THROUGH:
            return None
        name = node.input[0]
    return None


def strings_reader(path: Path) -> str | None:
    """None when every node that takes a string tensor in the graph only moves it (so BYTES
    may carry any bytes); otherwise the first operator that reads strings as text (or a
    reason it could not be told, e.g. a string constant, whose UTF-8 bytes must stay so)."""
    import onnx  # here, not at the top: see OnnxSession.index_bounds

    try:
        model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    except Exception as e:  # unreadable by onnx's checker: assume text, the strict choice
        return f"(graph not analysable: {type(e).__name__})"
    graph = model.graph
    strings = {
        v.name
        for v in [*graph.input, *graph.output, *graph.value_info]
        if v.type.tensor_type.elem_type == onnx.TensorProto.STRING
    }
    if any(t.data_type == onnx.TensorProto.STRING for t in graph.initializer):
        return "a string initializer"
    for node in graph.node:
        subgraph = any(a.g.node or a.graphs for a in node.attribute)  # If, Loop, Scan
        reads = node.op_type not in OPAQUE_OPS and any(i in strings for i in node.input)
        if (
            subgraph
            or reads
            or any(o in strings for o in node.output if node.op_type == "Constant")
        ):
            return node.op_type
    return None
