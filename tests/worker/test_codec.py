from __future__ import annotations

import numpy as np
import pytest

from common import bytes_codec, dtypes
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
    raw = bytes_codec.serialize_bytes(array) if datatype == "BYTES" else array.tobytes()
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
    again = bytes_codec.deserialize_bytes(bytes_codec.serialize_bytes(array), 4, "x")
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
        bytes_codec.deserialize_bytes(b"\x0a\0\0\0abc", 1, "x")


@pytest.mark.parametrize(
    ("shape", "count"),
    [((4, 2**62), 2**64), ((1, 2**32, 2**32), 2**64), ((3, 2**40), 3 * 2**40)],
)
def test_element_counts_are_exact_and_bounded(shape: tuple[int, ...], count: int) -> None:
    # np.prod in int64 wrapped (4 * 2**62 == 0), so empty contents "matched" such shapes.
    spec = make_spec(dims=(-1,) * (len(shape) - 1), max_batch=8)
    for raw in (b"", None):
        request = pb.ModelInferRequest(model_name="m")
        request.inputs.add(name="x", datatype="FP32", shape=shape)
        if raw is not None:
            request.raw_input_contents.append(raw)
        with pytest.raises(InvalidArgument) as info:
            codec.decode_request(request, spec, codec.Limits(max_elements=1000))
        assert f"input 'x': shape {list(shape)} has {count} elements" in info.value.message
        assert "more than the 1000 one request can carry" in info.value.message


def test_bytes_element_limit() -> None:
    array = np.array([[b""] * 10], dtype=object)
    with pytest.raises(InvalidArgument, match="at most 9 BYTES elements per tensor"):
        codec.decode_request(
            raw_request(array, "BYTES"), make_spec("BYTES", dims=(-1,)), codec.Limits(100, 9)
        )


@pytest.mark.parametrize(
    "items",
    [[b""] * 5, [b"ab\0"] * 4, [b"", b"a", b"\xff\0\xfe", b"xyz" * 50]],
    ids=["all-empty", "uniform", "mixed"],
)
def test_bytes_parse_paths_agree(items: list[bytes]) -> None:
    array = np.array(items, dtype=object)
    assert (
        bytes_codec.deserialize_bytes(bytes_codec.serialize_bytes(array), len(items), "x").tolist()
        == items
    )


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\0\0\0\0\0\0\0\0", 1, "4 bytes left after the 1 elements"),
        (b"\x01\0\0\0a\x05\0", 2, "too short for 2 elements"),
        (b"\x01\0\0\0a\x01\0\0\0b\x01\0", 3, "ends inside the 4-byte length prefix of element 2"),
        (b"\x01\0\0\0a\x01\0\0\0b\x01\0\0\0", 3, "element 2 claims 1 bytes but only 0 remain"),
        (b"x", 0, "shape needs 0 elements"),
    ],
)
def test_malformed_bytes(raw: bytes, count: int, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        bytes_codec.deserialize_bytes(raw, count, "x")


def test_typed_contents_out_of_range() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="INT8", shape=[1, 4])
    tensor.contents.int_contents.extend([1, 2, 3, 1000])
    with pytest.raises(InvalidArgument, match=r"values in 1..1000, outside INT8's -128..127"):
        codec.decode_request(request, make_spec("INT8"))


def test_parse_request_never_raises() -> None:
    assert isinstance(codec.parse_request(b"\xff\xff\xff"), codec.Unparsable)
    good = raw_request(np.ones((1, 4), np.float32), "FP32").SerializeToString()
    assert codec.parse_request(good).model_name == "m"
