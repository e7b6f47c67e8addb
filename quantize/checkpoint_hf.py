"""A Hugging Face folder (config.json, model.safetensors or its sharded index,
tokenizer.json, tokenizer_config.json) as a Checkpoint (quantize/checkpoint.py).

Hugging Face keeps q/k rows in rotate-half order, as the step graph wants them, so nothing
is permuted. Weights of any float dtype (bf16 included) become float32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from quantize.checkpoint import (
    ARCHITECTURES,
    Checkpoint,
    CheckpointError,
    check_config,
    check_state,
)
from quantize.models import DecoderConfig

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
_TOP = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def _key(config: dict, key: str, kind: type, where: Path, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        raise CheckpointError(f"{where}: config.json key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: config.json key {key!r} = {value!r}: expected a number")
    if kind is int and not float(value).is_integer():
        raise CheckpointError(f"{where}: config.json key {key!r} = {value!r}: expected an integer")
    if not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: config.json key {key!r} = {value!r}: expected > 0")
    return kind(value)


def llama3_factors(scaling: dict, theta: float, head_dim: int, where: Path) -> tuple[float, ...]:
    """Hugging Face's llama3 RoPE scaling as per-frequency divisors (GGUF's rope_freqs)."""
    try:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: config.json rope_scaling (llama3) lacks {e}") from None
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def hf_config(folder: Path) -> tuple[str, DecoderConfig]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: config.json is missing")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not JSON ({e.msg} at {e.pos})") from None
    arch = c.get("model_type")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: model_type {arch!r} is not served (served: {', '.join(ARCHITECTURES)})"
        )
    hidden = _key(c, "hidden_size", int, path)
    heads = _key(c, "num_attention_heads", int, path)
    theta = _key(c, "rope_theta", float, path, 10000.0)
    if c.get("head_dim") not in (None, hidden // heads):
        raise CheckpointError(f"{path}: head_dim {c['head_dim']}: only hidden / heads is served")
    scale: float = 1.0
    factors: tuple[float, ...] = ()
    scaling = c.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            scale = _key(scaling, "factor", float, path)
        elif kind == "llama3":
            factors = llama3_factors(scaling, theta, hidden // heads, path)
        elif kind != "default":
            raise CheckpointError(
                f"{path}: rope_scaling type {kind!r} is not served (served: linear, llama3)"
            )
    config = DecoderConfig(
        vocab_size=_key(c, "vocab_size", int, path),
        hidden=hidden,
        layers=_key(c, "num_hidden_layers", int, path),
        heads=heads,
        kv_heads=_key(c, "num_key_value_heads", int, path, heads),
        intermediate=_key(c, "intermediate_size", int, path),
        rope_theta=theta,
        eps=_key(c, "rms_norm_eps", float, path),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        context_length=_key(c, "max_position_embeddings", int, path),
        rope_scale=scale,
        rope_freq_factors=factors,
    )
    check_config(config, str(path))
    return arch, config


def _files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{folder}: model.safetensors (or its index) is missing")
    return [single]


def our_name(hf: str) -> str | None:
    module, _, leaf = hf.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    if module.startswith("model.layers."):
        index, _, rest = module.removeprefix("model.layers.").partition(".")
        if index.isdigit() and rest in _LAYER:
            return f"layers.{index}.{_LAYER[rest]}.{leaf}"
    return None


def load(folder: Path) -> Checkpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    arch, config = hf_config(folder)
    state: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for file in _files(folder):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: does not parse ({e})") from e
        for hf, w in tensors.items():
            if hf.endswith("rotary_emb.inv_freq"):
                continue
            ours = our_name(hf)
            if ours is None:
                raise CheckpointError(f"{file}: tensor {hf!r} is not served ({arch})")
            state[ours] = w.float().contiguous()
            names[ours] = hf
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    check_state(state, config, str(folder), names)
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{folder}: tokenizer.json is missing")
    tok_config = folder / "tokenizer_config.json"
    return Checkpoint(
        folder,
        arch,
        config,
        state,
        Tokenizer.from_file(str(tok_path)),
        json.loads(tok_config.read_text()) if tok_config.is_file() else {},
    )
