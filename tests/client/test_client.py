"""The client against a real worker process: arrays, text, metadata, health, errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from client import AsyncClient, Client, codec

ROOT = Path(__file__).resolve().parents[2]


def test_infer_arrays_metadata_and_health(worker) -> None:  # type: ignore[no-untyped-def]
    with Client(worker.address, timeout=10) as c:
        assert c.health() == "SERVING"
        assert c.server_live() and c.server_ready() and c.model_ready("mlp")
        meta = c.model_metadata("mlp")
        assert meta.inputs[0].name == "INPUT0" and meta.inputs[0].shape == (-1, 16)
        assert meta.outputs[0].datatype == "FP32"
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        result = c.infer("add_sub", {"INPUT0": a, "INPUT1": a}, request_id="r-1")
        assert result.id == "r-1"
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], a * 2)
        np.testing.assert_array_equal(result.outputs["OUTPUT1"], a * 0)
        only = c.infer("add_sub", {"INPUT0": a, "INPUT1": a}, outputs=["OUTPUT1"])
        assert list(only.outputs) == ["OUTPUT1"]
        assert c.server_metadata().name


def test_text_in_text_out(worker) -> None:  # type: ignore[no-untyped-def]
    with Client(worker.address, timeout=10) as c:
        assert c.infer_text("identity_bytes", ["héllo", "world"]) == ["héllo", "world"]
        with pytest.raises(ValueError, match="not a text model"):
            c.infer_text("mlp", "x")


def test_errors_carry_their_status(worker) -> None:  # type: ignore[no-untyped-def]
    with Client(worker.address, timeout=10) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.infer("nope", {"INPUT0": np.ones((1, 16), np.float32)})
        assert e.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as e:
            c.infer("mlp", {"INPUT0": np.ones((1, 3), np.float32)})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


def test_async_client(worker) -> None:  # type: ignore[no-untyped-def]
    async def calls() -> None:
        async with AsyncClient(worker.address, timeout=10) as c:
            assert await c.health() == "SERVING"
            assert await c.server_ready()
            result = await c.infer("mlp", {"INPUT0": np.ones((3, 16), np.float32)})
            assert result.outputs["OUTPUT0"].shape == (3, 4)
            assert (await c.model_metadata("mlp")).name == "mlp"

    asyncio.run(calls())


def test_typed_output_contents_decode() -> None:
    """MLServer answers with typed contents instead of raw bytes; both decode the same."""
    from protos import grpc_service_pb2 as pb

    reply = pb.ModelInferResponse(model_name="m", id="x")
    out = reply.outputs.add(name="Y", datatype="FP32", shape=[2, 2])
    out.contents.fp32_contents.extend([1, 2, 3, 4])
    text = reply.outputs.add(name="T", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"hi")
    result = codec.infer_result(reply)
    np.testing.assert_array_equal(result.outputs["Y"], [[1, 2], [3, 4]])
    assert result.text("T") == ["hi"]


def test_cli_health_exit_code(worker) -> None:  # type: ignore[no-untyped-def]
    ok = subprocess.run(
        [sys.executable, "-m", "client", "health", worker.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    down = subprocess.run(
        [sys.executable, "-m", "client", "health", "127.0.0.1:1", "--timeout", "0.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode == 1
