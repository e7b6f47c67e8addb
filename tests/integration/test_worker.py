"""A real worker process on 127.0.0.1, called with tritonclient.grpc as any user would."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from common.net import free_port
from devmesh import processes
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc


def client(worker) -> triton.InferenceServerClient:  # type: ignore[no-untyped-def]
    return triton.InferenceServerClient(worker.address)


def infer_input(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    i = triton.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def test_health_and_metadata(worker) -> None:  # type: ignore[no-untyped-def]
    c = client(worker)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("mlp") and not c.is_model_ready("nope")
    meta = c.get_server_metadata()
    assert meta.name == "meshserve-worker"
    assert {"model_configuration", "statistics"} <= set(meta.extensions)
    assert "execution_provider/CPUExecutionProvider" in meta.extensions
    model = c.get_model_metadata("mlp")
    assert model.versions == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("INPUT0", "FP32", [-1, 16])
    ]
    assert [(t.name, list(t.shape)) for t in model.outputs] == [("OUTPUT0", [-1, 4])]
    index = {m.name for m in c.get_model_repository_index().models}
    assert {"mlp", "add_sub", "identity_bytes", "fixed"} <= index


def test_model_config(worker) -> None:  # type: ignore[no-untyped-def]
    config = client(worker).get_model_config("mlp").config
    assert config.max_batch_size == 64
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.parameters["meshserve.execution_provider"].string_value == "CPUExecutionProvider"
    assert config.parameters["meshserve.price_per_call_micro_usd"].string_value == "100"


def test_mlp_matches_onnxruntime(worker, model_repository) -> None:  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    reference = ort.InferenceSession(
        str(model_repository / "mlp/1/model.onnx"), providers=["CPUExecutionProvider"]
    ).run(None, {"INPUT0": x})[0]
    result = client(worker).infer("mlp", [infer_input("INPUT0", x, "FP32")], request_id="abc-1")
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), reference, rtol=1e-5)
    assert result.get_response().id == "abc-1"


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP32", np.array([[1.5, -2.0]], np.float32)),
        ("FP16", np.array([[1.5, -2.0]], np.float16)),
        ("FP64", np.array([[1e300, -2.0]], np.float64)),
        ("INT8", np.array([[-128, 127]], np.int8)),
        ("INT16", np.array([[-300, 300]], np.int16)),
        ("INT32", np.array([[-(2**31), 2**31 - 1]], np.int32)),
        ("INT64", np.array([[-(2**62), 2**62]], np.int64)),
        ("UINT8", np.array([[0, 255]], np.uint8)),
        ("BOOL", np.array([[True, False]], np.bool_)),
        ("BYTES", np.array([[b"hello", b"\xc3\xa9t\xc3\xa9"], [b"", b"x"]], dtype=object)),
        # BYTES are bytes: not UTF-8, NULs, every byte value (were U+FFFD-replaced, status OK).
        (
            "BYTES",
            np.array([[b"\xff\xfe\x80", b"\xc3\x28", b"\0nul\0", bytes(range(256))]], object),
        ),
    ],
)
def test_every_datatype_round_trips(worker, datatype: str, array: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    result = client(worker).infer(
        f"identity_{datatype.lower()}", [infer_input("INPUT0", array, datatype)]
    )
    out = result.as_numpy("OUTPUT0")
    assert out.shape == array.shape
    assert out.tolist() == array.tolist()


def test_requested_output_subset(worker) -> None:  # type: ignore[no-untyped-def]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), np.int32)
    result = client(worker).infer(
        "add_sub",
        [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", b, "INT32")],
        outputs=[triton.InferRequestedOutput("OUTPUT1")],
    )
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_typed_contents_and_fixed_shape(worker) -> None:  # type: ignore[no-untyped-def]
    # tritonclient always sends raw bytes; typed `contents` goes over our own stub.
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="fixed")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 3])
        tensor.contents.fp32_contents.extend([1, 2, 3, 4, 5, 6])
        reply = stub.ModelInfer(request, timeout=10)
    out = np.frombuffer(reply.raw_output_contents[0], np.float32)
    assert out.tolist() == [2, 4, 6, 8, 10, 12]
    assert list(reply.outputs[0].shape) == [2, 3]


def test_stream_infer(worker) -> None:  # type: ignore[no-untyped-def]
    async def run() -> list:
        c = triton_aio.InferenceServerClient(worker.address)

        async def requests():  # type: ignore[no-untyped-def]
            for i in range(5):
                x = np.full((1, 16), i, np.float32)
                yield {
                    "model_name": "mlp",
                    "inputs": [infer_input("INPUT0", x, "FP32")],
                    "request_id": str(i),
                }
            yield {
                "model_name": "nope",
                "inputs": [infer_input("INPUT0", x, "FP32")],
                "request_id": "bad",
            }

        got = []
        async for result, error in c.stream_infer(requests(), stream_timeout=20):
            got.append(result.get_response().id if error is None else f"error:{error}")
        await c.close()
        return got

    got = asyncio.run(run())
    assert sorted(g for g in got if not g.startswith("error")) == ["0", "1", "2", "3", "4"]
    assert any("unknown model 'nope'" in g for g in got)


def test_concurrent_calls_are_batched(worker) -> None:  # type: ignore[no-untyped-def]
    n = 12

    async def run() -> None:
        c = triton_aio.InferenceServerClient(worker.address)
        xs = [np.full((1, 16), i, np.float32) for i in range(n)]
        results = await asyncio.gather(
            *(c.infer("mlp_batched", [infer_input("INPUT0", x, "FP32")]) for x in xs)
        )
        await c.close()
        # Each row's answer is its own, not a neighbour's from the merged batch.
        for x, r in zip(xs, results, strict=True):
            single = client(worker).infer("mlp_unbatched", [infer_input("INPUT0", x, "FP32")])
            np.testing.assert_allclose(r.as_numpy("OUTPUT0"), single.as_numpy("OUTPUT0"), rtol=1e-5)

    asyncio.run(run())
    stats = client(worker).get_inference_statistics("mlp_batched").model_stats[0]
    assert stats.inference_stats.success.count == n
    assert stats.inference_count == n
    assert stats.execution_count < n / 2
    assert any(b.batch_size > 1 for b in stats.batch_stats)


def test_statistics_count_success_and_failure(worker) -> None:  # type: ignore[no-untyped-def]
    c = client(worker)
    before = c.get_inference_statistics("add_sub").model_stats[0].inference_stats
    ok = np.ones((1, 16), np.int32)
    c.infer("add_sub", [infer_input("INPUT0", ok, "INT32"), infer_input("INPUT1", ok, "INT32")])
    with pytest.raises(InferenceServerException):
        c.infer("add_sub", [infer_input("INPUT0", ok, "INT32")])
    after = c.get_inference_statistics("add_sub").model_stats[0].inference_stats
    assert after.success.count == before.success.count + 1
    assert after.fail.count == before.fail.count + 1
    assert after.success.ns > before.success.ns
    everything = c.get_inference_statistics()
    assert {"mlp", "add_sub"} <= {s.name for s in everything.model_stats}


def test_metrics_endpoint_agrees_with_statistics(worker_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    w = worker_factory("--metrics-port", str(port))
    c = client(w)
    ok = np.ones((1, 16), np.int32)
    for _ in range(3):
        c.infer("add_sub", [infer_input("INPUT0", ok, "INT32"), infer_input("INPUT1", ok, "INT32")])
    with pytest.raises(InferenceServerException):
        c.infer("add_sub", [infer_input("INPUT0", ok, "INT32")])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def value(family: str, **labels: str) -> float:
        (v,) = [s.value for s in families[family].samples if labels.items() <= s.labels.items()]
        return v

    stats = c.get_inference_statistics("add_sub").model_stats[0]
    key = {"model": "add_sub", "version": "1"}
    assert value("meshserve_worker_requests", **key, outcome="success") == 3
    assert value("meshserve_worker_requests", **key, outcome="fail") == 1
    assert value("meshserve_worker_inferences", **key) == stats.inference_count == 3
    assert value("meshserve_worker_phase_seconds", **key, phase="compute_infer") == pytest.approx(
        stats.inference_stats.compute_infer.ns / 1e9
    )
    assert value("meshserve_worker_queue_depth", **key) == 0
    assert value("meshserve_worker_queue_capacity", **key) > 0
    served = {m.name for m in c.get_model_repository_index().models}
    loaded = {s.labels["model"] for s in families["meshserve_worker_model_loaded"].samples}
    assert loaded == served
    providers = {s.labels["provider"] for s in families["meshserve_worker_model_loaded"].samples}
    assert providers == {"CPUExecutionProvider"}


def _status(call) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


def test_bad_inputs_get_clear_statuses(worker) -> None:  # type: ignore[no-untyped-def]
    c = client(worker)
    x = np.ones((1, 16), np.float32)
    cases = [
        (
            lambda: c.infer("nope", [infer_input("INPUT0", x, "FP32")]),
            "NOT_FOUND",
            "unknown model 'nope'",
        ),
        (
            lambda: c.infer("mlp", [infer_input("INPUT0", x, "FP32")], model_version="7"),
            "NOT_FOUND",
            "no version '7'",
        ),
        (
            lambda: c.infer("add_sub", [infer_input("INPUT0", x.astype(np.int32), "INT32")]),
            "INVALID_ARGUMENT",
            "INPUT1 (INT32 [-1, 16])",
        ),
        (
            lambda: c.infer(
                "mlp", [infer_input("INPUT0", x, "FP32"), infer_input("EXTRA", x, "FP32")]
            ),
            "INVALID_ARGUMENT",
            "'EXTRA' is not an input",
        ),
        (
            lambda: c.infer("mlp", [infer_input("INPUT0", x.astype(np.float64), "FP64")]),
            "INVALID_ARGUMENT",
            "datatype FP64, model 'mlp' expects FP32",
        ),
        (
            lambda: c.infer("mlp", [infer_input("INPUT0", np.ones((1, 15), np.float32), "FP32")]),
            "INVALID_ARGUMENT",
            "shape [1, 15] does not fit",
        ),
        (
            lambda: c.infer("mlp", [infer_input("INPUT0", np.ones((65, 16), np.float32), "FP32")]),
            "INVALID_ARGUMENT",
            "batch size 65 is outside 1..64",
        ),
        (lambda: c.get_model_config("nope"), "NOT_FOUND", "unknown model"),
    ]
    for call, code, message in cases:
        status, text = _status(call)
        assert status == f"StatusCode.{code}", text
        assert message in text
    # Byte length that does not match the shape: tritonclient cannot send it, our stub can.
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(b"\0" * 60)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw content is 60 bytes" in info.value.details()
        assert "needs 64" in info.value.details()
    # Still serving.
    assert c.infer("mlp", [infer_input("INPUT0", x, "FP32")]).as_numpy("OUTPUT0").shape == (1, 4)


def test_full_queue_is_resource_exhausted(worker) -> None:  # type: ignore[no-untyped-def]
    async def run() -> list:
        c = triton_aio.InferenceServerClient(worker.address)
        x = np.ones((1, 16), np.float32)
        calls = [c.infer("mlp_tiny_queue", [infer_input("INPUT0", x, "FP32")]) for _ in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        await c.close()
        return results

    results = asyncio.run(run())
    rejected = [r for r in results if isinstance(r, InferenceServerException)]
    assert len(rejected) == 3
    assert all(str(r.status()) == "StatusCode.RESOURCE_EXHAUSTED" for r in rejected)
    assert all("queue is full (2 requests waiting)" in r.message() for r in rejected)


def test_sigterm_under_load_drops_no_call(worker_factory) -> None:  # type: ignore[no-untyped-def]
    w = worker_factory("--grace-seconds", "15")
    n = 24

    async def run() -> list:
        c = triton_aio.InferenceServerClient(w.address)
        x = np.ones((1, 16), np.float32)
        # mlp_batched holds each batch for 200 ms, so these are in flight at SIGTERM.
        calls = [
            asyncio.ensure_future(
                c.infer("mlp_batched", [infer_input("INPUT0", x, "FP32")], client_timeout=20)
            )
            for _ in range(n)
        ]
        await asyncio.sleep(0.1)  # all sent and queued, none answered yet
        w.process.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*calls, return_exceptions=True)
        await c.close()
        return results

    started = time.monotonic()
    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert w.process.wait(20) == 0
    assert time.monotonic() - started < 15
    assert "worker_stopped" in w.log.read_text()


# -- issue 12: inputs that must get a clear status, never a traceback -----------------------

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _raw_infer(address: str, payload: bytes, timeout: float = 30) -> tuple[str, bytes | str]:
    """Send bytes as a ModelInfer request, as a broken or hostile client would."""
    options = [
        ("grpc.max_send_message_length", 1 << 27),
        ("grpc.max_receive_message_length", 1 << 27),
    ]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(METHOD)
        try:
            return "OK", call(payload, timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name, e.details()


def test_shape_element_count_does_not_wrap_around(worker) -> None:  # type: ignore[no-untyped-def]
    # 4 * 2**62 is 0 in int64: empty raw content used to "match" and fail in reshape (INTERNAL).
    for contents in ([b""], []):
        request = pb.ModelInferRequest(model_name="identity_fp32")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[4, 2**62])
        request.raw_input_contents.extend(contents)
        code, details = _raw_infer(worker.address, request.SerializeToString())
        assert code == "INVALID_ARGUMENT", details
        assert "'INPUT0'" in details and "[4, 4611686018427387904]" in details
        assert "18446744073709551616 elements" in details and "67108864" in details


def test_unparsable_request_is_invalid_argument(worker) -> None:  # type: ignore[no-untyped-def]
    good = pb.ModelInferRequest(model_name="mlp")
    good.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    good.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    data = good.SerializeToString()
    for payload in (b"\xff\xff\xff\xff", data[:-7], data + b"\x0f"):
        code, details = _raw_infer(worker.address, payload)
        assert code == "INVALID_ARGUMENT", (payload, details)
        assert "not a valid ModelInferRequest" in details
    # On a stream, the bad message gets an error reply and the stream goes on.
    with grpc.insecure_channel(worker.address) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        replies = [
            pb.ModelStreamInferResponse.FromString(r)
            for r in stream(iter([b"\xff\xff\xff\xff", data]), timeout=30)
        ]
    errors = sorted(r.error_message for r in replies)
    assert len(replies) == 2 and errors[0] == "", errors
    assert "not a valid ModelInferRequest" in errors[1]
    assert "Traceback" not in worker.log.read_text()


def _bytes_request(items: list[bytes]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="identity_bytes")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, len(items)])
    request.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in items))
    return request


def _health_latencies(address: str, stop: threading.Event, out: list[float]) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set() and len(out) < 2000:
            t = time.monotonic()
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            out.append(time.monotonic() - t)
            time.sleep(0.02)


def test_huge_bytes_requests_keep_health_answering(worker) -> None:  # type: ignore[no-untyped-def]
    # 15.7 M empty elements (63 MB) took ~20 s of parsing on the event loop: health stalled.
    n = 15_700_000
    huge = pb.ModelInferRequest(model_name="identity_bytes")
    huge.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, n])
    huge.raw_input_contents.append(bytes(4 * n))
    started = time.monotonic()
    code, details = _raw_infer(worker.address, huge.SerializeToString())
    assert code == "INVALID_ARGUMENT", details
    assert "at most 262144 BYTES elements" in details and "[1, 15700000]" in details
    assert time.monotonic() - started < 10
    del huge
    # Under the limit, a large request is decoded and encoded off the event loop.
    items = [b"x" * (i % 5) for i in range(250_000)]
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_latencies, args=(worker.address, stop, latencies))
    poller.start()
    try:
        time.sleep(0.2)
        code, reply = _raw_infer(worker.address, _bytes_request(items).SerializeToString(), 60)
    finally:
        stop.set()
        poller.join(30)
    assert code == "OK", reply
    out = pb.ModelInferResponse.FromString(reply)
    assert out.raw_output_contents[0] == _bytes_request(items).raw_input_contents[0]
    # Under the router's 1 s health-check timeout, which ejects a worker that misses it.
    assert len(latencies) > 5 and max(latencies) < 1.0, max(latencies)


def _zeros_request(shape: list[int]) -> bytes:
    request = pb.ModelInferRequest(model_name="zeros")
    request.inputs.add(name="INPUT0", datatype="INT64", shape=[2])
    request.raw_input_contents.append(np.array(shape, np.int64).tobytes())
    return request.SerializeToString()


def test_runtime_failures_map_to_their_status(worker) -> None:  # type: ignore[no-untyped-def]
    # All of these were INVALID_ARGUMENT "failed on this input", which the router never retries.
    code, reply = _raw_infer(worker.address, _zeros_request([2, 3]))
    assert code == "OK", reply
    # 4 TiB: onnxruntime's allocator fails. Another replica, or later, may have the memory.
    code, details = _raw_infer(worker.address, _zeros_request([2**20, 2**20]))
    assert code == "RESOURCE_EXHAUSTED", details
    assert "model 'zeros' ran out of memory" in details
    assert "Failed to allocate memory for requested buffer of size 4398046511104" in details
    # A size the graph cannot have: the client's input, in onnxruntime's words.
    code, details = _raw_infer(worker.address, _zeros_request([-1, 3]))
    assert code == "INVALID_ARGUMENT", details
    assert "model 'zeros' cannot run on this input" in details and "must be >= 0" in details
    assert "/onnxruntime_src/" not in details
    assert "Traceback" not in worker.log.read_text()


def _ids(name: str, ids: list[list[int]]) -> triton.InferInput:
    return infer_input(name, np.array(ids, np.int64), "INT64")


def test_token_ids_outside_the_vocabulary(worker) -> None:  # type: ignore[no-untyped-def]
    c = client(worker)
    config = c.get_model_config("embedding").config
    assert config.parameters["meshserve.vocab_size.input_ids"].string_value == "100"
    out = c.infer("embedding", [_ids("input_ids", [[0, 99]])]).as_numpy("OUTPUT0")
    assert out.shape == (1, 2, 8)
    # -1 read the table's last row with status OK; 100 failed inside onnxruntime.
    for bad, at in ((-1, "[0, 1]"), (100, "[0, 0]")):
        ids = [[bad, 3]] if bad == 100 else [[3, bad]]
        status, text = _status(lambda ids=ids: c.infer("embedding", [_ids("input_ids", ids)]))
        assert status == "StatusCode.INVALID_ARGUMENT", text
        assert (
            f"token id {bad} at {at} is outside the vocabulary 0..99 of model 'embedding'" in text
        )


def test_text_model_serves_text_alone_or_beside_its_token_inputs(worker_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from devmesh import toy_models

    toy_models.write_text_embedder(tmp_path / "repo" / "words")
    w = worker_factory(repository=tmp_path / "repo")
    c = client(w)
    # ModelConfig: every input, the token inputs marked as the optional alternative to TEXT.
    config = c.get_model_config("words").config
    assert {t.name: t.optional for t in config.input} == {
        "input_ids": True,
        "attention_mask": True,
        "TEXT": False,
    }
    # ModelMetadata lists every input, optional ones too, as Triton does (perf_analyzer and
    # genai-perf look each ModelConfig input up there); a client that fills the inputs
    # ModelConfig does not mark optional sends TEXT alone.
    meta = c.get_model_metadata("words")
    assert sorted(t.name for t in meta.inputs) == ["TEXT", "attention_mask", "input_ids"]
    optional = {t.name for t in config.input if t.optional}
    inputs = []
    for t in meta.inputs:
        if t.name in optional:
            continue
        shape = [2 if d == -1 else d for d in t.shape]
        data = np.array([[b"hello world"], [b"mesh"]], dtype=object).reshape(shape)
        inputs.append(infer_input(t.name, data, t.datatype))
    assert [i.name() for i in inputs] == ["TEXT"]
    by_text = c.infer("words", inputs).as_numpy("sentence_embedding")
    # A generic client fills every input: TEXT is served, the token inputs of its batch
    # beside it are not read.
    noise = [_ids("input_ids", [[7, 7], [7, 7]]), _ids("attention_mask", [[1, 1], [1, 1]])]
    every = c.infer("words", [*inputs, *noise]).as_numpy("sentence_embedding")
    np.testing.assert_array_equal(every, by_text)
    # The alternative, token ids alone, gives the same answer; out of vocabulary it is refused.
    ids = [[2, 3], [6, 0]]
    mask = [[1, 1], [1, 0]]
    by_ids = c.infer("words", [_ids("input_ids", ids), _ids("attention_mask", mask)])
    np.testing.assert_allclose(by_ids.as_numpy("sentence_embedding"), by_text, rtol=1e-6)
    status, text = _status(
        lambda: c.infer("words", [_ids("input_ids", [[2, 8]]), _ids("attention_mask", [[1, 1]])])
    )
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert "token id 8 at [0, 1] is outside the vocabulary 0..7 of model 'words'" in text


def test_taken_port_is_refused_before_any_model_loads(model_repository, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The port is bound first: a shard group's ranks open ephemeral ports while loading, so
    a worker that bound after loading could find its own port taken by them."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = processes.worker_process(
            model_repository, port, tmp_path, None, "--providers", "cpu"
        )
        refused = subprocess.run(
            worker.args, cwd=worker.cwd, capture_output=True, text=True, timeout=60
        )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"cannot serve on 127.0.0.1:{port}: the port is taken" in refused.stderr
    assert "model_loaded" not in refused.stderr
