"""KServe v2 tensors <-> numpy arrays, with every check a request must pass.

The only worker module besides the servicer that touches the protobuf messages. Every
rejection names the tensor, what came and what the model expects.
"""

from __future__ import annotations

import struct

import numpy as np

from common import dtypes
from common.errors import InvalidArgument
from protos import grpc_service_pb2 as pb
from worker.config import LLM_OUTPUT, ModelSpec, TensorSpec


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> v2 raw form: each element as a 4-byte little-endian length + bytes."""
    parts = []
    for item in array.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(raw: bytes, count: int, name: str) -> np.ndarray:
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidArgument(
                f"input {name!r}: BYTES raw content ends inside a 4-byte length prefix "
                f"at offset {offset}"
            )
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidArgument(
                f"input {name!r}: BYTES element {len(items)} claims {length} bytes but only "
                f"{len(raw) - offset} remain"
            )
        items.append(raw[offset : offset + length])
        offset += length
    if len(items) != count:
        raise InvalidArgument(
            f"input {name!r}: BYTES raw content holds {len(items)} elements, shape needs {count}"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def decode_request(
    request: pb.ModelInferRequest, spec: ModelSpec
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
        arrays[tensor.name] = _decode_tensor(tensor, raw[i] if raw else None, expected, spec)
    missing = [n for n, t in spec.inputs.items() if n not in arrays and not t.optional]
    if missing:
        want = ", ".join(f"{n} ({spec.inputs[n].datatype} {_dims(spec, n)})" for n in missing)
        raise InvalidArgument(
            f"model {spec.name!r} needs input(s) {want}; the request does not have them"
        )
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


def _dims(spec: ModelSpec, name: str) -> list[int]:
    dims = list(spec.inputs[name].dims)
    return [-1, *dims] if spec.max_batch_size > 0 else dims


def _decode_tensor(
    tensor: pb.ModelInferRequest.InferInputTensor,
    raw: bytes | None,
    expected: TensorSpec,
    spec: ModelSpec,
) -> np.ndarray:
    name = tensor.name
    if tensor.datatype != expected.datatype:
        raise InvalidArgument(
            f"input {name!r}: datatype {tensor.datatype or '(empty)'}, "
            f"model {spec.name!r} expects {expected.datatype}"
        )
    shape = tuple(tensor.shape)
    _check_shape(name, shape, expected, spec)
    count = int(np.prod(shape, dtype=np.int64))
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
    return np.asarray(values, dtype=dtype).reshape(shape)


def _check_shape(name: str, shape: tuple[int, ...], expected: TensorSpec, spec: ModelSpec) -> None:
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
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"input {name!r}: shape {list(shape)} has a negative dimension")


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
    text: str | None,
    final: bool,
    usage: tuple[int, int, str] | None = None,
) -> pb.ModelInferResponse:
    """One response of a decoupled text model: `text_output` (none for an empty final
    response), the `triton_final_response` flag, and on the final one the usage:
    prompt_tokens, completion_tokens and finish_reason."""
    response = pb.ModelInferResponse(
        model_name=spec.name, model_version=spec.version, id=request.id
    )
    if text is not None:
        data = text.encode()
        response.outputs.add(name=LLM_OUTPUT, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    response.parameters["triton_final_response"].bool_param = final
    if usage is not None:
        prompt_tokens, completion_tokens, finish_reason = usage
        response.parameters["prompt_tokens"].int64_param = prompt_tokens
        response.parameters["completion_tokens"].int64_param = completion_tokens
        response.parameters["finish_reason"].string_param = finish_reason
    return response
