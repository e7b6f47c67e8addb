"""KServe v2 REST bodies <-> ModelInferRequest / ModelInferResponse, without numpy.

The request side turns a JSON body (and the binary-tensor extension's trailing bytes) into
the protobuf the workers take, every input as `raw_input_contents`; the response side turns
a worker's reply back into JSON, with outputs as binary data where the client asked
(`binary_data` on the output, or `binary_data_output` on the request). Tensor bytes are
little-endian as v2 says; BYTES elements are 4-byte-length-prefixed (Triton's format).
Every refusal is a 400 naming the field.

https://github.com/kserve/open-inference-protocol (REST), Triton's binary_tensor_data.md.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from typing import Any

from common import bytes_codec
from protos import grpc_service_pb2 as pb
from router.http.errors import HttpError

# v2 datatype -> array/struct type code (little-endian on this machine; checked below).
CODES = {
    "BOOL": "B",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
SIZES = {**{k: struct.calcsize(c) for k, c in CODES.items()}, "BF16": 2}
INTEGER = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
HEADER_LENGTH = "inference-header-content-length"
assert sys.byteorder == "little"  # raw contents are written as this machine lays them out

Json = dict[str, Any]


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param)


def split_body(body: bytes, header_length: str | None) -> tuple[Json, bytes]:
    """The JSON part and the binary part of a request body."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise _bad(f"{HEADER_LENGTH} must be an integer, got {header_length[:40]!r}") from None
        if not 0 <= n <= len(body):
            raise _bad(f"{HEADER_LENGTH} {n} is outside the body's {len(body)} bytes")
        json_part, binary = body[:n], body[n:]
    return parse_json(json_part), binary


def parse_json(raw: bytes) -> Json:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(f"the body is not JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise _bad(f"the body must be a JSON object, got {type(doc).__name__}")
    return doc


def set_parameters(target: Any, params: object, where: str) -> None:
    """A JSON `parameters` object into a protobuf parameters map."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise _bad(f"{where}: an object expected", where)
    for key, value in params.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise _bad(f"{where}.{key}: an int64 expected", f"{where}.{key}")
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        elif isinstance(value, str):
            p.string_param = value
        else:
            raise _bad(f"{where}.{key}: a bool, number or string expected", f"{where}.{key}")


def parameters_json(params: Any) -> Json:
    out: Json = {}
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(p, kind)
    return out


def infer_request(doc: Json, binary: bytes, model: str, version: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    rid = doc.get("id", "")
    if not isinstance(rid, str):
        raise _bad("id: a string expected", "id")
    request.id = rid
    set_parameters(request.parameters, doc.get("parameters"), "parameters")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _bad("inputs: a non-empty list of tensors expected", "inputs")
    offset = 0
    for i, tensor in enumerate(inputs):
        raw, used = _input(tensor, i, binary, offset)
        offset += used
        name, datatype, shape = tensor["name"], tensor["datatype"], tensor["shape"]
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise _bad(f"the body has {len(binary) - offset} binary bytes no input claims")
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise _bad("outputs: a list expected", "outputs")
    for j, out in enumerate(outputs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise _bad(f"outputs[{j}].name: a string expected", f"outputs[{j}].name")
        request.outputs.add(name=out["name"])
    return request


def _input(tensor: object, i: int, binary: bytes, offset: int) -> tuple[bytes, int]:
    """One input's raw contents and how many binary bytes it took."""
    where = f"inputs[{i}]"
    if not isinstance(tensor, dict):
        raise _bad(f"{where}: an object expected", where)
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str):
        raise _bad(f"{where}.name: a string expected", f"{where}.name")
    if datatype not in SIZES and datatype != "BYTES":
        raise _bad(f"{where}.datatype: a v2 datatype expected, got {str(datatype)[:20]!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape
    ):
        raise _bad(f"{where}.shape: a list of non-negative integers expected", f"{where}.shape")
    count = math.prod(shape)
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad(f"{where}.parameters: an object expected", f"{where}.parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _bad(f"{where}.parameters.binary_data_size: a non-negative integer expected")
        if offset + size > len(binary):
            raise _bad(f"{where}: binary_data_size {size} runs past the body's binary data")
        raw = binary[offset : offset + size]
        if datatype != "BYTES" and size != count * SIZES[datatype]:
            raise _bad(
                f"{where}: {size} binary bytes for {count} {datatype} elements "
                f"({count * SIZES[datatype]} expected)"
            )
        return raw, size
    if "data" not in tensor:
        raise _bad(f"{where}: data or parameters.binary_data_size expected", f"{where}.data")
    return _pack(_flat(tensor["data"], where), datatype, count, where), 0


def _flat(data: object, where: str) -> list:
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(x, list) for x in data):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                if len(stack) > 64:
                    raise _bad(f"{where}.data: nested too deep", f"{where}.data")
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def _pack(values: list, datatype: str, count: int, where: str) -> bytes:
    if len(values) != count:
        raise _bad(f"{where}.data: {len(values)} elements for shape of {count}", f"{where}.data")
    if datatype == "BYTES":
        parts = []
        for v in values:
            if not isinstance(v, str):
                raise _bad(f"{where}.data: strings expected for BYTES", f"{where}.data")
            parts.append(v.encode())
        return bytes_codec.join(parts)
    if datatype == "BF16":
        raise _bad(f"{where}: BF16 only as binary data", f"{where}.datatype")
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise _bad(f"{where}.data: true or false expected for BOOL", f"{where}.data")
    elif datatype in INTEGER:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise _bad(f"{where}.data: integers expected for {datatype}", f"{where}.data")
    elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise _bad(f"{where}.data: numbers expected for {datatype}", f"{where}.data")
    try:
        return array(CODES[datatype], values).tobytes()
    except (OverflowError, TypeError, ValueError) as e:
        raise _bad(f"{where}.data: does not fit {datatype}: {e}", f"{where}.data") from None


