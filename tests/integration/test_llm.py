"""SmolLM2-135M (int8, built from the packaged weights) served by the engine in a real
worker process, called the way Triton vLLM-backend clients call it (tritonclient streams)."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families

from common.mesh_state import DepthSample
from common.net import free_port
from devmesh.testing import Mesh

pytestmark = pytest.mark.slow
MODEL = "smollm2"


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def served(
    llm_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Mesh]]:
    mesh = Mesh(tmp_path_factory.mktemp("llm-logs"))
    mesh.start_redis()
    try:
        address = mesh.add_worker(llm_repository, "--metrics-port", str(METRICS_PORT))
        yield address, mesh
    finally:
        mesh.stop(kill=True)


def inputs(text: str, stream: bool, sampling: dict | str | None = None) -> list[triton.InferInput]:
    tensors = []
    x = triton.InferInput("text_input", [1], "BYTES")
    x.set_data_from_numpy(np.array([text.encode()], dtype=object))
    tensors.append(x)
    s = triton.InferInput("stream", [1], "BOOL")
    s.set_data_from_numpy(np.array([stream]))
    tensors.append(s)
    if sampling is not None:
        p = triton.InferInput("sampling_parameters", [1], "BYTES")
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        p.set_data_from_numpy(np.array([raw.encode()], dtype=object))
        tensors.append(p)
    exclude = triton.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]))
    tensors.append(exclude)
    return tensors


class Stream:
    """One tritonclient stream; `ask` sends a request and returns its results in order."""

    def __init__(self, address: str) -> None:
        self.client = triton.InferenceServerClient(address)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def ask(self, text: str, sampling: dict | str | None, stream: bool = True, **kw) -> list:  # type: ignore[no-untyped-def]
        self.client.async_stream_infer(
            MODEL, inputs(text, stream, sampling), enable_empty_final_response=True, **kw
        )
        got = []
        while True:
            result, error = self.results.get(timeout=120)
            got.append((result, error))
            if error is not None:
                return got
            final = result.get_response().parameters["triton_final_response"].bool_param
            if final:
                return got

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def text_of(result) -> str:  # type: ignore[no-untyped-def]
    out = result.as_numpy("text_output")
    return "" if out is None else b"".join(out.reshape(-1)).decode()


GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def test_streamed_pieces_concatenate_to_the_whole_text(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    stream = Stream(address)
    try:
        pieces = stream.ask("The capital of France is", GREEDY)
        assert all(e is None for _, e in pieces)
        texts = [text_of(r) for r, _ in pieces]
        assert len(texts) > 5  # one response per piece, then the empty final one
        assert texts[-1] == "" and pieces[-1][0].as_numpy("text_output") is None
        whole = stream.ask("The capital of France is", GREEDY, stream=False)
        assert len(whole) == 1
        assert "".join(texts) == text_of(whole[0][0])
        assert "Paris" in "".join(texts)
        final = pieces[-1][0].get_response().parameters
        assert final["completion_tokens"].int64_param == 24
        assert final["prompt_tokens"].int64_param == 5
        assert final["finish_reason"].string_param == "length"
    finally:
        stream.close()
    # ModelInfer on the decoupled model answers the whole text too
    client = triton.InferenceServerClient(address)
    result = client.infer(MODEL, inputs("The capital of France is", False, GREEDY))
    assert text_of(result) == "".join(texts)


def test_sampling_values_as_json_strings_and_request_parameters(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    stream = Stream(address)
    try:
        # genai-perf's form: every value a string
        a = stream.ask(
            "Once upon a time", {"max_tokens": "6", "temperature": "0", "ignore_eos": "true"}
        )
        b = stream.ask(
            "Once upon a time",
            None,
            parameters={"max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        assert a[-1][0].get_response().parameters["completion_tokens"].int64_param == 6
        assert "".join(text_of(r) for r, _ in a) == "".join(text_of(r) for r, _ in b)
        seeded = {
            "max_tokens": 16,
            "temperature": 0.9,
            "top_p": 0.9,
            "seed": 42,
            "ignore_eos": True,
        }
        c = stream.ask("Once upon a time", seeded)
        d = stream.ask("Once upon a time", seeded)
        assert "".join(text_of(r) for r, _ in c) == "".join(text_of(r) for r, _ in d)
    finally:
        stream.close()


@pytest.mark.parametrize(
    ("sampling", "names"),
    [
        ({"max_tokens": 8, "temprature": 0.5}, "temprature"),
        ('{"max_tokens": 8,', "not valid JSON"),
        ({"temperature": -1}, "'temperature' = -1.0: must be >= 0"),
        ({"top_p": 0}, "'top_p' = 0.0: must be in (0, 1]"),
        ({"top_p": 1.5}, "'top_p' = 1.5: must be in (0, 1]"),
        ({"max_tokens": 0}, "'max_tokens' = 0: must be >= 1"),
        ({"max_tokens": 100000}, "'max_tokens' = 100000: must be >= 1 and <= 2047"),
        ({"max_tokens": "many"}, "'max_tokens': expected a number"),
    ],
)
def test_bad_sampling_input_is_named_and_the_stream_stays_usable(served, sampling, names) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    stream = Stream(address)
    try:
        got = stream.ask("Hello", sampling)
        error = got[-1][1]
        assert error is not None and names in str(error)
        ok = stream.ask("Hello", {"max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert ok[-1][1] is None
    finally:
        stream.close()


def test_prompt_over_max_model_len_is_refused_with_both_numbers(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    client = triton.InferenceServerClient(address)
    with pytest.raises(triton.InferenceServerException) as e:
        client.infer(MODEL, inputs("word " * 3000, False, {"max_tokens": 4}))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert re.search(r"prompt is 300\d tokens; max_model_len is 2048", e.value.message())


def test_cancelled_stream_frees_its_kv_cache(served) -> None:  # type: ignore[no-untyped-def]
    address, mesh = served
    redis = mesh.redis_client()

    def kv() -> tuple[int, int]:
        worker = redis.zrange("meshserve:workers", 0, -1)[0]
        sample = DepthSample.decode(redis.get(f"meshserve:depth:{worker}"))
        return sample.kv_used, sample.kv_total

    client = triton.InferenceServerClient(address)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(result))
    client.async_stream_infer(
        MODEL, inputs("Tell me a long story.", True, {"max_tokens": 1500, "ignore_eos": True})
    )
    got.get(timeout=60)  # generating
    deadline = time.monotonic() + 10
    while kv()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    used, total = kv()
    assert used >= 1500 and total >= used
    client.stop_stream(cancel_requests=True)  # the client goes away mid-generation
    deadline = time.monotonic() + 10
    while kv()[0] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv() == (0, total)
    client.close()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the worker's Prometheus endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_worker_metrics_count_tokens_time_and_kv(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    key = (("model", MODEL), ("version", "1"))
    before = scrape(METRICS_PORT)
    stream = Stream(address)
    try:
        pieces = stream.ask("The capital of France is", {**GREEDY, "max_tokens": 10})
    finally:
        stream.close()
    assert pieces[-1][1] is None
    after = scrape(METRICS_PORT)

    def delta(name: str, *labels: tuple[str, str]) -> float:
        k = (name, tuple(sorted(labels)))
        return after[k] - before.get(k, 0.0)

    assert delta("meshserve_worker_tokens_total", *key, ("kind", "out")) == 10
    assert delta("meshserve_worker_tokens_total", *key, ("kind", "in")) == 5
    assert delta("meshserve_worker_time_to_first_token_seconds_count", ("model", MODEL)) == 1
    # one observation per later piece: 9 tokens after the first, one or more per piece
    assert 1 <= delta("meshserve_worker_inter_token_seconds_count", ("model", MODEL)) <= 9

    def now(name: str, *labels: tuple[str, str]) -> float:
        return after[(name, tuple(sorted(labels)))]

    assert now("meshserve_worker_kv_cache_tokens", *key, ("state", "total")) > 0
    assert now("meshserve_worker_kv_cache_tokens", *key, ("state", "used")) == 0
    assert now("meshserve_worker_sequences", *key, ("state", "running")) == 0
    loaded = [k for k in after if k[0] == "meshserve_worker_model_loaded"]
    assert loaded == [
        (
            "meshserve_worker_model_loaded",
            tuple(sorted((*key, ("provider", "CPUExecutionProvider")))),
        )
    ]
    # labels name served models only
    models = {dict(labels).get("model") for _, labels in after} - {None}
    assert models == {MODEL}
