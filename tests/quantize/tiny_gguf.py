"""Tiny random GGUF files of each served architecture, written with the `gguf` package as
llama.cpp's converter writes them, for the checkpoint reader and the llama.cpp parity test.

Tokenizer: GPT-2 byte-level BPE over the 256 byte symbols, a few merges and the chat
specials, so that llama.cpp loads the vocabulary; the tests feed token ids directly.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from tokenizers.pre_tokenizers import ByteLevel

QUANTS = {"F32": T.F32, "F16": T.F16, "Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 96, 512

# (architecture in the file, pre-tokenizer, tied LM head, q/k/v biases)
ARCHITECTURES = {
    "llama": ("llama", "llama-bpe", False, False),
    "smollm": ("llama", "smollm", True, False),
    "qwen2": ("qwen2", "qwen2", False, True),
}


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): 256 bytes, 61 merged pairs, 3 specials = 320."""
    symbols = sorted(ByteLevel.alphabet())
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pairs = [(a, b) for a in letters[:8] for b in letters[:8]][:61]
    tokens = [*symbols, *(a + b for a, b in pairs), *SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, [f"{a} {b}" for a, b in pairs], types


def _write_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: str) -> None:
    qtype = QUANTS[kind] if w.ndim == 2 else T.F32  # norms and biases stay F32, as converted
    if qtype == T.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == T.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def write(
    path: Path,
    architecture: str,
    kind: str,
    seed: int = 0,
    *,
    arch: str | None = None,
    omit: tuple[str, ...] = (),
    extra: dict[str, str | float] | None = None,
    kinds: dict[str, T] | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
) -> Path:
    """A random model of `architecture` (a key of ARCHITECTURES) with its matrices in
    `kind` (a key of QUANTS). Weights are scaled so that greedy choices are well apart.
    For refusals: `arch` written instead, metadata keys (without the `<arch>.` prefix) in
    `omit` left out, `extra` keys added, `kinds` forcing some tensors' types. `hidden` and
    `ffn`: multiples of 256 let llama.cpp's quantizer write K-quants (llamacpp_quantize.py)."""
    file_arch, pre, tied, bias = ARCHITECTURES[architecture]
    arch = arch or file_arch
    rng = np.random.default_rng(seed)
    tokens, merges, types = vocabulary()
    vocab, hd = len(tokens), hidden // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{architecture}")
    numbers: dict[str, int | float] = {
        "context_length": CONTEXT,
        "embedding_length": hidden,
        "block_count": LAYERS,
        "feed_forward_length": ffn,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "rope.freq_base": 10000.0 if file_arch == "llama" else 1000000.0,
        "attention.layer_norm_rms_epsilon": 1e-5 if file_arch == "llama" else 1e-6,
    }
    for key, value in numbers.items():
        if key not in omit:
            add = w.add_uint32 if isinstance(value, int) else w.add_float32
            add(f"{arch}.{key}", value)
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    forced = kinds or {}

    def _tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: str) -> None:
        if name in forced:
            writer.add_tensor(name, gguf.quants.quantize(w, forced[name]), raw_dtype=forced[name])
        else:
            _write_tensor(writer, name, w, kind)

    def matrix(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    _tensor(w, "token_embd.weight", matrix(vocab, hidden, 8.0), kind)
    _tensor(w, "output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden), kind)
    if not tied:
        _tensor(w, "output.weight", matrix(vocab, hidden, 8.0), kind)
    for i in range(LAYERS):
        p = f"blk.{i}."
        _tensor(w, p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden), kind)
        _tensor(w, p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden), kind)
        _tensor(w, p + "attn_q.weight", matrix(HEADS * hd, hidden, 2.0), kind)
        _tensor(w, p + "attn_k.weight", matrix(KV_HEADS * hd, hidden, 2.0), kind)
        _tensor(w, p + "attn_v.weight", matrix(KV_HEADS * hd, hidden), kind)
        _tensor(w, p + "attn_output.weight", matrix(hidden, HEADS * hd), kind)
        _tensor(w, p + "ffn_gate.weight", matrix(ffn, hidden), kind)
        _tensor(w, p + "ffn_up.weight", matrix(ffn, hidden), kind)
        _tensor(w, p + "ffn_down.weight", matrix(hidden, ffn), kind)
        if bias:
            for name, rows in (("attn_q", HEADS * hd), ("attn_k", KV_HEADS * hd)):
                _tensor(w, f"{p}{name}.bias", 0.5 * rng.standard_normal(rows), kind)
            _tensor(w, p + "attn_v.bias", 0.5 * rng.standard_normal(KV_HEADS * hd), kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
