"""The measurements behind benchmarks/llm.py, one function per system, and the summary
sentences, each computed from the numbers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks import llm_load
from benchmarks.common import free_port
from benchmarks.llm_load import Prompts, Send, concurrent, median_of, single


@dataclass
class Context:
    args: argparse.Namespace
    gguf: Path
    tokenizer: Tokenizer
    prompts: Prompts
    eos_ids: list[int]
    eos_token: str
    bos_token: str | None

    @classmethod
    def create(cls, args: argparse.Namespace, cache: Path) -> Context:
        from quantize.weights import smollm2_gguf

        gguf = smollm2_gguf()
        tokenizer = smollm2_tokenizer(gguf, cache / "smollm2-tokenizer" / "tokenizer.json")
        ids = {t: tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
        ends = {t: i for t, i in ids.items() if i is not None}
        bos = "<|im_start|>" if tokenizer.token_to_id("<|im_start|>") is not None else None
        return cls(
            args,
            gguf,
            tokenizer,
            Prompts(tokenizer),
            list(ends.values()),
            next(iter(ends)),
            bos,
        )

    @property
    def ignore_eos(self) -> bool:
        return bool(self.args.ignore_eos)

    def single_plan(self) -> dict[str, tuple[list[llm_load.Prompt], int]]:
        """name -> (prompts, max_tokens): decode on a short prompt, prefill on long ones."""
        r = self.args.repeats
        return {
            "decode": ([self.prompts.make(32) for _ in range(r)], self.args.decode_tokens),
            "prefill_500": ([self.prompts.make(500) for _ in range(r)], 2),
            "prefill_1500": ([self.prompts.make(1500) for _ in range(r)], 2),
        }


def smollm2_tokenizer(gguf: Path, cached: Path) -> Tokenizer:
    """SmolLM2's tokenizer rebuilt from the GGUF (quantize/weights.py), cached as JSON:
    gguf.GGUFReader takes ~30 s to parse the vocabulary here."""
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    from gguf import GGUFReader

    from quantize.weights import gguf_tokenizer

    tokenizer = gguf_tokenizer(GGUFReader(str(gguf)))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(cached))
    return tokenizer


def _single_summary(runs: dict[str, list[dict]]) -> dict:
    return {
        "decode_tokens_per_s": median_of(runs["decode"], "decode_tokens_per_s"),
        "itl_ms": median_of(runs["decode"], "itl_ms"),
        "prompt_tokens_per_s_500": median_of(runs["prefill_500"], "prompt_tokens_per_s"),
        "prompt_tokens_per_s_1500": median_of(runs["prefill_1500"], "prompt_tokens_per_s"),
        "ttft_ms_1500": median_of(runs["prefill_1500"], "ttft_ms"),
    }


# ---- llama.cpp in-process ------------------------------------------------------------------


def omp_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return env if policy == "default" else {**env, "OMP_WAIT_POLICY": policy}


def llamacpp_inprocess(ctx: Context, omp: str | None = None, short: bool = False) -> dict:
    """short: one decode of 32 tokens and one 500-token prefill (for a slow configuration)."""
    python = ctx.args.llamacpp_venv / "bin" / "python"
    if not python.exists():
        return {"skipped": f"{python} not found: `make llamacpp-venv` builds it"}
    omp = omp or ctx.args.omp_wait_policy
    plan = ctx.single_plan()
    if short:
        plan = {
            "decode": ([ctx.prompts.make(32)], 32),
            "prefill_500": ([ctx.prompts.make(500)], 2),
            "prefill_1500": ([], 2),
        }
    job = {
        "model": str(ctx.gguf),
        "n_threads": ctx.args.threads,
        "n_ctx": 4096,
        "max_tokens": {k: v[1] for k, v in plan.items()},
        "runs": {k: [p.text for p in v[0]] for k, v in plan.items()},
        "logit_bias": {str(i): -100.0 for i in ctx.eos_ids} if ctx.ignore_eos else {},
    }
    script = Path(__file__).with_name("llm_inprocess.py")
    done = subprocess.run(
        [str(python), str(script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
        env=omp_env(omp),
    )
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    raw = json.loads(done.stdout)
    runs: dict[str, list[dict]] = {}
    for name, outs in raw["runs"].items():
        prompts = plan[name][0]
        runs[name] = [_inprocess_run(ctx, p, o) for p, o in zip(prompts, outs, strict=True)]
    return {
        "how": "llama_cpp.Llama in its own process, n_threads=n_threads_batch="
        f"{ctx.args.threads}, n_ctx 4096, KV cache cleared before each run, "
        f"OMP_WAIT_POLICY {omp}",
        "llama_cpp_python": raw["llama_cpp_python"],
        "load_s": raw["load_s"],
        "rss_mb": {"after_load": raw["rss_after_load_mb"], "end": raw["rss_end_mb"]},
        "single": _single_summary(runs),
        "runs": runs,
        "llama_perf_last_run": next(
            (r[-1]["perf"] for r in reversed(raw["runs"].values()) if r), {}
        ),
    }


def _inprocess_run(ctx: Context, prompt: llm_load.Prompt, out: dict) -> dict:
    s = llm_load.Stream(prompt.tokens, text=out["text"], ttft_s=out["first_s"])
    s.last_s = out["last_s"]
    s.completion_tokens = len(ctx.tokenizer.encode(s.text).ids) if s.text else 0
    itl = s.itl_s()
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_ms": round(s.ttft_s * 1000, 1) if s.ttft_s else None,
        "itl_ms": round(itl * 1000, 2) if itl else None,
        "decode_tokens_per_s": round(1 / itl, 1) if itl else None,
        "prompt_tokens_per_s": round(s.prompt_tokens / s.ttft_s, 1) if s.ttft_s else None,
    }


# ---- servers ------------------------------------------------------------------------------


def rss_tree_mb(pid: int) -> float | None:
    """Resident MB of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            if p == pid:
                return None
        todo += children.get(p, [])
    return round(total / 1024, 1)


