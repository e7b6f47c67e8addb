"""benchmarks.llm's `--checkpoint`: a model of a published model's shape with random weights,
written once into build/bench-checkpoints/<name>/ (never into the repository), so that the
anchor can be run at a size SmolLM2-135M does not reach without downloading weights.

- The file: quantize/gguf_random.py writes it in F16 with the shape's every matrix and
  llama.cpp's layout (general.architecture, tied LM head, q/k/v biases); llama.cpp's own
  quantizer (quantize/llamacpp_quantize.py, in build/llamacpp-venv) turns it into the
  published preset. Speed depends on the shape and the tensor types, not on the values.
- The tokenizer: SmolLM2's (its GGUF's byte-level BPE, 49,152 tokens, specials and chat
  template), padded to the shape's vocabulary as llama.cpp's converter pads Qwen2's
  ("[PAD<i>]", type UNUSED), so the embedding and the LM head keep the published row
  count and the prompts are SmolLM2-tokenized on every side, as in the SmolLM2 anchor. The
  pads' rows are zero (gguf_random.py says why: greedy never emits them).
- The worker's model repository: quantize.llm.build_checkpoint, the GGUF as stored (its
  block codes as MatMulNBits), max_model_len 2048 as llama-server's 32768 over 16 slots.

Each step is skipped when its output exists (delete the folder to rebuild); the F16 source
is deleted once quantized.
"""

from __future__ import annotations

import hashlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from common import custom_ops, paths
from quantize import gguf_random, llamacpp_quantize, llm, weights
from quantize.gguf_random import Layout, Shape


@dataclass(frozen=True)
class Spec:
    """A published model's shape, its file layout and the preset it is served in."""

    title: str
    shape: Shape
    layout: Layout
    preset: str


CHECKPOINTS = {
    # Qwen2.5-0.5B(-Instruct)'s config.json: hidden 896, 24 layers, 14 heads, 2 KV heads,
    # intermediate 4864, vocab 151936, q/k/v biases, tied embeddings, rope_theta 1e6,
    # rms_norm_eps 1e-6, 32768 positions. 896 and 4864 are not all whole 256-wide
    # super-blocks: llama.cpp's Q4_K_M falls back to other types where they are not, as it
    # does on the published file.
    "qwen2.5-0.5b": Spec(
        "Qwen2.5-0.5B's shape",
        Shape(896, 24, 14, 2, 4864, 32768, vocab=151936, rope_theta=1e6, eps=1e-6),
        Layout("qwen2", tied=True, bias=True),
        "Q4_K_M",
    ),
}
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Prepared:
    spec: Spec
    gguf: Path  # what llama-server serves and the worker's repository was built from
    repository: Path
    model: str  # the served name in `repository`


def folder(name: str) -> Path:
    return paths.build("bench-checkpoints", name)


def builder() -> str:
    """What a repository built from a GGUF depends on besides the file: quantize/'s and the
    custom op layout's code, and whether the op library is built (MatMulQ or MatMulNBits)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(str(custom_ops.available()).encode())
    sources = [*sorted((root / "quantize").glob("*.py")), root / "common" / "custom_ops.py"]
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def prepare(name: str, llamacpp_python: Path) -> Prepared:
    """The checkpoint's GGUF, written if missing, and the worker's repository, built again
    when what builds it changed (builder()): a benchmark never serves a stale graph."""
    spec = CHECKPOINTS[name]
    root = folder(name)
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / f"{name}.{spec.preset}.gguf"
    if not gguf.exists():
        source = root / f"{name}.F16.gguf"
        if not source.exists():
            print(f"writing {source} (random weights)", flush=True)
            vocab = gguf_random.vocabulary_of(weights.smollm2_gguf())
            partial = source.with_suffix(".partial")
            gguf_random.write(partial, spec.shape, spec.layout, vocab, "F16", name=name)
            partial.rename(source)
        print(f"quantizing to {spec.preset} with llama.cpp's quantizer", flush=True)
        partial = gguf.with_suffix(".partial")
        done = llamacpp_quantize.quantize(llamacpp_python, source, partial, spec.preset)
        if done.returncode != 0:
            sigill = " (SIGILL: rebuild build/llamacpp-venv)" * (done.returncode == -signal.SIGILL)
            raise SystemExit(f"llama.cpp's quantizer failed{sigill}: {done.stderr[-1500:]}")
        partial.rename(gguf)
        os.remove(source)
    repository, stamp, built_by = root / "models", root / "models.builder", builder()
    fresh = stamp.exists() and stamp.read_text() == built_by
    if not (fresh and (repository / name / "config.pbtxt").exists()):
        print(f"building the worker's repository in {repository}", flush=True)
        llm.build_checkpoint(gguf, repository, name, max_model_len=MAX_MODEL_LEN)
        stamp.write_text(built_by)
    return Prepared(spec, gguf, repository, name)
