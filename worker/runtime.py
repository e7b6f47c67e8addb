"""onnxruntime sessions: CUDA first, CPU fallback reported loudly, warm-up before ready."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import structlog
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from common import dtypes
from common.errors import Internal, InvalidArgument, MeshError, ResourceExhausted
from worker.config import GraphTensor, ModelSpec

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
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.path = path
        try:
            self.session = ort.InferenceSession(str(path), sess_options=so, providers=requested)
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise ModelLoadError(f"{path}: onnxruntime cannot load it: {e}") from e
        # onnxruntime drops a provider it cannot load (no CUDA libraries, no device) without
        # raising: what it actually runs on is what get_providers() says afterwards.
        self.provider = self.session.get_providers()[0]
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

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        # v2 BYTES arrive as `bytes`; onnxruntime's string tensors take `str`.
        feeds = {name: _as_str(a) if a.dtype == object else a for name, a in feeds.items()}
        try:
            return self.session.run(output_names, feeds)  # type: ignore[no-any-return]
        except Exception as e:
            raise run_error(self.path.parent.parent.name, e) from e

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


def _as_str(array: np.ndarray) -> np.ndarray:
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = [
        x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)
    ]
    return out
