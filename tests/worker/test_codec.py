from __future__ import annotations

import numpy as np
import pytest

from common import dtypes
from common.errors import InvalidArgument
from protos import grpc_service_pb2 as pb
from worker import codec
from worker.config import ModelSpec, TensorSpec


def make_spec(
    datatype: str = "FP32", dims: tuple[int, ...] = (4,), max_batch: int = 8
) -> ModelSpec:
    return ModelSpec(
        name="m",
        version="1",
        inputs={"x": TensorSpec("x", datatype, dims)},
        outputs={"y": TensorSpec("y", datatype, dims), "z": TensorSpec("z", datatype, dims)},
        max_batch_size=max_batch,
        dynamic_batching=True,
        max_queue_delay_us=0,
        preferred_batch_sizes=(),
        max_queue_size=8,
        instance_count=1,
    )


def raw_request(array: np.ndarray, datatype: str, name: str = "x") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    request.inputs.add(name=name, datatype=datatype, shape=array.shape)
    raw = codec.serialize_bytes(array) if datatype == "BYTES" else array.tobytes()
    request.raw_input_contents.append(raw)
    return request


@pytest.mark.parametrize("datatype", [d for d in dtypes.NUMPY if d != "BYTES"])
def test_raw_roundtrip_every_datatype(datatype: str) -> None:
    array = (np.arange(8).reshape(2, 4) % 2).astype(dtypes.NUMPY[datatype])
    inputs, outputs = codec.decode_request(raw_request(array, datatype), make_spec(datatype))
    np.testing.assert_array_equal(inputs["x"], array)
    assert inputs["x"].dtype == array.dtype
    assert outputs == ["y", "z"]


def test_bytes_roundtrip() -> None:
    array = np.array([[b"a", b"", b"hello", "\u00e9".encode()]], dtype=object)
    inputs, _ = codec.decode_request(raw_request(array, "BYTES"), make_spec("BYTES"))
    assert inputs["x"].tolist() == array.tolist()
    again = codec.deserialize_bytes(codec.serialize_bytes(array), 4, "x")
    assert again.tolist() == array.reshape(-1).tolist()


@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("FP32", "fp32_contents", [1.5, 2, 3, 4]),
        ("INT32", "int_contents", [1, -2, 3, 4]),
        ("INT64", "int64_contents", [1, 2, 3, 2**40]),
        ("UINT8", "uint_contents", [1, 2, 3, 255]),
        ("BOOL", "bool_contents", [True, False, True, True]),
        ("BYTES", "bytes_contents", [b"a", b"b", b"c", b"d"]),
    ],
)
def test_typed_contents(datatype: str, field: str, values: list) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[1, 4])
    getattr(tensor.contents, field).extend(values)
    inputs, _ = codec.decode_request(request, make_spec(datatype))
    assert inputs["x"].reshape(-1).tolist() == values


def test_requested_output_subset_and_response() -> None:
    request = raw_request(np.ones((1, 4), np.float32), "FP32")
    request.outputs.add(name="z")
    _, outputs = codec.decode_request(request, make_spec())
    assert outputs == ["z"]
    response = codec.encode_response(request, make_spec(), {"z": np.full((1, 4), 2, np.float32)})
    assert response.id == "r1"
    assert [o.name for o in response.outputs] == ["z"]
    assert list(response.outputs[0].shape) == [1, 4]
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.0] * 4


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: setattr(r.inputs[0], "name", "nope"), "'nope' is not an input of model 'm'"),
        (
            lambda r: setattr(r.inputs[0], "datatype", "INT32"),
            "datatype INT32, model 'm' expects FP32",
        ),
        (lambda r: r.inputs[0].shape.__setitem__(1, 5), "shape [1, 5] does not fit"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12), "raw content is 12 bytes"),
        (lambda r: r.outputs.add(name="q"), "requested output 'q' is not an output"),
        (lambda r: r.raw_input_contents.append(b""), "1 inputs but 2 raw_input_contents"),
    ],
    ids=["extra-input", "datatype", "shape", "byte-length", "output", "raw-count"],
)
def test_rejections_name_what_was_wrong(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    request = raw_request(np.ones((1, 4), np.float32), "FP32")
    mutate(request)
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        codec.decode_request(request, make_spec())


def test_missing_input() -> None:
    with pytest.raises(InvalidArgument, match=r"needs input\(s\) x \(FP32 \[-1, 4\]\)"):
        codec.decode_request(pb.ModelInferRequest(model_name="m"), make_spec())


def test_batch_above_max() -> None:
    request = raw_request(np.ones((9, 4), np.float32), "FP32")
    with pytest.raises(InvalidArgument, match=r"batch size 9 is outside 1..8"):
        codec.decode_request(request, make_spec(max_batch=8))


def test_fp16_needs_raw() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP16", shape=[1, 4])
    with pytest.raises(InvalidArgument, match="FP16 has no typed contents"):
        codec.decode_request(request, make_spec("FP16"))


def test_truncated_bytes() -> None:
    with pytest.raises(InvalidArgument, match="claims 10 bytes"):
        codec.deserialize_bytes(b"\x0a\0\0\0abc", 1, "x")
