"""Tiny random GGUF files of each served architecture (quantize/gguf_random.py writes them as
llama.cpp's converter does), for the checkpoint reader and the llama.cpp parity test.

Tokenizer: GPT-2 byte-level BPE over the 256 byte symbols, a few merges and the chat
specials, so that llama.cpp loads the vocabulary; the tests feed token ids directly.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as T
from tokenizers.pre_tokenizers import ByteLevel

from quantize import gguf_random
from quantize.gguf_random import QUANTS as QUANTS  # re-exported: the types a test may ask for

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 96, 512

# (architecture in the file, pre-tokenizer, tied LM head, q/k/v biases)
ARCHITECTURES = {
    "llama": ("llama", "llama-bpe", False, False),
    "smollm": ("llama", "smollm", True, False),
    "qwen2": ("qwen2", "qwen2", False, True),
}


def vocabulary(pre: str = "llama-bpe") -> gguf_random.Vocabulary:
    """256 bytes, 61 merged pairs, 3 specials = 320 tokens."""
    symbols = sorted(ByteLevel.alphabet())
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pairs = [(a, b) for a in letters[:8] for b in letters[:8]][:61]
    tokens = [*symbols, *(a + b for a, b in pairs), *SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    merges = [f"{a} {b}" for a, b in pairs]
    bos, eos = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    return gguf_random.Vocabulary(tokens, merges, types, pre, bos, eos)


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
    `kind` (a key of QUANTS); `arch`, `omit`, `extra` and `kinds` as gguf_random.write's.
    `hidden` and `ffn`: multiples of 256 let llama.cpp's quantizer write K-quants
    (quantize/llamacpp_quantize.py)."""
    file_arch, pre, tied, bias = ARCHITECTURES[architecture]
    llama = file_arch == "llama"
    shape = gguf_random.Shape(
        hidden,
        LAYERS,
        HEADS,
        KV_HEADS,
        ffn,
        CONTEXT,
        rope_theta=10000.0 if llama else 1000000.0,
        eps=1e-5 if llama else 1e-6,
    )
    layout = gguf_random.Layout(file_arch, tied, bias)
    return gguf_random.write(
        path,
        shape,
        layout,
        vocabulary(pre),
        kind,
        seed,
        name=f"tiny-{architecture}",
        arch=arch,
        omit=omit,
        extra=extra,
        kinds=kinds,
    )
