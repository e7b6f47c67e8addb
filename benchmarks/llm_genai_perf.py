"""NVIDIA genai-perf against a Triton-vLLM-interface endpoint, for benchmarks/llm.py.

genai-perf 0.0.16 and its perf_analyzer (from tritonclient[all] 2.50.0: later bundles need
a newer glibc than this machine's) live in their own venv under build/, never in the
project's. It reads the tokenizer as a Hugging Face folder (tokenizer.json +
tokenizer_config.json), written here from the GGUF's tokenizer. Whatever stops it (no venv,
no perf_analyzer, a failed run) is returned as a reason, not raised.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from tokenizers import Tokenizer

# perf_analyzer 2.50 links libcudart.so.12 even for CPU-only servers (the wheel below ships
# it) and libb64.so.0d (Debian: `apt-get install libb64-0d`).
PACKAGES = ("genai-perf==0.0.16", "tritonclient[all]==2.50.0", "nvidia-cuda-runtime-cu12")
# the metrics of genai-perf's report that run() returns
_REPORTED = (
    "time_to_first_token",
    "inter_token_latency",
    "output_token_throughput",
    "request_throughput",
    "request_latency",
    "output_sequence_length",
    "input_sequence_length",
)


def tokenizer_dir(tokenizer: Tokenizer, folder: Path, eos: str, bos: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": eos,
        "bos_token": bos,
        "unk_token": None,
        "pad_token": eos,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def ensure_venv(venv: Path, log: Path, timeout_s: float = 900) -> str | None:
    """Create the venv and install genai-perf into it if missing; None or why not."""
    exe = venv / "bin" / "genai-perf"
    if exe.exists():
        return None
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run(["python3", "-m", "venv", str(venv)], check=True, timeout=120)
        with log.open("w") as out:
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", *PACKAGES],
                check=True,
                timeout=timeout_s,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    except (subprocess.SubprocessError, OSError) as e:
        return f"installing {' '.join(PACKAGES)} into {venv} failed: {e} (log: {log})"
    return None if exe.exists() else f"{exe} missing after install (log: {log})"


def ensure_libraries(venv: Path) -> str | None:
    """libb64.so.0d for perf_analyzer: Debian's libb64-0d, installed when missing and this
    runs as root (CI, make test); None or why not."""
    bin_dir = venv / "bin"
    if not _missing_libraries(bin_dir / "perf_analyzer", library_path(venv)):
        return None
    if os.geteuid() == 0 and shutil.which("apt-get"):
        for step in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "libb64-0d"],
        ):
            subprocess.run(step, capture_output=True, timeout=600, check=False)
    missing = _missing_libraries(bin_dir / "perf_analyzer", library_path(venv))
    return f"perf_analyzer cannot load {missing}" if missing else None


def library_path(venv: Path) -> str:
    """The CUDA runtime the perf_analyzer wheel links (nvidia-cuda-runtime-cu12's lib/)."""
    return ":".join(str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/*/lib"))


def run(
    venv: Path,
    address: str,
    model: str,
    tokenizer: Path,
    artifacts: Path,
    concurrency: int,
    requests: int,
    input_tokens: int,
    output_tokens: int,
    timeout_s: float = 600,
    model_version: str = "",
) -> dict:
    """One `genai-perf profile` run; its metrics (from profile_export_genai_perf.json) or
    {"error": why}."""
    bin_dir = venv / "bin"
    if shutil.which("perf_analyzer", path=str(bin_dir)) is None:
        return {"error": f"no perf_analyzer in {bin_dir} (tritonclient[all] installs it)"}
    libs = library_path(venv)
    missing = _missing_libraries(bin_dir / "perf_analyzer", libs)
    if missing:
        return {
            "error": f"perf_analyzer cannot load {missing} (libb64.so.0d: apt-get install "
            "libb64-0d; libcudart.so.12: pip install nvidia-cuda-runtime-cu12 in the venv)"
        }
    if artifacts.exists():
        shutil.rmtree(artifacts)
    args = [
        str(bin_dir / "genai-perf"),
        "profile",
        "-m",
        model,
        *_load_flags(address, tokenizer, concurrency, requests),
        *_synthetic_flags(input_tokens, output_tokens),
        "--artifact-dir",
        str(artifacts),
    ]
    if model_version:  # none needed: the worker's statistics name the version that served
        args += ["--", "-x", model_version]
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(artifacts.parent),
        "LD_LIBRARY_PATH": libs,
    }
    artifacts.mkdir(parents=True)
    log = artifacts / "genai-perf.log"
    code = _wait_logged(args, env, log, timeout_s)
    tail = log.read_text()[-1500:]
    found = sorted(artifacts.rglob("*genai_perf.json"))
    if code is None:
        return {"error": f"genai-perf did not finish in {timeout_s}s", "output_tail": tail}
    if code != 0 or not found:
        return {"error": f"genai-perf exited {code}", "output_tail": tail}
    report = json.loads(found[0].read_text())
    return {"command": " ".join(args[1:]), **{k: report[k] for k in _REPORTED if k in report}}


def _load_flags(address: str, tokenizer: Path, concurrency: int, requests: int) -> list[str]:
    """Streaming over KServe's gRPC with the vLLM backend's tensors, closed loop."""
    return [
        "--endpoint-type",
        "kserve",
        "--backend",
        "vllm",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "-u",
        address,
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "1",
    ]


def _synthetic_flags(input_tokens: int, output_tokens: int) -> list[str]:
    """Synthetic prompts of exactly input_tokens, asking for exactly output_tokens."""
    return [
        "--synthetic-input-tokens-mean",
        str(input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(output_tokens),
        "--output-tokens-stddev",
        "0",
    ]


def _wait_logged(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int | None:
    """Run to its end or to timeout_s (None), its output to `log`."""
    with log.open("w") as out:
        # its own session, so a timeout ends perf_analyzer (its child) too
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def _missing_libraries(binary: Path, library_path: str) -> list[str]:
    try:
        done = subprocess.run(
            ["ldd", str(binary)],
            capture_output=True,
            text=True,
            timeout=30,
            env={"LD_LIBRARY_PATH": library_path},
        )
    except (subprocess.SubprocessError, OSError) as e:
        return [f"(ldd failed: {e})"]
    return [line.split()[0] for line in done.stdout.splitlines() if "not found" in line]
