"""Shard groups as real processes: gloo ranks behind `python -m worker --tp N`, the router,
a killed rank and the restart, a hung rank, the per-rank memory budget."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from common import mesh_state
from common.mesh_state import WorkerInfo
from deploy.processes import wait_serving
from quantize import shard
from quantize.models import BertEncoder, DecoderConfig, EncoderConfig, LlamaDecoder, greedy
from tests.integration.mesh import Mesh
from worker import config as cfg

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BertEncoder, LlamaDecoder]:
    """A random encoder (6 heads) and decoder (4 heads, 2 KV heads) sharded for TP 1 and 2."""
    torch.manual_seed(0)
    enc = BertEncoder(
        EncoderConfig(vocab_size=64, hidden=48, layers=2, heads=6, intermediate=96)
    ).eval()
    dec = LlamaDecoder(
        DecoderConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    ).eval()
    root = tmp_path_factory.mktemp("tp-repo")
    for name, model in (("enc", enc), ("dec", dec)):
        (root / name).mkdir()
        (root / name / "config.pbtxt").write_text(
            # a long batching window: concurrent calls always meet in one group-wide run
            cfg.config_text(name, 8, 100_000, {cfg.MAX_NEW_TOKENS: str(NEW_TOKENS)})
        )
        for tp in (1, 2):
            shard.write_shards(model, name, root / name, tp)
    return root, enc, dec


def ranks_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def check_answers(address: str, enc: BertEncoder, dec: LlamaDecoder) -> None:
    client = triton.InferenceServerClient(address)
    ids = np.array([[1, 5, 9, 2, 7], [3, 3, 8, 1, 0]], np.int64)
    mask = np.ones_like(ids)
    mask[1, 4] = 0
    x = triton.InferInput("input_ids", list(ids.shape), "INT64")
    x.set_data_from_numpy(ids)
    m = triton.InferInput("attention_mask", list(ids.shape), "INT64")
    m.set_data_from_numpy(mask)
    got = client.infer("enc", [x, m], client_timeout=30).as_numpy("sentence_embedding")
    with torch.no_grad():
        want = enc(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    tokens = client.infer("dec", [x], client_timeout=30).as_numpy("output_ids")
    for row in range(2):
        assert tokens[row].tolist() == greedy(dec, torch.from_numpy(ids[row : row + 1]), NEW_TOKENS)


def test_router_to_tp_group_killed_rank_and_restart(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, dec = tiny
    address = mesh.add_worker(root, "--tp", "2", "--tp-timeout-seconds", "3")
    router = mesh.start_router()
    mesh.wait_registered(1)
    client = mesh.redis_client()
    (worker_id,) = client.zrange(mesh_state.WORKERS, 0, -1)
    info = WorkerInfo.from_json(client.get(mesh_state.worker_key(worker_id)))
    assert info.tp == 2 and info.address == address
    assert sorted(info.models) == ["dec", "enc"]
    check_answers(router, enc, dec)
    params = triton.InferenceServerClient(router).get_model_config("enc").config.parameters
    assert params["meshserve.tp"].string_value == "2"
    assert params["meshserve.tp.backend"].string_value == "gloo"
    assert int(params["meshserve.tp.rank1.weight_bytes"].string_value) > 0
    assert int(params["meshserve.tp.rank1.rss_bytes"].string_value) > 0

    worker = mesh.workers[address]
    assert worker.popen is not None
    (rank1,) = ranks_of(worker.popen.pid)
    subprocess.run(["kill", "-9", str(rank1)], check=True)
    assert worker.popen.wait(10) == 3  # the group failed; the worker left and exited
    assert client.zcard(mesh_state.WORKERS) == 0
    time.sleep(0.3)  # the router's next registry read
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as error:
        check_answers(router, enc, dec)
    assert time.monotonic() - start < 30
    assert "UNAVAILABLE" in str(error.value.status())

    worker.start()  # what the launcher's supervise loop does
    wait_serving(address, worker)
    mesh.wait_registered(1)
    check_answers(router, enc, dec)


def test_hung_rank_fails_the_group_within_the_timeout(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, dec = tiny
    address = mesh.add_worker(root, "--tp", "2", "--tp-timeout-seconds", "2")
    worker = mesh.workers[address]
    assert worker.popen is not None
    (rank1,) = ranks_of(worker.popen.pid)
    subprocess.run(["kill", "-STOP", str(rank1)], check=True)
    try:
        client = triton.InferenceServerClient(address)
        x = triton.InferInput("input_ids", [1, 3], "INT64")
        x.set_data_from_numpy(np.array([[1, 2, 3]], np.int64))
        start = time.monotonic()
        with pytest.raises(InferenceServerException):
            client.infer("dec", [x], client_timeout=4)
        assert time.monotonic() - start < 4.5  # never past the caller's deadline
        assert worker.popen.wait(10) == 3
    finally:
        subprocess.run(["kill", "-9", str(rank1)], check=False)


def test_over_budget_refused_unsharded_and_served_with_tp(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, dec = tiny
    sets = {
        tp: [
            shard.json.loads((root / n / "1" / f"tp{tp}" / "manifest.json").read_text())
            for n in ("enc", "dec")
        ]
        for tp in (1, 2)
    }
    tp1 = max(r["weight_bytes"] for m in sets[1] for r in m["ranks"])
    tp2 = max(r["weight_bytes"] for m in sets[2] for r in m["ranks"])
    budget = (tp1 + tp2) // 2
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "--model-repository",
            str(root),
            "--tp",
            "1",
            "--providers",
            "cpu",
            "--memory-budget-bytes",
            str(budget),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert f"budget of {budget} bytes" in refused.stderr
    assert "unsharded needs" in refused.stderr and "shard it with TP 2" in refused.stderr
    address = mesh.add_worker(root, "--tp", "2", "--memory-budget-bytes", str(budget))
    check_answers(address, enc, dec)
    # dynamic batching as in a single-process worker: 4 concurrent calls, fewer executions
    client = triton.InferenceServerClient(address)
    x = triton.InferInput("input_ids", [1, 3], "INT64")
    x.set_data_from_numpy(np.array([[1, 2, 3]], np.int64))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: client.infer("dec", [x], client_timeout=30), range(4)))
    (stats,) = client.get_inference_statistics("dec", as_json=True)["model_stats"]
    assert int(stats["inference_count"]) >= int(stats["execution_count"]) + 2


def test_bad_input_fails_its_request_not_the_group(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, dec = tiny
    address = mesh.add_worker(root, "--tp", "2", "--tp-timeout-seconds", "3")
    worker = mesh.workers[address]
    assert worker.popen is not None
    ranks = ranks_of(worker.popen.pid)
    client = triton.InferenceServerClient(address)
    config = client.get_model_config("enc").config
    assert config.parameters["meshserve.vocab_size.input_ids"].string_value == "64"

    def call(ids: np.ndarray, mask: np.ndarray) -> str:
        x = triton.InferInput("input_ids", list(ids.shape), "INT64")
        x.set_data_from_numpy(ids)
        m = triton.InferInput("attention_mask", list(mask.shape), "INT64")
        m.set_data_from_numpy(mask)
        with pytest.raises(InferenceServerException) as error:
            client.infer("enc", [x, m], client_timeout=30)
        assert str(error.value.status()) == "StatusCode.INVALID_ARGUMENT", error.value.message()
        return error.value.message()

    # Out of the vocabulary: refused before the group sees it (a rank used to crash: exit 3).
    for bad in (64, -1):
        ids = np.array([[1, bad, 3]], np.int64)
        message = call(ids, np.ones_like(ids))
        assert f"token id {bad} at [0, 1] is outside the vocabulary 0..63" in message
    # Past the codec, failing inside every rank's forward: that request fails, the group goes on.
    message = call(np.ones((1, 5), np.int64), np.ones((1, 4), np.int64))
    assert "model 'enc' cannot run on this input" in message
    check_answers(address, enc, dec)
    assert worker.popen.poll() is None and ranks_of(worker.popen.pid) == ranks
