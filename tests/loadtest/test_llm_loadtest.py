"""The load tool's LLM mode: prompts and the per-token numbers as units (fake outcomes, no
server), then closed and open loops and the CLI against a real worker process serving the
real SmolLM2 engine (slow: it loads the model)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devmesh.processes import free_port
from loadtest.llm import prompts
from loadtest.llm.prompts import Prompt
from loadtest.llm.runner import LLMLoad, closed_loop, open_loop
from loadtest.llm.stats import LLMRecorder
from loadtest.llm.stream import Outcome, build_request
from tests.conftest import WorkerProcess, start_worker

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"


def test_prompts_from_text_and_jsonl(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\n  second one\n")
    assert [p.text for p in prompts.from_file(text)] == ["first prompt", "  second one"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"plain"\n{"text": "a", "max_tokens": 3}\n{"prompt": "b"}\n')
    assert prompts.from_file(jsonl) == [Prompt("plain"), Prompt("a", 3), Prompt("b")]
    jsonl.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        prompts.from_file(jsonl)
    jsonl.write_text('"ok"\nnot json\n')
    with pytest.raises(ValueError, match="p.jsonl:2: not JSON"):
        prompts.from_file(jsonl)


def test_synthetic_prompts_are_real_text_of_varied_lengths() -> None:
    sizes = prompts.lengths(40, 10, 20, seed=1)
    assert len(set(sizes)) > 5 and min(sizes) >= 1
    made = prompts.synthetic(sizes, seed=1)
    assert len({p.text for p in made}) == 20
    words = [len(p.text.split()) for p in made]
    assert all(
        abs(w - round(n / prompts.TOKENS_PER_WORD)) <= 1 for w, n in zip(words, sizes, strict=True)
    )
    assert all(p.text.isprintable() for p in made)


def test_request_carries_the_vllm_backend_tensors() -> None:
    r = build_request("m", "hi", {"max_tokens": 4, "ignore_eos": True}, request_id="7")
    assert [i.name for i in r.inputs] == [
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
    ]
    assert [i.datatype for i in r.inputs] == ["BYTES", "BOOL", "BYTES", "BOOL"]
    assert json.loads(r.raw_input_contents[2][4:]) == {"max_tokens": 4, "ignore_eos": True}
    assert r.parameters["triton_enable_empty_final_response"].bool_param is True
    counted = build_request("m", "hi", {}, return_token_counts=True)
    assert {"return_num_input_tokens", "return_num_output_tokens"} <= {
        i.name for i in counted.inputs
    }


def outcome(start: float, pieces: list[float], end: float, **kw) -> Outcome:  # type: ignore[no-untyped-def]
    return Outcome(start, end, pieces, text="x" * len(pieces), **kw)


def test_ttft_itl_and_tokens_per_second() -> None:
    r = LLMRecorder()
    # one token a piece: every gap is one token's ITL
    r.add(outcome(10.0, [10.1, 10.2, 10.4], 10.5, completion_tokens=3, prompt_tokens=5), "p")
    # 7 tokens in 3 pieces, no per-piece counts: gaps spread over (7 - 1) / 2 tokens each
    r.add(outcome(10.2, [10.5, 10.8, 11.1], 11.2, completion_tokens=7, prompt_tokens=5), "p")
    # per-piece counts from the server (num_output_tokens): exact per token
    exact = outcome(10.3, [10.4, 10.6], 10.6, piece_tokens=[1, 2], completion_tokens=3)
    r.add(exact, "p")
    r.add(Outcome(10.4, 10.9, error="DEADLINE_EXCEEDED"), "p")
    s = r.summary()
    assert s["requests"] == 3 and s["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert s["output_tokens"] == 13 and s["prompt_tokens_total"] == 10
    assert s["seconds"] == pytest.approx(1.2)  # first start 10.0 to last end 11.2
    assert s["output_tokens_per_s"] == pytest.approx(13 / 1.2, rel=1e-3)
    assert r.summary(window_start=9.8)["seconds"] == pytest.approx(1.4)  # the window opened
    assert r.summary(9.8, window_end=12.0)["seconds"] == pytest.approx(2.2)  # schedule ended
    assert s["ttft_ms"]["max"] == pytest.approx(300, rel=0.01)
    itl = sorted(r.itl.histogram.get_value_at_percentile(p) / 1000 for p in (1, 100))
    assert itl == [pytest.approx(100, rel=0.01), pytest.approx(200, rel=0.01)]
    assert r.itl.count == 2 + 2 + 2  # 2 gaps, 2 gaps, 1 gap of 2 tokens
    assert s["itl_ms"]["p50"] == pytest.approx(100, rel=0.01)
    assert s["stream_tokens_per_s"]["max"] == pytest.approx(3 / 0.3, rel=0.01)
    assert s["token_source"] == {"server": 3} and s["itl_unit"] == "token"
    rows = s["per_request"]
    assert [row["start_s"] for row in rows] == pytest.approx([0, 0.2, 0.3, 0.4])
    assert rows[3]["error"] == "DEADLINE_EXCEEDED" and rows[0]["ttft_ms"] == pytest.approx(100)


def test_each_request_row_has_its_own_mean_itl() -> None:
    r = LLMRecorder()
    r.add(outcome(0.0, [0.1, 0.2, 0.4], 0.5, completion_tokens=3), "p")  # 0.3 s / 2 tokens
    r.add(outcome(1.0, [1.1, 1.4], 1.4, piece_tokens=[2, 2], completion_tokens=4), "p")
    r.add(outcome(2.0, [2.1], 2.1, completion_tokens=1), "p")  # one piece: no ITL
    rows = r.summary()["per_request"]
    assert rows[0]["itl_ms"] == pytest.approx(150)
    assert rows[1]["itl_ms"] == pytest.approx(150)  # 0.3 s over the 2 tokens after the first piece
    assert rows[2]["itl_ms"] is None


class Words:
    """A tokenizer that counts words (what LLMRecorder asks of one)."""

    def encode(self, text: str, add_special_tokens: bool = True):  # type: ignore[no-untyped-def]
        class Encoding:
            ids = text.split()

        return Encoding()


def test_counting_by_tokenizer_ignores_the_servers_counts() -> None:
    words = Words()
    served = LLMRecorder(words)  # type: ignore[arg-type]
    ours = LLMRecorder(words, count="tokenizer")  # type: ignore[arg-type]
    for r in (served, ours):
        out = Outcome(0.0, 0.5, [0.1, 0.3], text="one two three four five")
        out.completion_tokens, out.prompt_tokens, out.piece_tokens = 2, 9, [1, 1]
        r.add(out, "a short prompt")
    s, o = served.summary(), ours.summary()
    assert (s["output_tokens"], s["prompt_tokens_total"], s["token_source"]) == (
        2,
        9,
        {"server": 1},
    )
    assert (o["output_tokens"], o["prompt_tokens_total"], o["token_source"]) == (
        5,
        3,
        {"tokenizer": 1},
    )
    assert o["per_request"][0]["itl_ms"] == pytest.approx(50)  # 0.2 s over 4 tokens
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLMRecorder(count="tokenizer")
    with pytest.raises(ValueError, match="count: expected one of"):
        LLMRecorder(words, count="usage")  # type: ignore[arg-type]


def test_cli_count_tokens_by_tokenizer_needs_one(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.llm import cli

    argv = ["--llm", "--model", "m", "--prompt-len", "4", "--max-tokens", "2"]
    with pytest.raises(SystemExit):
        cli.parse_args([*argv, "--count-tokens", "tokenizer"])
    assert "--count-tokens tokenizer needs --tokenizer" in capsys.readouterr().err
    assert cli.parse_args(argv).count_tokens == "server"


def test_without_usage_or_tokenizer_pieces_stand_for_tokens() -> None:
    r = LLMRecorder()
    r.add(outcome(0.0, [0.1, 0.3], 0.3), "p")
    s = r.summary()
    assert s["token_source"] == {"pieces": 1} and s["itl_unit"] == "piece"
    assert s["output_tokens"] == 2


def test_unreachable_server_counts_unavailable() -> None:
    load = LLMLoad(f"127.0.0.1:{free_port()}", MODEL, [Prompt("x")], 4, timeout=2.0)
    load.duration, load.max_requests = 5.0, 3
    result = asyncio.run(closed_loop(load, concurrency=1))
    assert result["requests"] == 0 and result["errors"] == {"UNAVAILABLE": 3}


@pytest.fixture(scope="module")
def llm_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Path]]:
    """A worker serving the real SmolLM2 engine, and its model repository."""
    from quantize import llm

    root = tmp_path_factory.mktemp("llm-repo")
    llm.build(root, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    worker = start_worker(root, tmp_path_factory.mktemp("llm-worker"))
    yield worker, root
    worker.process.kill()
    worker.process.wait(10)


GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.mark.slow
def test_cli_closed_loop_against_the_real_model(llm_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    worker, repository = llm_worker
    out = tmp_path / "llm.json"
    tokenizer = repository / MODEL / "tokenizer.json"
    args = ["--llm", "--address", worker.address, "--model", MODEL, "--max-tokens", "8"]
    args += ["--prompt-len", "24", "--prompt-len-stddev", "6", "--tokenizer", str(tokenizer)]
    args += ["--concurrency", "2", "--max-requests", "4", "--duration", "30", "--quiet"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            *args,
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["llm"] is True and result["mode"] == "closed"
    (run,) = result["runs"]
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert {"p50", "p90", "p99"} <= set(run[key]) and run[key]["p50"] > 0
    assert {"stream_tokens_per_s", "output_tokens_per_s", "prompt_tokens", "errors"} <= set(run)
    assert run["concurrency"] == 2 and run["requests"] == 4 and not run["errors"]
    assert run["output_tokens"] == 4 * 8 and run["output_tokens_per_s"] > 0
    assert run["token_source"] == {"server": 4} and run["itl_unit"] == "token"
    for row in run["per_request"]:
        assert 0 < row["ttft_ms"] <= row["e2e_ms"], row
        assert row["completion_tokens"] == 8 and row["finish_reason"] == "length"
        assert 12 <= row["prompt_tokens"] <= 40  # ~24 tokens of real text, varied
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
    assert "c=2" in proc.stdout and "out tok/s" in proc.stdout


@pytest.mark.slow
def test_open_loop_and_errors_by_code_against_the_real_model(llm_worker) -> None:  # type: ignore[no-untyped-def]
    address = llm_worker[0].address
    few = [Prompt("The capital of France is"), Prompt("Once upon a time", 4)]
    load = LLMLoad(address, MODEL, few, 6, sampling=GREEDY, duration=1.0)
    opened = asyncio.run(open_loop(load, rate=3.0, seed=2))
    assert opened["requests"] >= 1 and not opened["errors"], opened["errors"]
    assert opened["client_limited"] is False, opened["client"]
    assert opened["seconds"] >= 1.0  # the whole scheduled window, however quiet
    tokens = sorted({row["completion_tokens"] for row in opened["per_request"]})
    assert set(tokens) <= {4, 6}  # a JSONL-style prompt keeps its own max_tokens
    assert all(row["ttft_ms"] <= row["e2e_ms"] for row in opened["per_request"])
    bad = LLMLoad(address, "nope", few, 4, duration=5.0, max_requests=3)
    result = asyncio.run(closed_loop(bad, concurrency=2))
    assert result["requests"] == 0 and sum(result["errors"].values()) == 3
    (message,) = result["errors"]
    assert message.startswith("stream: unknown model 'nope'"), message
    # 64 tokens cannot stream in 50 ms (the 4-token prompt can, on a fast machine)
    late = LLMLoad(address, MODEL, few[:1], 64, sampling=GREEDY, timeout=0.05)
    late.duration, late.max_requests = 5.0, 2
    result = asyncio.run(closed_loop(late, concurrency=1))
    assert result["errors"] == {"DEADLINE_EXCEEDED": 2}


@pytest.mark.slow
def test_conversations_resend_history_and_hit_the_prefix_cache(llm_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """2 conversations x 3 turns on one system prompt: every later turn's prompt is mostly
    cached (the worker's cached_tokens), and the report has TTFT per turn."""
    worker, _ = llm_worker
    out = tmp_path / "conv.json"
    args = ["--llm", "--address", worker.address, "--model", MODEL, "--conversations", "2"]
    args += ["--turns", "3", "--system-words", "60", "--question-words", "8"]
    args += ["--max-tokens", "4", "--concurrency", "2", "--output", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and not report["errors"]
    assert set(report["per_turn"]) == {"1", "2", "3"}
    assert report["per_turn"]["3"]["ttft_p50_s"] is not None
    assert report["hit_rate"] > 0.5 and report["cached_tokens"] > 0
