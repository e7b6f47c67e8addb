"""The router's HTTP front door with real clients against a real mesh (API keys on): the
official openai SDK (chat with SmolLM2's own template, streamed chat, completions, MiniLM
embeddings, models, an error for each status), tritonclient.http (infer JSON and binary,
metadata, config, stats), and a tenant's bill for streamed chats cut mid-way."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tokenizers import Tokenizer

from benchmarks import llm_genai_perf
from common.net import free_port
from common.tenancy import TenantPolicy
from devmesh import toy_models
from devmesh.processes import ROOT
from devmesh.testing import Mesh, mlp_config
from ledger.store import Store
from quantize import llm, pipeline, repository

pytestmark = pytest.mark.slow
CACHE = ROOT / "build" / "quantize"
MAX_BODY = 1 << 20
ALL = ("mlp", "minilm", "smollm2", "ghost")  # ghost: allowed, never served (404)


def build_repository(root: Path) -> Path:
    """mlp (priced per call), MiniLM fp32 and SmolLM2 int8: the models make run serves,
    built from the packaged weights (cached in build/quantize after the first build)."""
    toy_models.write(root / "mlp", toy_models.mlp(), mlp_config(max_batch=32))
    pipeline.export_model("minilm", CACHE)
    repository.install_model("minilm", [], CACHE, root)
    llm.build(root, llm.DEFAULT_RECIPE, CACHE)
    return root


@contextlib.contextmanager
def http_mesh(root: Path, *router_args: str) -> Iterator[tuple[Mesh, str, Store, Path]]:
    """Redis, a worker of build_repository's models, a router with its HTTP front door (keys
    on) and a ledger: the mesh, the front door's base URL, the ledger's store, the repo."""
    repo = build_repository(root / "repo")
    mesh = Mesh(root / "logs")
    mesh.auth = True
    mesh.start_redis()
    try:
        mesh.add_worker(repo)
        mesh.wait_registered(1, timeout=120)
        port = free_port()
        mesh.start_router("--http-port", str(port), "--auth-cache-seconds", "0.2", *router_args)
        store = Store(f"sqlite:///{root / 'ledger.db'}")
        mesh.start_ledger(store.url, "--interval-seconds", "0.1")
        yield mesh, f"http://127.0.0.1:{port}", store, repo
    finally:
        mesh.stop(kill=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str, Store]]:
    root = tmp_path_factory.mktemp("http")
    with http_mesh(root, "--http-max-body-bytes", str(MAX_BODY)) as (mesh, base, store, _):
        yield mesh, base, store


def key_for(mesh: Mesh, tenant: str, **policy: object) -> str:
    admin = mesh.tenant_admin()
    admin.set_tenant(tenant, TenantPolicy(**policy))  # type: ignore[arg-type]
    return admin.create_key(tenant)[1]


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def test_openai_sdk_chat_stream_completion_embeddings_models(served) -> None:  # type: ignore[no-untyped-def]
    mesh, base, _ = served
    client = sdk(base, key_for(mesh, "alice", models=("minilm", "smollm2")))
    story = [{"role": "user", "content": "Write a short story about a robot number 3."}]
    chat = client.chat.completions.create(
        model="smollm2", messages=story, max_tokens=24, temperature=0
    )
    # The template makes SmolLM2 answer (as raw text it ended at once: 1 token).
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    text = chat.choices[0].message.content or ""
    assert len(text) > 20 and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 24
    assert chat.usage.prompt_tokens > 20  # the system prompt the template adds, and the story
    # Streamed, and now a prefix-cache hit (the whole prompt, its first token from the kept row):
    # the cold call's greedy text, token for token, piece by piece, usage last, then [DONE].
    stream = client.chat.completions.create(
        model="smollm2",
        messages=story,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == chat.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    completion = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert completion.object == "text_completion" and completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    # Embeddings: the vectors gRPC gives for the same texts.
    texts = ["a robot", "the capital of France"]
    vectors = client.embeddings.create(model="minilm", input=texts)
    got = np.array([d.embedding for d in vectors.data], np.float32)
    assert got.shape == (2, 384)
    want = grpc_embeddings(mesh, texts, client.api_key)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # (the SDK asks for base64 itself when no format is given, and decodes it; asked by
    # name, it hands the string over)
    b64 = client.embeddings.create(model="minilm", input="a robot", encoding_format="base64")
    raw = base64.b64decode(str(b64.data[0].embedding))
    np.testing.assert_allclose(np.frombuffer(raw, np.float32), want[0], rtol=1e-5, atol=1e-6)
    # The tenant's models only, and one of them by name.
    assert sorted(m.id for m in client.models.list()) == ["minilm", "smollm2"]
    assert client.models.retrieve("minilm").id == "minilm"


def grpc_embeddings(mesh: Mesh, texts: list[str], key: str) -> np.ndarray:
    c = triton_grpc.InferenceServerClient(mesh.router_address)
    x = triton_grpc.InferInput("TEXT", [len(texts), 1], "BYTES")
    x.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    reply = c.infer("minilm", [x], headers={"authorization": f"Bearer {key}"})
    out = next(o["name"] for o in reply.get_response(as_json=True)["outputs"])
    return reply.as_numpy(out)


def test_an_error_for_each_status(served) -> None:  # type: ignore[no-untyped-def]
    mesh, base, _ = served
    key = key_for(mesh, "carol", models=ALL, requests_per_second=1, burst=1)
    client = sdk(base, key)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=hi, n=0)
    assert bad.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        sdk(base, "ms_nokey_secret").models.list()
    with pytest.raises(openai.AuthenticationError, match="API key"):
        sdk(base, "not-a-key").models.list()
    dave = sdk(base, key_for(mesh, "dave", models=("mlp",)))
    with pytest.raises(openai.PermissionDeniedError, match="may not call model 'smollm2'"):
        dave.chat.completions.create(model="smollm2", messages=hi, max_tokens=2)
    time.sleep(1.1)  # carol's bucket refilled
    with pytest.raises(openai.NotFoundError, match="ghost"):
        client.chat.completions.create(model="ghost", messages=hi, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as limited:
        for _ in range(5):
            client.chat.completions.create(model="smollm2", messages=hi, max_tokens=1)
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.APIStatusError) as big:
        sdk(base, key).embeddings.create(model="minilm", input="x" * (MAX_BODY + 10))
    assert big.value.status_code == 413
    # 503: a model whose only replica died (its heartbeat still in the registry).
    toy_models.write(mesh.log_dir / "lonely" / "mlp_lonely", toy_models.mlp(), mlp_config())
    lonely = mesh.add_worker(mesh.log_dir / "lonely")
    mesh.wait_registered(2, timeout=60)
    time.sleep(1.0)
    mesh.workers[lonely].kill()
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0] * 16}]}
    time.sleep(1.1)
    status, error = _post(base, "/v2/models/mlp_lonely/infer", body, key_for(mesh, "gina"))
    assert status == 503 and "UNAVAILABLE" in error["error"], error


def _post(base: str, path: str, body: dict, key: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tritonclient_http(served) -> None:  # type: ignore[no-untyped-def]
    mesh, base, _ = served
    headers = {"authorization": f"Bearer {key_for(mesh, 'erin', models=('mlp', 'minilm'))}"}
    c = triton_http.InferenceServerClient(base.removeprefix("http://"))
    assert c.is_server_live(headers=headers) and c.is_server_ready(headers=headers)
    assert c.is_model_ready("mlp", headers=headers)
    meta = c.get_model_metadata("minilm", headers=headers)
    # Every input, optional ones too (perf_analyzer looks each ModelConfig input up here).
    assert {t["name"] for t in meta["inputs"]} == {"TEXT", "input_ids", "attention_mask"}
    config = c.get_model_config("minilm", headers=headers)
    assert config["max_batch_size"] == 32 and isinstance(config["input"][0]["dims"][0], int)
    assert "meshserve.price_per_call_micro_usd" not in config.get("parameters", {})  # hidden
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    for binary in (False, True):
        i = triton_http.InferInput("INPUT0", [2, 16], "FP32")
        i.set_data_from_numpy(x, binary_data=binary)
        o = triton_http.InferRequestedOutput("OUTPUT0", binary_data=binary)
        got = c.infer("mlp", [i], outputs=[o], headers=dict(headers)).as_numpy("OUTPUT0")
        want = grpc_mlp(mesh, x, {"authorization": headers["authorization"]})
        np.testing.assert_allclose(got, want, rtol=1e-6)
    stats = c.get_inference_statistics("mlp", headers=headers)
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 2
    index = c.get_model_repository_index(headers=headers)
    assert {m["name"] for m in index} == {"mlp", "minilm"}  # the tenant's models only


def grpc_mlp(mesh: Mesh, x: np.ndarray, headers: dict) -> np.ndarray:
    c = triton_grpc.InferenceServerClient(mesh.router_address)
    i = triton_grpc.InferInput("INPUT0", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return c.infer("mlp", [i], headers=headers).as_numpy("OUTPUT0")


def _sse_chat(base: str, key: str, cut_after: int | None, max_tokens: int) -> dict:
    """One streamed chat over a raw socket with usage on every chunk; closed abruptly after
    `cut_after` content chunks. What it received: the last usage it read."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    reader = sock.makefile("rb")
    assert reader.readline().startswith(b"HTTP/1.1 200")
    usage: dict = {"prompt_tokens": 0, "completion_tokens": 0}
    content = 0
    while True:
        line = reader.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            content += 1
            if cut_after is not None and content >= cut_after:
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                break
    sock.close()
    return usage


