"""numpy arrays and text <-> KServe v2 messages, on the client side.

The only client module besides `client.py` that touches the protobuf messages. Inputs travel
as raw bytes (`raw_input_contents`); outputs are read from raw bytes or typed contents,
whichever the server sent (Triton and meshserve send raw, MLServer typed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from common import bytes_codec, dtypes
from protos import grpc_service_pb2 as pb

# What `infer` accepts for one input: an array, or text (one string or several).
InputValue = np.ndarray | str | bytes | Sequence[str] | Sequence[bytes]


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for a dimension of any size


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]  # what a request needs
    outputs: tuple[TensorMetadata, ...]
    # Listed in the metadata but `optional: true` in ModelConfig (the model's token inputs,
    # an LLM's stream or messages): a generic request leaves them out.
    optional_inputs: tuple[TensorMetadata, ...] = ()


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass
class InferResult:
    model_name: str
    model_version: str
    id: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    def text(self, name: str) -> list[str]:
        """A BYTES output as a flat list of UTF-8 strings."""
        return [bytes(b).decode() for b in self.outputs[name].reshape(-1)]


def to_array(value: InputValue) -> np.ndarray:
    """Text becomes a BYTES tensor of shape [n]; arrays pass through unchanged."""
    if isinstance(value, np.ndarray):
        return value
    items = [value] if isinstance(value, str | bytes) else list(value)
    array = np.empty(len(items), dtype=object)
    array[:] = [s.encode() if isinstance(s, str) else bytes(s) for s in items]
    return array


def text_shape(spec: TensorMetadata, n: int) -> list[int]:
    """Shape for n strings fed to a BYTES input of the model's rank: [n, 1, ...]."""
    return [n] + [1] * (max(1, len(spec.shape)) - 1)


def infer_request(
    model: str,
    inputs: Mapping[str, InputValue],
    outputs: Sequence[str] = (),
    version: str = "",
    request_id: str = "",
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        array = to_array(value)
        datatype = dtypes.from_numpy(array.dtype)
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if datatype == "BYTES":
            request.raw_input_contents.append(bytes_codec.serialize_bytes(array))
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def infer_result(reply: pb.ModelInferResponse) -> InferResult:
    result = InferResult(reply.model_name, reply.model_version, reply.id)
    raw = reply.raw_output_contents
    for i, tensor in enumerate(reply.outputs):
        shape = tuple(tensor.shape)
        if i < len(raw):
            if tensor.datatype == "BYTES":
                items = bytes_codec.split(raw[i])
                array = np.empty(len(items), dtype=object)
                array[:] = items
            else:
                array = np.frombuffer(raw[i], dtype=dtypes.NUMPY[tensor.datatype])
        else:
            values = list(getattr(tensor.contents, dtypes.CONTENTS_FIELD[tensor.datatype]))
            if tensor.datatype == "BYTES":
                array = np.empty(len(values), dtype=object)
                array[:] = values
            else:
                array = np.array(values, dtype=dtypes.NUMPY[tensor.datatype])
        result.outputs[tensor.name] = array.reshape(shape)
    return result


def model_metadata(
    reply: pb.ModelMetadataResponse, config: pb.ModelConfigResponse | None = None
) -> ModelMetadata:
    """The metadata, its inputs split by ModelConfig's `optional` flags (the metadata lists
    every input, as Triton's does)."""

    def tensors(items: Sequence[pb.ModelMetadataResponse.TensorMetadata]) -> tuple:
        return tuple(TensorMetadata(t.name, t.datatype, tuple(t.shape)) for t in items)

    optional = {t.name for t in config.config.input if t.optional} if config else set()
    return ModelMetadata(
        reply.name,
        tuple(reply.versions),
        reply.platform,
        tensors([t for t in reply.inputs if t.name not in optional]),
        tensors(reply.outputs),
        tensors([t for t in reply.inputs if t.name in optional]),
    )


def server_metadata(reply: pb.ServerMetadataResponse) -> ServerMetadata:
    return ServerMetadata(reply.name, reply.version, tuple(reply.extensions))


def text_inputs(
    meta: ModelMetadata, text: str | Sequence[str]
) -> tuple[dict[str, np.ndarray], str]:
    """The BYTES input shaped for the model, and the name of its BYTES output."""
    texts = [text] if isinstance(text, str) else list(text)
    ins = [t for t in meta.inputs if t.datatype == "BYTES"]
    outs = [t for t in meta.outputs if t.datatype == "BYTES"]
    if len(ins) != 1 or len(meta.inputs) != 1 or not outs:
        raise ValueError(
            f"model {meta.name!r} is not a text model: it needs exactly one BYTES input and a "
            f"BYTES output, it has inputs {[(t.name, t.datatype) for t in meta.inputs]} and "
            f"outputs {[(t.name, t.datatype) for t in meta.outputs]}"
        )
    array = to_array(texts).reshape(text_shape(ins[0], len(texts)))
    return {ins[0].name: array}, outs[0].name
