"""KServe v2 tensors <-> numpy arrays, with every check a request must pass.

The only worker module besides the servicer that touches the protobuf messages. Every
rejection names the tensor, what came and what the model expects.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

import numpy as np
from google.protobuf.message import DecodeError

from common import dtypes, llm_protocol
from common.bytes_codec import deserialize_bytes, serialize_bytes
from common.errors import InvalidArgument
from common.rpc import MAX_MESSAGE_BYTES
from protos import grpc_service_pb2 as pb
from worker.config import (
    LLM_OUTPUT,
    TEXT_INPUT,
    TOKENIZER,
    VOCAB_SIZE,
    ModelSpec,
    TensorSpec,
    vocab_sizes,
)

# Past this many BYTES elements (or raw bytes) in one request, decoding and encoding run on a
# thread rather than on the event loop, so health checks and other calls keep being answered.
HEAVY_ELEMENTS = 50_000
HEAVY_RAW_BYTES = 4 << 20


@dataclass(frozen=True)
class Limits:
    """What one request tensor may hold. Every element of every datatype takes at least one
    byte of the request, so no tensor can honestly have more elements than the message has
    bytes; BYTES elements each become a Python object, and are bounded on their own."""

    max_elements: int = MAX_MESSAGE_BYTES
    max_bytes_elements: int = 1 << 18


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Unparsable:
    """What the ModelInfer deserializer returns for bytes that are not a ModelInferRequest:
    the servicer answers INVALID_ARGUMENT (a raising deserializer would make gRPC answer
    UNKNOWN). `id` and `model_name` let a stream reply name it like any other request."""

    error: str
    id: str = ""
    model_name: str = ""


def parse_request(data: bytes) -> pb.ModelInferRequest | Unparsable:
    """The gRPC request deserializer for ModelInfer and ModelStreamInfer; never raises."""
    try:
        return pb.ModelInferRequest.FromString(data)
    except (DecodeError, ValueError, RecursionError) as e:
        return Unparsable(f"{type(e).__name__}: {e}")


def is_heavy(request: pb.ModelInferRequest) -> bool:
    """Whether decoding this request is worth a thread hop (see HEAVY_ELEMENTS)."""
    if sum(len(r) for r in request.raw_input_contents) > HEAVY_RAW_BYTES:
        return True
    return any(len(t.contents.bytes_contents) > HEAVY_ELEMENTS for t in request.inputs)


def decode_request(
    request: pb.ModelInferRequest, spec: ModelSpec, limits: Limits = DEFAULT_LIMITS
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Validated input arrays and the names of the outputs to return."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; "
            "give every input raw content, or none and use typed contents"
        )
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        expected = spec.inputs.get(tensor.name)
        if expected is None:
            raise InvalidArgument(
                f"input {tensor.name!r} is not an input of model {spec.name!r}, "
                f"which takes {sorted(spec.inputs)}"
            )
        if tensor.name in arrays:
            raise InvalidArgument(f"input {tensor.name!r} appears twice in the request")
        if (
            tensor.name == llm_protocol.INPUT_IDS
            and tensor.datatype in llm_protocol.INPUT_IDS_TYPES
        ):
            expected = replace(expected, datatype=tensor.datatype)  # INT32 or INT64
        arrays[tensor.name] = _decode_tensor(
            tensor, raw[i] if raw else None, expected, spec, limits
        )
    missing = [n for n, t in spec.inputs.items() if n not in arrays and not t.optional]
    if TEXT_INPUT in missing and TOKENIZER in spec.parameters and arrays:
        missing.remove(TEXT_INPUT)  # token inputs instead of TEXT: worker/text.py checks them
    if llm_protocol.TEXT_INPUT in missing and llm_protocol.INPUT_IDS in arrays:
        missing.remove(llm_protocol.TEXT_INPUT)  # a token-id prompt (worker/llm/serving.py)
    if llm_protocol.TEXT_INPUT in missing and llm_protocol.MESSAGES in arrays:
        missing.remove(llm_protocol.TEXT_INPUT)  # a chat: the model's template makes the prompt
    if missing:
        want = ", ".join(f"{n} ({spec.inputs[n].datatype} {_dims(spec, n)})" for n in missing)
        raise InvalidArgument(
            f"model {spec.name!r} needs input(s) {want}; the request does not have them"
        )
    # Token inputs beside TEXT are not read (worker/text.py): a generic client fills them too.
    text_served = TEXT_INPUT in arrays and TOKENIZER in spec.parameters
    for name, size in vocab_sizes(spec).items():
        if name in arrays and not text_served:
            _check_ids(name, arrays[name], size, spec)
    if spec.max_batch_size > 0:
        sizes = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(sizes.values())) > 1:
            raise InvalidArgument(f"inputs disagree on the batch size (first dim): {sizes}")
    outputs = [o.name for o in request.outputs] or list(spec.outputs)
    for name in outputs:
        if name not in spec.outputs:
            raise InvalidArgument(
                f"requested output {name!r} is not an output of model {spec.name!r}, "
                f"which has {sorted(spec.outputs)}"
            )
    return arrays, outputs


def _check_ids(name: str, ids: np.ndarray, size: int, spec: ModelSpec) -> None:
    """Token ids index the model's embedding: 0..size-1 (onnxruntime would read a negative
    id from the end of the table, and fail on one past it deep inside the graph)."""
    if ids.size == 0 or ids.dtype.kind not in "iu":
        return
    bad = (ids < 0) | (ids >= size)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgument(
            f"input {name!r}: token id {ids[at]} at {list(at)} is outside the vocabulary "
            f"0..{size - 1} of model {spec.name!r} ({VOCAB_SIZE}{name})"
        )


def _dims(spec: ModelSpec, name: str) -> list[int]:
    dims = list(spec.inputs[name].dims)
    return [-1, *dims] if spec.max_batch_size > 0 else dims


def _decode_tensor(
    tensor: pb.ModelInferRequest.InferInputTensor,
    raw: bytes | None,
    expected: TensorSpec,
    spec: ModelSpec,
    limits: Limits,
) -> np.ndarray:
    name = tensor.name
    if tensor.datatype != expected.datatype:
        raise InvalidArgument(
            f"input {name!r}: datatype {tensor.datatype or '(empty)'}, "
            f"model {spec.name!r} expects {expected.datatype}"
        )
    shape = tuple(tensor.shape)
    _check_shape(name, shape, expected, spec)
    count = _element_count(name, shape, expected.datatype, limits)
    dtype = dtypes.NUMPY[expected.datatype]
    if raw is not None:
        if expected.datatype == "BYTES":
            return deserialize_bytes(raw, count, name).reshape(shape)
        needed = count * dtype.itemsize
        if len(raw) != needed:
            raise InvalidArgument(
                f"input {name!r}: raw content is {len(raw)} bytes, shape {list(shape)} of "
                f"{expected.datatype} needs {needed}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    field = dtypes.CONTENTS_FIELD.get(expected.datatype)
    if field is None:
        raise InvalidArgument(
            f"input {name!r}: {expected.datatype} has no typed contents field; "
            "send it in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input {name!r}: contents.{field} has {len(values)} values, "
            f"shape {list(shape)} needs {count}"
        )
    if expected.datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    if dtype.kind in "iu":  # the typed fields are 32/64-bit: a value may not fit the dtype
        wide = np.asarray(values, dtype=np.uint64 if dtype.kind == "u" else np.int64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidArgument(
                f"input {name!r}: contents.{field} has values in {wide.min()}..{wide.max()}, "
                f"outside {expected.datatype}'s {info.min}..{info.max}"
            )
        return wide.astype(dtype).reshape(shape)
    return np.asarray(values, dtype=dtype).reshape(shape)


def _element_count(name: str, shape: tuple[int, ...], datatype: str, limits: Limits) -> int:
    """Exact (Python int, no int64 wrap-around), checked against the limits."""
    count = math.prod(shape)
    if count > limits.max_elements:
        raise InvalidArgument(
            f"input {name!r}: shape {list(shape)} has {count} elements, more than the "
            f"{limits.max_elements} one request can carry"
        )
    if datatype == "BYTES" and count > limits.max_bytes_elements:
        raise InvalidArgument(
            f"input {name!r}: BYTES shape {list(shape)} has {count} elements; this worker "
            f"takes at most {limits.max_bytes_elements} BYTES elements per tensor "
            "(--max-bytes-elements)"
        )
    return count


def _check_shape(name: str, shape: tuple[int, ...], expected: TensorSpec, spec: ModelSpec) -> None:
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"input {name!r}: shape {list(shape)} has a negative dimension")
    dims = expected.dims
    if spec.max_batch_size > 0:
        if len(shape) != len(dims) + 1 or any(
            d != -1 and d != s for d, s in zip(dims, shape[1:], strict=False)
        ):
            raise InvalidArgument(
                f"input {name!r}: shape {list(shape)} does not fit model {spec.name!r}'s "
                f"{[-1, *dims]} (batch dimension first)"
            )
        if not 1 <= shape[0] <= spec.max_batch_size:
            raise InvalidArgument(
                f"input {name!r}: batch size {shape[0]} is outside 1..{spec.max_batch_size} "
                f"(max_batch_size of model {spec.name!r})"
            )
    elif len(shape) != len(dims) or any(
        d != -1 and d != s for d, s in zip(dims, shape, strict=False)
    ):
        raise InvalidArgument(
            f"input {name!r}: shape {list(shape)} does not fit model {spec.name!r}'s {list(dims)}"
        )


def encode_response(
    request: pb.ModelInferRequest, spec: ModelSpec, results: dict[str, np.ndarray]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=spec.name, model_version=spec.version, id=request.id
    )
    for name, array in results.items():
        datatype = spec.outputs[name].datatype
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if datatype == "BYTES":
            response.raw_output_contents.append(serialize_bytes(array))
        else:
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response


def request_parameters(request: pb.ModelInferRequest) -> dict[str, object]:
    """The request's `parameters` map as plain values."""
    values: dict[str, object] = {}
    for key, p in request.parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if kind is not None:
            values[key] = getattr(p, kind)
    return values