class RssSampler:
    def __init__(self, pid: int | None) -> None:
        self.pid, self.samples, self.task = pid, [], None  # type: ignore[var-annotated]

    async def _loop(self) -> None:
        while True:
            if self.pid is not None and (v := rss_tree_mb(self.pid)) is not None:
                self.samples.append(v)
            await asyncio.sleep(0.5)

    def __enter__(self) -> RssSampler:
        self.task = asyncio.get_running_loop().create_task(self._loop())  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()

    def report(self) -> dict:
        if self.pid is None:
            return {"unavailable": "external server: pid unknown"}
        if not self.samples:
            return {}
        return {"start": self.samples[0], "peak": max(self.samples), "end": self.samples[-1]}


async def serve_and_measure(ctx: Context, send: Send, pid: int | None, label: str) -> dict:
    tok = ctx.tokenizer
    start_rss = rss_tree_mb(pid) if pid else None
    with RssSampler(pid) as rss:
        await single(send, ctx.prompts.make(16), 4, tok)  # warm-up
        runs = {
            name: [await single(send, p, n, tok) for p in prompts]
            for name, (prompts, n) in ctx.single_plan().items()
        }
        levels = []
        for c in ctx.args.concurrency:
            point = await concurrent(
                send,
                ctx.prompts,
                ctx.args.lengths,
                c,
                ctx.args.requests_per_stream,
                ctx.args.max_tokens,
                ctx.args.level_deadline_s,
            )
            print(label, f"c={c}", {k: point[k] for k in ("output_tokens_per_s", "ttft_p50_ms")})
            levels.append(point)
    return {
        "single": _single_summary(runs),
        "runs": runs,
        "concurrency": levels,
        "rss_mb": {"before_load_test": start_rss, **rss.report()},
    }


@contextlib.asynccontextmanager
async def llamacpp_server_process(ctx: Context, logs: Path) -> AsyncIterator[tuple[int, int]]:
    python = ctx.args.llamacpp_venv / "bin" / "python"
    port = free_port()
    threads = str(ctx.args.threads)
    args = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(ctx.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--n_ctx",
        "4096",
        # by default a new request interrupts the one streaming: queue them instead
        "--interrupt_requests",
        "False",
    ]
    log = (logs / "llamacpp-server.log").open("w")
    env = omp_env(ctx.args.omp_wait_policy)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        await llm_load.wait_http("127.0.0.1", port, "/v1/models", 120, lambda: proc.poll() is None)
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def llamacpp_server(ctx: Context, logs: Path) -> dict:
    if not (ctx.args.llamacpp_venv / "bin" / "python").exists():
        return {"skipped": f"{ctx.args.llamacpp_venv} not found"}
    bias = {str(i): -100 for i in ctx.eos_ids} if ctx.ignore_eos else {}
    async with llamacpp_server_process(ctx, logs) as (port, pid):
        send = llm_load.openai_sender("127.0.0.1", port, {"logit_bias": bias} if bias else {})
        out = await serve_and_measure(ctx, send, pid, "llama.cpp server")
    return {
        "how": "python -m llama_cpp.server (llama-cpp-python[server]==0.3.36), 127.0.0.1, "
        f"n_threads=n_threads_batch={ctx.args.threads}, n_ctx 4096, OMP_WAIT_POLICY "
        f"{ctx.args.omp_wait_policy}, interrupt_requests False (queue, do not cut "
        "the running stream); streamed "
        "/v1/completions over HTTP/1.1 (server-sent events)",
        **out,
    }