def test_streamed_chats_cut_mid_way_bill_exactly_the_tokens_sent(served) -> None:  # type: ignore[no-untyped-def]
    mesh, base, store = served
    key = key_for(mesh, "frank", models=("smollm2",))
    received = [_sse_chat(base, key, cut, 40) for cut in (None, 3, None, 8, 1, None)]
    prompt = sum(u["prompt_tokens"] for u in received)
    completion = sum(u["completion_tokens"] for u in received)
    assert completion < 3 * 40 + 3 + 8 + 1 + 3  # the cut ones were cut
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        usage = store.tenant_usage().get(("frank", "smollm2"), {})
        if usage.get("completion_tokens") == completion and usage.get("prompt_tokens") == prompt:
            break
        time.sleep(0.2)
    time.sleep(1.5)  # and nothing more arrives later
    usage = store.tenant_usage()[("frank", "smollm2")]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, completion)
    assert usage["success"] == 3 and usage["errors"] == 3  # the cut ones are errors
    assert math.isfinite(usage["token_revenue_micro_usd"]) and usage["token_revenue_micro_usd"] > 0


# -- perf_analyzer and genai-perf, unmodified, over HTTP and gRPC -------------------------------


@pytest.fixture(scope="module")
def genai_perf_venv() -> Path:
    """genai-perf 0.0.16 and its perf_analyzer in their own venv, as benchmarks.llm installs
    them (this checkout's build/, else the main worktree's)."""
    here = ROOT / "build" / "genaiperf-venv"
    main = Path(subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True, text=True, check=False,
    ).stdout.strip() or ROOT).parent / "build" / "genaiperf-venv"  # fmt: skip
    venv = here if here.exists() or not main.exists() else main
    why = llm_genai_perf.ensure_venv(venv, ROOT / "build" / "genai-perf-install.log")
    assert why is None, why
    why = llm_genai_perf.ensure_libraries(venv)
    assert why is None, why
    return venv


