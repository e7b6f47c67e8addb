"""The worker's achieved FLOP/s and bytes/s: the sums it keeps give the analysis's totals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from devmesh import toy_models
from perfmodel.analysis import analyse_file
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from tests.planner.conftest import TINY, save_graph
from worker.roofline import Roofs, totals
from worker.stats import ModelStats


def test_decode_and_prefill_sums_give_the_exact_totals(tmp_path: Path) -> None:
    import torch

    from quantize import llm_graph
    from quantize.models import LlamaDecoder

    torch.manual_seed(0)
    path = llm_graph.save(llm_graph.build(LlamaDecoder(TINY).eval(), 256), tmp_path / "m.onnx")
    a = analyse_file(path, "tiny", "1")
    stats = ModelStats()
    expected = np.zeros(2)
    for rows, context in ((1, 10), (3, 40), (4, 130)):
        # `context`: cached tokens over all the run's rows
        stats.record_execution(rows, rows, 0, 1_000_000, 0, "decode", rows, context)
        expected += [
            2 * a.projection_params * rows + 4 * context * a.attention_width * a.layers,
            a.decode_step(rows, 0)[1] + context * a.kv_bytes_per_token,
        ]
    for tokens in (7, 64):
        stats.record_execution(1, 1, 0, 2_000_000, 0, "prefill", tokens, 0)
        expected += a.prefill(tokens)
    flops, moved, seconds = totals(a, stats.work)
    assert flops == pytest.approx(expected[0]) and moved == pytest.approx(expected[1])
    assert seconds == pytest.approx(0.007)


def test_modelstatistics_reports_achieved_rates_against_the_roof(worker_factory) -> None:  # type: ignore[no-untyped-def]
    w = worker_factory("--roofline-profile", "H200")
    with grpc.insecure_channel(w.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="mlp_unbatched")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[4, 16])
        request.raw_input_contents.append(np.ones((4, 16), np.float32).tobytes())
        for _ in range(30):
            stub.ModelInfer(request, timeout=10)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp_unbatched"), timeout=30)
    (s,) = reply.model_stats
    figures = {m.type.removeprefix("meshserve.roofline."): m.byte_size for m in s.memory_usage}
    runs = sum(b.compute_infer.count for b in s.batch_stats)
    rows = sum(b.batch_size * b.compute_infer.count for b in s.batch_stats)
    seconds = sum(b.compute_infer.ns for b in s.batch_stats) / 1e9
    params = 16 * 64 + 64 * 4
    assert runs == 30 and rows == 120
    assert figures["achieved_flops_per_s"] == pytest.approx(2 * params * rows / seconds, rel=1e-3)
    moved = runs * 4 * params + rows * 4 * 4  # weights per run, the fp32 output per row
    assert figures["achieved_bytes_per_s"] == pytest.approx(moved / seconds, rel=1e-3)
    h200_fp32 = 67e12 * 0.78
    assert figures["compute_roof_fraction_ppm"] == pytest.approx(
        2 * params * rows / seconds / h200_fp32 * 1e6, abs=1
    )
    assert figures["weight_bytes"] == 4 * params


def test_unknown_profile_stops_the_worker_with_a_clear_message(model_repository: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "--model-repository",
            str(model_repository),
            "--port",
            "0",
            "--roofline-profile",
            "B300",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown profile 'B300'" in done.stderr and "H200" in done.stderr


def test_no_profile_gives_achieved_rates_only(tmp_path: Path) -> None:
    roofs = Roofs(profile=None)
    path = save_graph(toy_models.mlp(), tmp_path / "1" / "model.onnx")
    stats = ModelStats()
    stats.record_execution(1, 2, 0, 1_000_000, 0)
    figures = roofs.figures(path, "mlp", "1", stats)
    assert set(figures) == {"weight_bytes", "achieved_flops_per_s", "achieved_bytes_per_s"}
