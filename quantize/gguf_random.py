"""Random-weight GGUF files of a given shape, written with the `gguf` package as llama.cpp's
converter writes them: the tests' tiny models (tests/quantize/tiny_gguf.py) and the LLM
benchmark's full-size ones (benchmarks/llm_checkpoint.py), which llama.cpp's own quantizer
(quantize/llamacpp_quantize.py) turns into its presets.

Weights are N(0, 1) * scale / sqrt(fan-in), scaled so that greedy choices are well apart;
norms near 1. The vocabulary is given (a `Vocabulary`: GPT-2 byte-level BPE, as the served
GGUF tokenizers are, quantize/gguf_tokenizer.py). A shape whose `vocab` exceeds the
vocabulary's size gets the vocabulary padded as llama.cpp's converter pads Qwen2's
("[PAD<i>]" tokens of type UNUSED), and every UNUSED token's embedding row is zero: with
tied embeddings its logit is then exactly 0 while the real tokens' largest is well above,
so greedy never emits a pad (whose text llama.cpp streams as "" and a Hugging Face
tokenizer as "[PAD<i>]": the two sides would count it differently). The rows are still
multiplied on every step, as a trained model's are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from quantize.gguf_tokenizer import field

QUANTS = {"F32": T.F32, "F16": T.F16, "Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1}
UNUSED = int(gguf.TokenType.UNUSED)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    vocab: int | None = None  # embedding rows; None: the vocabulary's own size
    rope_theta: float = 10000.0
    eps: float = 1e-5


@dataclass(frozen=True)
class Layout:
    """How the file is laid out: its general.architecture, a tied LM head (no output.weight),
    q/k/v biases."""

    arch: str
    tied: bool
    bias: bool


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    merges: list[str]
    types: list[int]  # tokenizer.ggml.token_type
    pre: str  # tokenizer.ggml.pre
    bos: int
    eos: int
    chat_template: str | None = None

    def padded(self, size: int) -> Vocabulary:
        """Padded to `size` tokens as llama.cpp's converter pads Qwen2's vocabulary."""
        n = len(self.tokens)
        if size < n:
            raise ValueError(f"vocab {size} is smaller than the tokenizer's {n} tokens")
        pads = [f"[PAD{i}]" for i in range(n, size)]
        types = [*self.types, *[UNUSED] * len(pads)]
        return replace(self, tokens=[*self.tokens, *pads], types=types)


def vocabulary_of(path: Path) -> Vocabulary:
    """A GGUF's own byte-level BPE vocabulary, merges, specials and chat template."""
    value = partial(field, gguf.GGUFReader(str(path)))
    template = value("tokenizer.chat_template")
    return Vocabulary(
        tokens=list(value("tokenizer.ggml.tokens")),
        merges=list(value("tokenizer.ggml.merges")),
        types=[int(t) for t in value("tokenizer.ggml.token_type")],
        pre=str(value("tokenizer.ggml.pre") or "default"),
        bos=int(value("tokenizer.ggml.bos_token_id")),
        eos=int(value("tokenizer.ggml.eos_token_id")),
        chat_template=None if template is None else str(template),
    )


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: T) -> None:
    if w.ndim != 2 or qtype == T.F32:  # norms and biases stay F32, as converted
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == T.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def write(
    path: Path,
    shape: Shape,
    layout: Layout,
    vocabulary: Vocabulary,
    kind: str,
    seed: int = 0,
    *,
    name: str = "random",
    arch: str | None = None,
    omit: tuple[str, ...] = (),
    extra: dict[str, str | float] | None = None,
    kinds: dict[str, T] | None = None,
) -> Path:
    """A random model of `shape` with its matrices in `kind` (a key of QUANTS). For
    refusals: `arch` written instead of the layout's, metadata keys (without the `<arch>.`
    prefix) in `omit` left out, `extra` keys added, `kinds` forcing some tensors' types.
    Rows that are multiples of 256 let llama.cpp's quantizer write K-quants."""
    rng = np.random.default_rng(seed)
    vocab = vocabulary.padded(shape.vocab) if shape.vocab else vocabulary
    rows, hidden, ffn = len(vocab.tokens), shape.hidden, shape.ffn
    hd = hidden // shape.heads
    arch = arch or layout.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    numbers: dict[str, int | float] = {
        "context_length": shape.context,
        "embedding_length": hidden,
        "block_count": shape.layers,
        "feed_forward_length": ffn,
        "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads,
        "rope.freq_base": shape.rope_theta,
        "attention.layer_norm_rms_epsilon": shape.eps,
    }
    for key, value in [*numbers.items(), *(extra or {}).items()]:
        if key in omit:
            continue
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)
    forced = kinds or {}

    def tensor(name: str, value: np.ndarray) -> None:
        if name in forced:
            w.add_tensor(name, gguf.quants.quantize(value, forced[name]), raw_dtype=forced[name])
        else:
            _add(w, name, value, QUANTS[kind])

    def matrix(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(hidden)

    embed = matrix(rows, hidden, 8.0)
    embed[np.asarray(vocab.types) == UNUSED] = 0.0
    tensor("token_embd.weight", embed)
    del embed
    tensor("output_norm.weight", norm())
    if not layout.tied:
        tensor("output.weight", matrix(rows, hidden, 8.0))

    def heads(n: int) -> int:
        return n * hd

    for i in range(shape.layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", norm())
        tensor(p + "ffn_norm.weight", norm())
        tensor(p + "attn_q.weight", matrix(heads(shape.heads), hidden, 2.0))
        tensor(p + "attn_k.weight", matrix(heads(shape.kv_heads), hidden, 2.0))
        tensor(p + "attn_v.weight", matrix(heads(shape.kv_heads), hidden))
        tensor(p + "attn_output.weight", matrix(hidden, heads(shape.heads)))
        tensor(p + "ffn_gate.weight", matrix(ffn, hidden))
        tensor(p + "ffn_up.weight", matrix(ffn, hidden))
        tensor(p + "ffn_down.weight", matrix(hidden, ffn))
        if layout.bias:
            tensor(p + "attn_q.bias", 0.5 * rng.standard_normal(heads(shape.heads)))
            tensor(p + "attn_k.bias", 0.5 * rng.standard_normal(heads(shape.kv_heads)))
            tensor(p + "attn_v.bias", 0.5 * rng.standard_normal(heads(shape.kv_heads)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
