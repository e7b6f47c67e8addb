"""The load tool: request building and the HDR summary as units; both loops and the CLI
against a real worker process, each bounded to a second or two."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from client.codec import ModelMetadata, TensorMetadata
from loadtest import inputs
from loadtest.runner import Load, closed_loop, open_loop
from loadtest.stats import Recorder
from protos import grpc_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
META = ModelMetadata(
    "m",
    ("1",),
    "onnxruntime_onnx",
    (
        TensorMetadata("X", "FP32", (-1, 16)),
        TensorMetadata("IDS", "INT64", (-1, -1)),
        TensorMetadata("T", "BYTES", (-1, 1)),
    ),
    (TensorMetadata("Y", "FP32", (-1, 4)),),
)


def test_random_inputs_follow_the_metadata() -> None:
    requests = inputs.from_metadata(META, batch=3, shapes={"IDS": [3, 7]}, variants=2)
    assert len(requests) == 2
    x, ids, t = requests[0]["X"], requests[0]["IDS"], requests[0]["T"]
    assert x.shape == (3, 16) and x.dtype == np.float32
    assert ids.shape == (3, 7) and ids.dtype == np.int64
    assert t.shape == (3, 1) and isinstance(t[0, 0], bytes)
    assert not np.array_equal(requests[0]["X"], requests[1]["X"])
    raw = inputs.serialize("m", requests)
    parsed = pb.ModelInferRequest.FromString(raw[0])
    assert [i.name for i in parsed.inputs] == ["X", "IDS", "T"]
    assert list(parsed.inputs[0].shape) == [3, 16]


def test_parse_shapes() -> None:
    assert inputs.parse_shapes(["A=1,16", "B=2"]) == {"A": [1, 16], "B": [2]}
    with pytest.raises(ValueError, match="NAME=D1"):
        inputs.parse_shapes(["A"])


def test_inputs_from_files(tmp_path: Path) -> None:
    path = tmp_path / "in.json"
    path.write_text(json.dumps([{"X": [[1] * 16]}, {"X": [[2] * 16], "T": [["a"]]}]))
    requests = inputs.from_file(path, META)
    assert requests[0]["X"].dtype == np.float32 and requests[0]["X"].shape == (1, 16)
    assert requests[1]["T"].shape == (1, 1) and requests[1]["T"][0, 0] == b"a"
    npz = tmp_path / "in.npz"
    np.savez(npz, X=np.ones((2, 16), np.float32))
    assert inputs.from_file(npz, META)[0]["X"].shape == (2, 16)
    path.write_text(json.dumps({"nope": [1]}))
    with pytest.raises(ValueError, match="not one of"):
        inputs.from_file(path, META)


def test_text_inputs() -> None:
    text_meta = ModelMetadata(
        "t", (), "", (TensorMetadata("TEXT", "BYTES", (-1, 1)),), (META.inputs[2],)
    )
    (request,) = inputs.from_text(text_meta, ["hello world"])
    assert request["TEXT"].shape == (1, 1) and request["TEXT"][0, 0] == b"hello world"


def test_recorder_percentiles_and_errors() -> None:
    r = Recorder()
    for ms in range(1, 1001):
        r.ok(ms / 1000)
    r.error("UNAVAILABLE")
    r.error("UNAVAILABLE")
    s = r.summary(seconds=2.0)
    assert s["requests"] == 1000 and s["throughput_rps"] == 500.0
    assert s["p50_ms"] == pytest.approx(500, rel=0.01)
    assert s["p99_ms"] == pytest.approx(990, rel=0.01)
    assert s["p999_ms"] == pytest.approx(999, rel=0.01)
    assert s["errors"] == {"UNAVAILABLE": 2}
    cdf = r.cdf()
    assert cdf[-1][0] == 100.0 and all(a[1] <= b[1] for a, b in itertools.pairwise(cdf))


def mlp_requests(model: str = "mlp") -> list[bytes]:
    meta = ModelMetadata(model, (), "", (TensorMetadata("INPUT0", "FP32", (-1, 16)),), ())
    return inputs.serialize(model, inputs.from_metadata(meta, variants=2))


def test_closed_and_open_loop_against_a_worker(worker) -> None:  # type: ignore[no-untyped-def]
    load = Load(worker.address, mlp_requests(), duration=1.0, warmup=0.2, timeout=5.0)
    closed = asyncio.run(closed_loop(load, concurrency=4))
    assert closed["concurrency"] == 4 and closed["requests"] > 50 and not closed["errors"]
    assert 0 < closed["p50_ms"] <= closed["p99_ms"] <= closed["p999_ms"] <= closed["max_ms"]
    opened = asyncio.run(open_loop(load, rate=100.0))
    assert opened["offered_rps"] == 100.0 and not opened["errors"]
    assert 50 <= opened["requests"] <= 200  # Poisson around 100 in one second
    assert opened["client_limited"] is False, opened["client"]  # 100 req/s: easily on time
    assert opened["client"]["unsent"] == 0 and opened["client"]["reached_fraction"] == 1.0
    bad = Load(worker.address, mlp_requests("nope"), duration=0.3, warmup=0.0, timeout=5.0)
    result = asyncio.run(closed_loop(bad, concurrency=2))
    assert result["requests"] == 0 and result["errors"]["NOT_FOUND"] > 0


def test_max_requests_bounds_a_run(worker) -> None:  # type: ignore[no-untyped-def]
    load = Load(worker.address, mlp_requests(), duration=30, warmup=0, max_requests=20)
    result = asyncio.run(closed_loop(load, concurrency=2))
    assert result["sent"] == 20 and result["requests"] == 20 and result["seconds"] < 30


def test_cli_json_and_plots(worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--address",
            worker.address,
            "--model",
            "mlp",
            "--concurrency",
            "1",
            "4",
            "--duration",
            "0.5",
            "--warmup",
            "0.2",
            "--output",
            str(out),
            "--plot-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["mode"] == "closed" and [r["concurrency"] for r in result["runs"]] == [1, 4]
    assert {"p50_ms", "p90_ms", "p99_ms", "p999_ms", "errors", "cdf"} <= set(result["runs"][0])
    assert (tmp_path / "latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "latency_vs_load.png").stat().st_size > 1000
    assert "[c=4]" in proc.stderr  # the progress line


def test_cli_text_model_open_loop(worker) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--address",
            worker.address,
            "--model",
            "identity_bytes",
            "--text",
            "hello",
            "world",
            "--rate",
            "50",
            "--duration",
            "0.5",
            "--warmup",
            "0",
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "50 rps offered" in proc.stdout


def test_open_loop_beyond_the_client_is_flagged_client_limited(worker) -> None:  # type: ignore[no-untyped-def]
    # A million req/s is far past what one Python client sends: it falls behind its
    # schedule at once. The run must still end on time and say it measured the client.
    load = Load(worker.address, mlp_requests(), duration=1.0, warmup=0.0, timeout=2.0)
    started = time.monotonic()
    result = asyncio.run(open_loop(load, rate=1_000_000.0, max_in_flight=200))
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 0.05 + 2.0 + 1.0, elapsed  # window + lag allowance + deadline
    client = result["client"]
    assert result["client_limited"] is True and client["limited"] is True
    assert client["reached_fraction"] < 0.5 and client["unsent"] > 0, client
    assert client["scheduled"] > 500_000  # the schedule's arrivals, sent or not
    assert "scheduled arrivals" in client["reason"]


def test_table_marks_a_client_limited_run() -> None:
    from loadtest.__main__ import table

    base = {"offered_rps": 5000.0, "throughput_rps": 900.0, "errors": {}}
    base.update(p50_ms=1.0, p90_ms=2.0, p99_ms=3.0, p999_ms=4.0)
    client = {"reason": "reached 18.0% of the 5,000 scheduled arrivals (below 95%)"}
    limited = {**base, "client_limited": True, "client": client}
    fine = {**base, "offered_rps": 100.0, "client_limited": False}
    text = table([limited, fine])
    assert "CLIENT-LIMITED" in text.splitlines()[1]
    assert "CLIENT-LIMITED" not in text.splitlines()[2]
    assert "5000 rps offered: client-limited" in text and "reached 18.0%" in text


def test_cli_flags_a_client_limited_rate(worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.json"
    args = ["--address", worker.address, "--model", "mlp", "--rate", "1000000", "50"]
    args += ["--duration", "0.5", "--warmup", "0", "--timeout", "1", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", *args, "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    limited, normal = result["runs"]
    assert result["client_limited"] is True
    assert limited["client_limited"] is True and normal["client_limited"] is False
    lines = proc.stdout.splitlines()
    assert lines[1].endswith("CLIENT-LIMITED") and not lines[2].endswith("CLIENT-LIMITED")
    assert "1e+06 rps offered: client-limited" in proc.stdout