def encode_text_piece(
    request: pb.ModelInferRequest,
    spec: ModelSpec,
    text: str | list[str] | None,
    final: bool,
    usage: tuple[int, int, str] | tuple[int, int, str, int] | None = None,
    extra: dict[str, int | str] | None = None,
    finished: bool | None = None,
) -> pb.ModelInferResponse:
    """One response of a decoupled text model: `text_output` (none for an empty final
    response; a list: one string per choice of a unary n > 1 answer), the
    `triton_final_response` flag, and the usage so far: prompt_tokens and the running
    completion_tokens (the tokens generated up to this piece, over every choice: what a
    stream cut after it has sent, the router bills that), cached_tokens (the prompt tokens
    the prefix cache served, when the usage has a fourth count), plus finish_reason on a
    choice's last piece (`finished`; default: the final one). `extra`: further parameters
    (common/llm_protocol.py's INDEX, RESPONSE_LOGPROBS)."""
    response = pb.ModelInferResponse(
        model_name=spec.name, model_version=spec.version, id=request.id
    )
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        data = b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in texts))
        response.outputs.add(name=LLM_OUTPUT, datatype="BYTES", shape=[len(texts)])
        response.raw_output_contents.append(data)
    response.parameters[llm_protocol.FINAL_RESPONSE].bool_param = final
    if usage is not None:
        prompt_tokens, completion_tokens, finish_reason = usage[:3]
        response.parameters[llm_protocol.PROMPT_TOKENS].int64_param = prompt_tokens
        response.parameters[llm_protocol.COMPLETION_TOKENS].int64_param = completion_tokens
        if len(usage) == 4:
            response.parameters[llm_protocol.CACHED_TOKENS].int64_param = usage[3]
        if final if finished is None else finished:
            response.parameters[llm_protocol.FINISH_REASON].string_param = finish_reason
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            response.parameters[key].string_param = value
        else:
            response.parameters[key].int64_param = value
    return response