async def meshserve(ctx: Context, address: str, pid: int | None) -> dict:
    from benchmarks.llm_triton import triton_sender

    sampling = {"ignore_eos": True} if ctx.ignore_eos else {}
    send, channel = triton_sender(address, ctx.args.model, sampling)
    try:
        out = await serve_and_measure(ctx, send, pid, "meshserve")
    finally:
        await channel.close()
    return {
        "how": f"meshserve worker at {address}, model {ctx.args.model!r}: gRPC "
        "ModelStreamInfer, Triton vLLM-backend tensors (text_input, stream, "
        "sampling_parameters, exclude_input_in_output -> text_output)",
        **out,
    }


# ---- summary and plots ----------------------------------------------------------------------


def _level(system: dict, streams: int) -> dict:
    return next((p for p in system.get("concurrency", []) if p["streams"] == streams), {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def summary(systems: dict) -> tuple[dict, list[str]]:
    """Ratios against llama.cpp and the issue's targets; sentences made from the numbers."""
    lc, srv, ms = (systems.get(k, {}) for k in ("llamacpp", "llamacpp-server", "meshserve"))
    out: dict = {}
    lines: list[str] = []
    for name, s in systems.items():
        single_ = s.get("single")
        if single_:
            lines.append(
                f"{name}: decode {single_['decode_tokens_per_s']} tok/s single-stream, "
                f"prompt {single_['prompt_tokens_per_s_500']} tok/s (500) / "
                f"{single_['prompt_tokens_per_s_1500']} tok/s (1,500)"
            )
        for p in s.get("concurrency", []):
            lines.append(
                f"{name}: {p['streams']} streams -> {p['output_tokens_per_s']} output tok/s "
                f"aggregate, TTFT p50 {p['ttft_p50_ms']} ms / p99 {p['ttft_p99_ms']} ms, "
                f"ITL p50 {p['itl_p50_ms']} ms ({p['requests']} requests, {p['errors']} errors)"
            )
    one, eight = _level(srv, 1), _level(srv, 8)
    if one and eight:
        out["llamacpp_server_8_over_1"] = _ratio(
            eight["output_tokens_per_s"], one["output_tokens_per_s"]
        )
        lines.append(
            f"llama.cpp server: 8 streams give {out['llamacpp_server_8_over_1']}x the output "
            "tokens/s of 1 stream."
        )
    if lc.get("single") and srv.get("single"):
        out["llamacpp_server_over_inprocess_decode"] = _ratio(
            srv["single"]["decode_tokens_per_s"], lc["single"]["decode_tokens_per_s"]
        )
    if ms.get("single") and lc.get("single") and eight:
        m8 = _level(ms, 8)
        targets = {
            "decode_vs_llamacpp_inprocess": (
                _ratio(ms["single"]["decode_tokens_per_s"], lc["single"]["decode_tokens_per_s"]),
                1.0,
                ">=",
            ),
            "aggregate_8_vs_llamacpp_server": (
                _ratio(m8.get("output_tokens_per_s"), eight["output_tokens_per_s"]),
                3.0,
                ">=",
            ),
            "ttft_p50_8_vs_llamacpp_server": (
                _ratio(m8.get("ttft_p50_ms"), eight["ttft_p50_ms"]),
                0.5,
                "<=",
            ),
            "prompt_500_vs_llamacpp_inprocess": (
                _ratio(
                    ms["single"]["prompt_tokens_per_s_500"],
                    lc["single"]["prompt_tokens_per_s_500"],
                ),
                2.0,
                ">=",
            ),
        }
        out["targets"] = {}
        for key, (value, target, op) in targets.items():
            met = value is not None and (value >= target if op == ">=" else value <= target)
            out["targets"][key] = {"ratio": value, "target": f"{op} {target}", "met": met}
            lines.append(
                f"meshserve {key.replace('_', ' ')}: {value}x (target {op} {target}x): "
                + ("met" if met else "NOT met")
            )
    return out, lines


def plots(result: dict, folder: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(s.get("concurrency") for s in result["systems"].values()):
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system, s in result["systems"].items():
        points = s.get("concurrency") or []
        if not points:
            continue
        xs = [p["streams"] for p in points]
        axes[0].plot(xs, [p["output_tokens_per_s"] for p in points], "o-", label=system)
        axes[1].plot(xs, [p["ttft_p50_ms"] for p in points], "o-", label=system)
    axes[0].set(xlabel="concurrent streams", ylabel="output tokens/s", title="aggregate")
    axes[1].set(xlabel="concurrent streams", ylabel="ms", title="TTFT p50", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M Q4_1, {result['settings']['threads']} threads, noisy machine")
    fig.tight_layout()
    fig.savefig(folder / f"{name}_concurrency.png", dpi=90)
    plt.close(fig)