def _tool(venv: Path, tool: str, *args: str, cwd: Path) -> str:
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(cwd),
        "LD_LIBRARY_PATH": llm_genai_perf.library_path(venv),
    }
    done = subprocess.run(
        [str(venv / "bin" / tool), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=cwd, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    # genai-perf ends on a long traceback; perf_analyzer's own complaint comes before it
    said = [line for line in out.splitlines() if re.search(r"error|fail|unavailable", line, re.I)]
    assert done.returncode == 0, "\n".join([*said[-12:], "...", out[-1500:]])
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_on_mlp_and_minilm(served, genai_perf_venv, protocol, tmp_path) -> None:  # type: ignore[no-untyped-def]
    mesh, base, _ = served
    key = key_for(mesh, f"perf-{protocol}", models=("mlp", "minilm"))
    url = base.removeprefix("http://") if protocol == "http" else mesh.router_address
    common = ["-u", url, "-i", protocol, "-H", f"authorization: Bearer {key}",
              "--concurrency-range", "2", "--measurement-mode", "count_windows",
              "--measurement-request-count", "40", "-s", "999", "--max-trials", "3"]  # fmt: skip
    out = _tool(genai_perf_venv, "perf_analyzer", "-m", "mlp", *common, cwd=tmp_path)
    assert "Concurrency: 2, throughput:" in out
    # MiniLM takes TEXT, its token inputs are the optional alternative: perf_analyzer fills
    # all three with synthetic data (the token inputs' sequence length given, as any model
    # with a variable dimension needs), and TEXT is served.
    out = _tool(
        genai_perf_venv, "perf_analyzer", "-m", "minilm", "--shape", "input_ids:16",
        "--shape", "attention_mask:16", *common, cwd=tmp_path,
    )  # fmt: skip
    assert "Concurrency: 2, throughput:" in out


def test_genai_perf_openai_chat_and_kserve_without_a_version(
    served, genai_perf_venv, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    mesh, base, _ = served
    key = key_for(mesh, "genai", models=("smollm2",))
    source = pipeline.artifact_for(CACHE, "smollm2", llm.DEFAULT_RECIPE).tokenizer
    tokenizer = llm_genai_perf.tokenizer_dir(
        Tokenizer.from_file(str(source)), tmp_path / "tokenizer", "<|im_end|>", "<|im_start|>"
    )
    common = ["-m", "smollm2", "--streaming", "--tokenizer", str(tokenizer),
              "--concurrency", "1", "--request-count", "3", "--warmup-request-count", "1",
              "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0",
              "--output-tokens-mean", "8", "--output-tokens-stddev", "0",
              "-H", f"authorization: Bearer {key}"]  # fmt: skip
    for endpoint, url in (
        (["--endpoint-type", "chat"], base.removeprefix("http://")),
        (["--endpoint-type", "kserve", "--backend", "vllm"], mesh.router_address),
    ):
        artifacts = tmp_path / endpoint[1]
        _tool(genai_perf_venv, "genai-perf", "profile", *common, *endpoint, "-u", url,
              "--artifact-dir", str(artifacts), cwd=tmp_path)  # fmt: skip
        report = json.loads(next(artifacts.rglob("*genai_perf.json")).read_text())
        assert report["request_throughput"]["avg"] > 0
        assert report["output_sequence_length"]["avg"] > 0
