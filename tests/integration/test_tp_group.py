"""Shard groups as real processes: gloo ranks behind `python -m worker --tp N`, the router,
a killed rank and the restart, a hung rank, the per-rank memory budget. The decoder is
served by the LLM engine over the group (Triton's vLLM-backend tensors, streamed): its text
equals the unsharded engine's (TP1)."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from common import health, mesh_state
from common.mesh_state import WorkerInfo
from devmesh.processes import Process, free_port, wait_serving
from devmesh.testing import Mesh
from quantize import llm_graph, llm_shard, shard, weights
from quantize.models import BertEncoder, EncoderConfig
from tests.integration.test_llm import inputs, text_of
from tests.worker.llm.test_tp_engine import tp_decoder
from worker import config as cfg
from worker.llm.engine import EngineConfig
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions
from worker.tp.local import run_engine

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BertEncoder, str]:
    """A random encoder (6 heads) sharded for TP 1 and 2, and a random decoder (6 heads,
    2 KV heads) as the LLM engine's shard sets for TP 1 and 2, with SmolLM2's tokenizer;
    and the text the unsharded engine generates for PROMPT."""
    from gguf import GGUFReader

    torch.manual_seed(0)
    enc = BertEncoder(
        EncoderConfig(vocab_size=64, hidden=48, layers=2, heads=6, intermediate=96)
    ).eval()
    root = tmp_path_factory.mktemp("tp-repo")
    (root / "enc").mkdir()
    (root / "enc" / "config.pbtxt").write_text(
        # a long batching window: concurrent calls always meet in one group-wide run
        cfg.config_text("enc", 8, 100_000, {})
    )
    for tp in (1, 2):
        shard.write_shards(enc, "enc", root / "enc", tp)
    dec = tp_decoder()
    tokenizer = weights.gguf_tokenizer(GGUFReader(str(weights.smollm2_gguf())))
    llm_shard.write_model(dec, tokenizer, "dec", root, [1, 2], 512, max_model_len=256)
    step = llm_graph.save(llm_graph.build(dec, 512), root.parent / "dec-step.onnx")
    model = StepModel.load(step, RuntimeOptions(intra_op_threads=1), ["CPUExecutionProvider"])
    request = {"text": PROMPT, "max_tokens": GREEDY["max_tokens"]}
    out = asyncio.run(run_engine(model, tokenizer, EngineConfig(max_model_len=256), [[request]]))
    return root, enc, out["results"][0][0]["text"]


def ranks_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def check_answers(address: str, enc: BertEncoder, tp1_text: str) -> None:
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
    # (the router answers a stream's request with one response: the whole text)
    assert "".join(stream("dec", address, PROMPT)) == tp1_text


def stream(model: str, address: str, text: str) -> list[str]:
    """The pieces of one streamed generation (tritonclient, decoupled ModelStreamInfer)."""
    results: queue.Queue = queue.Queue()
    client = triton.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            model, inputs(text, True, GREEDY), enable_empty_final_response=True
        )
        pieces = []
        for _ in range(1000):
            result, error = results.get(timeout=60)
            assert error is None, error
            pieces.append(text_of(result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return pieces
        raise AssertionError("no final response")
    finally:
        client.stop_stream()
        client.close()


def test_router_to_tp_group_killed_rank_and_restart(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, tp1_text = tiny
    address = mesh.add_worker(root, "--tp", "2", "--tp-timeout-seconds", "3")
    router = mesh.start_router()
    mesh.wait_registered(1)
    client = mesh.redis_client()
    (worker_id,) = client.zrange(mesh_state.WORKERS, 0, -1)
    info = WorkerInfo.from_json(client.get(mesh_state.worker_key(worker_id)))
    assert info.tp == 2 and info.address == address
    assert sorted(info.models) == ["dec", "enc"]
    check_answers(router, enc, tp1_text)
    pieces = stream("dec", address, PROMPT)  # from the group itself: one response per piece
    assert len(pieces) > 2 and "".join(pieces) == tp1_text
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
        check_answers(router, enc, tp1_text)
    assert time.monotonic() - start < 30
    assert "UNAVAILABLE" in str(error.value.status())

    worker.start()  # what the launcher's supervise loop does
    wait_serving(address, worker)
    mesh.wait_registered(1)
    # The router takes the group back once it has read the new registration and its health
    # check re-admits the ejected address: within a few seconds, not at once.
    deadline = time.monotonic() + 30
    while True:
        try:
            check_answers(router, enc, tp1_text)
            break
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_group_across_hosts_ranks_started_apart(mesh: Mesh, tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """As the Kubernetes tp overlay runs it: each rank is its own `python -m worker`
    (--tp-rank R, one pod each), rank 0 starts none and listens on --tp-master-port; a
    rank that dies fails the group."""
    root, enc, tp1_text = tiny
    master, rank1_port = free_port(), free_port()
    rank1 = Process(
        "rank1",
        [
            sys.executable, "-m", "worker", "--model-repository", str(root), "--tp", "2",
            "--tp-rank", "1", "--tp-master-port", str(master), "--host", "127.0.0.1",
            "--port", str(rank1_port), "--providers", "cpu", "--intra-op-threads", "1",
        ],
        tmp_path / "rank1.log",
    ).start()  # fmt: skip
    mesh.others.append(rank1)
    address = mesh.add_worker(
        root, "--tp", "2", "--tp-master-port", str(master), "--tp-timeout-seconds", "3"
    )
    worker = mesh.workers[address]
    assert worker.popen is not None and ranks_of(worker.popen.pid) == []  # none spawned
    with grpc.insecure_channel(f"127.0.0.1:{rank1_port}") as channel:
        assert health.check(channel) == "SERVING"  # rank 1's own probe: it has joined
    check_answers(address, enc, tp1_text)
    rank1.kill()
    assert worker.popen.wait(15) == 3  # the group failed; the worker left and exited


def test_hung_rank_fails_the_group_within_the_timeout(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, tp1_text = tiny
    address = mesh.add_worker(root, "--tp", "2", "--tp-timeout-seconds", "2")
    worker = mesh.workers[address]
    assert worker.popen is not None
    (rank1,) = ranks_of(worker.popen.pid)
    subprocess.run(["kill", "-STOP", str(rank1)], check=True)
    try:
        client = triton.InferenceServerClient(address)
        start = time.monotonic()
        with pytest.raises(InferenceServerException):
            client.infer("dec", inputs(PROMPT, False, GREEDY), client_timeout=4)
        assert time.monotonic() - start < 4.5  # never past the caller's deadline
        assert worker.popen.wait(10) == 3
    finally:
        subprocess.run(["kill", "-9", str(rank1)], check=False)


def test_over_budget_refused_unsharded_and_served_with_tp(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, tp1_text = tiny
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
    check_answers(address, enc, tp1_text)
    # dynamic batching as in a single-process worker: 4 concurrent calls, fewer executions
    client = triton.InferenceServerClient(address)
    feeds = []
    for name in ("input_ids", "attention_mask"):
        feeds.append(triton.InferInput(name, [1, 3], "INT64"))
        feeds[-1].set_data_from_numpy(np.array([[1, 2, 3]], np.int64))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: client.infer("enc", feeds, client_timeout=30), range(4)))
    (stats,) = client.get_inference_statistics("enc", as_json=True)["model_stats"]
    assert int(stats["inference_count"]) >= int(stats["execution_count"]) + 2


def test_bad_input_fails_its_request_not_the_group(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    root, enc, tp1_text = tiny
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
    check_answers(address, enc, tp1_text)
    assert worker.popen.poll() is None and ranks_of(worker.popen.pid) == ranks


def test_ranks_die_with_a_killed_leader(mesh: Mesh, tiny) -> None:  # type: ignore[no-untyped-def]
    """A rank arms its own parent-death signal at start (no Python runs in the forked child,
    where gRPC's threads could make it abort): kill -9 of the leader takes the ranks along."""
    root, _, _ = tiny
    address = mesh.add_worker(root, "--tp", "2")
    worker = mesh.workers[address]
    assert worker.popen is not None
    (rank1,) = ranks_of(worker.popen.pid)
    worker.popen.kill()
    worker.popen.wait(10)
    deadline = time.monotonic() + 10
    while alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank1)


def alive(pid: int) -> bool:
    """Running (a zombie not yet reaped by its new parent is dead)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