def _unpack(raw: bytes, datatype: str) -> list:
    if datatype == "BYTES":
        return [b.decode(errors="replace") for b in split_bytes(raw)]
    if datatype == "BF16":  # the high half of an FP32
        return list(array("f", b"".join(b"\0\0" + raw[i : i + 2] for i in range(0, len(raw), 2))))
    values = array(CODES[datatype], raw).tolist()
    return [bool(v) for v in values] if datatype == "BOOL" else values


split_bytes = bytes_codec.split


def wants_binary(doc: Json) -> tuple[bool, set[str]]:
    """(every output binary, the outputs asked for binary by name)."""
    params = doc.get("parameters") or {}
    every = isinstance(params, dict) and params.get("binary_data_output") is True
    named = set()
    for out in doc.get("outputs") or []:
        p = out.get("parameters") if isinstance(out, dict) else None
        if isinstance(p, dict) and p.get("binary_data") is True:
            named.add(out["name"])
    return every, named


def infer_response(
    reply: pb.ModelInferResponse, every_binary: bool, binary_names: set[str]
) -> tuple[bytes, int | None]:
    """The response body and, when it carries binary data, the JSON header's length."""
    outputs = []
    chunks = []
    for i, t in enumerate(reply.outputs):
        raw = reply.raw_output_contents[i] if i < len(reply.raw_output_contents) else b""
        entry: Json = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if every_binary or t.name in binary_names:
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _unpack(raw, t.datatype)
        outputs.append(entry)
    doc: Json = {"model_name": reply.model_name, "model_version": reply.model_version}
    if reply.id:
        doc["id"] = reply.id
    params = parameters_json(reply.parameters)
    if params:
        doc["parameters"] = params
    doc["outputs"] = outputs
    head = json.dumps(doc, allow_nan=True).encode()
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)


def output_text(reply: pb.ModelInferResponse, name: str) -> str:
    """The strings of a BYTES output, joined (an LLM's text_output)."""
    for i, t in enumerate(reply.outputs):
        if t.name == name and i < len(reply.raw_output_contents):
            return "".join(
                b.decode(errors="replace") for b in split_bytes(reply.raw_output_contents[i])
            )
    return ""


def output_texts(reply: pb.ModelInferResponse, name: str) -> list[str]:
    """Each string of a BYTES output (an LLM's choices, one per element)."""
    for i, t in enumerate(reply.outputs):
        if t.name == name and i < len(reply.raw_output_contents):
            return [b.decode(errors="replace") for b in split_bytes(reply.raw_output_contents[i])]
    return []


def output_floats(reply: pb.ModelInferResponse) -> tuple[list[float], list[int]] | None:
    """The first FP32 output's values and shape (an embedder's sentence embeddings)."""
    for i, t in enumerate(reply.outputs):
        if t.datatype == "FP32" and i < len(reply.raw_output_contents):
            return array("f", reply.raw_output_contents[i]).tolist(), list(t.shape)
    return None


def generate_request(doc: Json, model: str, version: str, streamed: bool) -> pb.ModelInferRequest:
    """Triton's generate body: each key but `id` and `parameters` is an input holding one
    value (a string is BYTES, a bool BOOL, an integer INT64, a number FP64; a JSON object
    or list is sent as its JSON text, as `sampling_parameters` is)."""
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    rid = doc.get("id", "")
    if not isinstance(rid, str):
        raise _bad("id: a string expected", "id")
    request.id = rid
    set_parameters(request.parameters, doc.get("parameters"), "parameters")
    values = {k: v for k, v in doc.items() if k not in ("id", "parameters")}
    if "stream" not in values:
        values["stream"] = streamed
    for name, value in values.items():
        if isinstance(value, dict | list):
            value = json.dumps(value)
        if isinstance(value, str):
            request.inputs.add(name=name, datatype="BYTES", shape=[1])
            request.raw_input_contents.append(bytes_codec.join([value.encode()]))
        elif isinstance(value, bool):
            request.inputs.add(name=name, datatype="BOOL", shape=[1])
            request.raw_input_contents.append(b"\x01" if value else b"\x00")
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            request.inputs.add(name=name, datatype="INT64", shape=[1])
            request.raw_input_contents.append(struct.pack("<q", value))
        elif isinstance(value, float):
            request.inputs.add(name=name, datatype="FP64", shape=[1])
            request.raw_input_contents.append(struct.pack("<d", value))
        else:
            raise _bad(f"{name[:64]}: a string, bool or number expected", name[:64])
    return request


def generate_response(reply: pb.ModelInferResponse) -> Json:
    """One response as Triton's generate answers: each output by name (one element: the
    value itself), with the model, version, id and the response's parameters."""
    doc: Json = {"model_name": reply.model_name, "model_version": reply.model_version}
    if reply.id:
        doc["id"] = reply.id
    for i, t in enumerate(reply.outputs):
        raw = reply.raw_output_contents[i] if i < len(reply.raw_output_contents) else b""
        values = _unpack(raw, t.datatype)
        doc[t.name] = (
            "".join(values) if t.datatype == "BYTES" else values[0] if len(values) == 1 else values
        )
    doc.update(parameters_json(reply.parameters))
    return doc
