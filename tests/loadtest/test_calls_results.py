"""loadtest/calls.py (the two loops over one request, as the benchmarks and the planner's
validation call them) against a real worker, and loadtest/results.py's result file."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np

from client import codec
from loadtest import calls, results


def mlp_request(model: str = "mlp"):  # type: ignore[no-untyped-def]
    return codec.infer_request(model, {"INPUT0": np.ones((1, 16), dtype=np.float32)})


def test_closed_and_open_loop_over_one_request(worker) -> None:  # type: ignore[no-untyped-def]
    closed = asyncio.run(calls.closed_loop(worker.address, mlp_request(), 2, 0.5, warmup=0.1))
    assert closed["concurrency"] == 2 and closed["requests"] > 10 and not closed["errors"]
    assert "cdf" not in closed and closed["throughput_rps"] > 0
    bounded = asyncio.run(
        calls.closed_loop(worker.address, mlp_request(), 2, 30, warmup=0, max_requests=10)
    )
    assert bounded["requests"] == 10 and bounded["seconds"] < 30
    opened = asyncio.run(calls.open_loop(worker.address, mlp_request(), 50.0, 0.5, warmup=0))
    assert opened["offered_rps"] == 50.0 and opened["requests"] > 5 and not opened["errors"]
    missing = asyncio.run(calls.closed_loop(worker.address, mlp_request("nope"), 1, 0.2, 0))
    assert missing["requests"] == 0 and missing["errors"]["NOT_FOUND"] > 0


def test_result_file_writes_no_measurement_as_null(tmp_path: Path) -> None:
    payload = {"p99_ms": math.inf, "rows": [1.5, math.nan, (2, -math.inf)], "ok": True}
    path = results.write_json(tmp_path / "deep" / "x.json", payload)
    assert json.loads(path.read_text()) == {
        "p99_ms": None,
        "rows": [1.5, None, [2, None]],
        "ok": True,
    }
    m = results.machine()
    assert m["cores"] and m["python"].count(".") == 2 and m["onnxruntime"]


def test_markdown_table() -> None:
    text = results.markdown_table(["a", "b"], [[1, "x"], [2.5, None]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
