"""A Llama-family checkpoint as the step graph needs it, built from the checkpoint's own
metadata: a GGUF file (llama.cpp's) or a Hugging Face folder (config.json + safetensors +
tokenizer.json).

Served: the architectures in ARCHITECTURES (SmolLM2 is `llama`; qwen2 adds q/k/v biases
and keeps RoPE in rotate-half order in its GGUF), GGUF tensor types in TENSOR_TYPES, RoPE
unscaled, linear or llama3-scaled. Anything else is refused here, at build time, by a
CheckpointError that names the architecture, tensor, type or key — never served wrong.

What is read, GGUF (`<arch>` = general.architecture):
    <arch>.embedding_length / block_count / feed_forward_length / context_length,
    <arch>.attention.head_count / head_count_kv / layer_norm_rms_epsilon,
    <arch>.rope.freq_base, <arch>.rope.scaling.type / factor, rope_freqs.weight (llama3),
    tied or separate LM head (output.weight present or not), biases (attn_q.bias ...).
Hugging Face: config.json's hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, rope_scaling,
max_position_embeddings, tie_word_embeddings, vocab_size, attention_bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from quantize.gguf_blocks import LAYOUTS
from quantize.models import DecoderConfig, LlamaDecoder

ARCHITECTURES = ("llama", "qwen2")  # smollm / SmolLM2 is `llama`
# GGUF types served (exactly): floats, and every block type with a MatMulNBits layout
# (quantize/gguf_blocks.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K)
TENSOR_TYPES = ("F32", "F16", *LAYOUTS)
ROPE_PERMUTED = {"llama"}  # llama.cpp's converter interleaves these q/k rows
ROPE_SCALINGS = ("none", "linear")  # GGUF rope.scaling.type; llama3 comes as rope_freqs
_LAYER = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


class CheckpointError(Exception):
    """A checkpoint we do not serve or cannot parse; the message names what and where."""


@dataclass
class Checkpoint:
    path: Path
    architecture: str
    config: DecoderConfig
    state: dict[str, torch.Tensor]  # our names (models.LlamaDecoder's)
    tokenizer: Tokenizer
    tokenizer_config: dict = field(default_factory=dict)  # Hugging Face's, for chat templates
    tensor_types: dict[str, str] = field(default_factory=dict)  # GGUF name -> type

    @property
    def gguf(self) -> Path | None:
        return self.path if self.path.suffix == ".gguf" else None

    def model(self) -> LlamaDecoder:
        model = LlamaDecoder(self.config)
        state = dict(self.state)
        if self.config.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{self.path}: tensors missing {sorted(missing)[:4]}, unexpected "
                f"{sorted(unexpected)[:4]}"
            )
        return model.eval()


def check_config(c: DecoderConfig, where: str) -> None:
    """Shapes the step graph can serve (GroupQueryAttention on CPU: head_dim % 16 == 0)."""
    if c.hidden % c.heads:
        raise CheckpointError(f"{where}: hidden size {c.hidden} is not a multiple of heads")
    if c.kv_heads < 1 or c.heads % c.kv_heads:
        raise CheckpointError(f"{where}: {c.heads} heads do not share {c.kv_heads} kv heads")
    if c.head_dim % 16:
        raise CheckpointError(f"{where}: head_dim {c.head_dim}: must be a multiple of 16")


# ---- GGUF --------------------------------------------------------------------------------


def _reader(path: Path):  # type: ignore[no-untyped-def]
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, struct.error, IndexError...
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def field_value(reader, key: str, default: Any = None, path: Path | None = None) -> Any:  # type: ignore[no-untyped-def]
    """A metadata value; a missing key without a default is refused, naming it."""
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise CheckpointError(f"{path}: GGUF metadata key {key!r} does not parse ({e})") from e


def _number(reader, key: str, kind: type, path: Path, default: Any = None) -> Any:  # type: ignore[no-untyped-def]
    value = field_value(reader, key, default, path)
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: GGUF key {key!r} = {value!r}: expected a number") from None
    if not math.isfinite(out) or out <= 0:
        raise CheckpointError(f"{path}: GGUF key {key!r} = {value!r}: expected > 0")
    return out


def gguf_config(reader, path: Path) -> tuple[str, DecoderConfig]:  # type: ignore[no-untyped-def]
    arch = str(field_value(reader, "general.architecture", path=path))
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not served (served: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    heads = _number(reader, f"{arch}.attention.head_count", int, path)
    hidden = _number(reader, f"{arch}.embedding_length", int, path)
    scaling = str(field_value(reader, f"{arch}.rope.scaling.type", "none", path))
    if scaling not in ROPE_SCALINGS:
        raise CheckpointError(
            f"{path}: {arch}.rope.scaling.type {scaling!r} is not served "
            f"(served: {', '.join(ROPE_SCALINGS)}, and llama3's rope_freqs)"
        )
    scale = 1.0
    if scaling == "linear":
        scale = _number(reader, f"{arch}.rope.scaling.factor", float, path)
    elif f"{arch}.rope.scale_linear" in reader.fields:
        scale = _number(reader, f"{arch}.rope.scale_linear", float, path)
    factors: tuple[float, ...] = ()
    if "rope_freqs.weight" in names:
        factors = tuple(float(x) for x in _tensor(names["rope_freqs.weight"], path).reshape(-1))
    config = DecoderConfig(
        vocab_size=int(names["token_embd.weight"].shape[1]),
        hidden=hidden,
        layers=_number(reader, f"{arch}.block_count", int, path),
        heads=heads,
        kv_heads=_number(reader, f"{arch}.attention.head_count_kv", int, path, heads),
        intermediate=_number(reader, f"{arch}.feed_forward_length", int, path),
        rope_theta=_number(reader, f"{arch}.rope.freq_base", float, path, 10000.0),
        eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", float, path),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        context_length=_number(reader, f"{arch}.context_length", int, path),
        rope_scale=scale,
        rope_freq_factors=factors,
    )
    check_config(config, str(path))
    head_dim = config.head_dim
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = reader.fields.get(f"{arch}.{key}")
        if value is not None and int(value.contents()) != head_dim:
            raise CheckpointError(
                f"{path}: {arch}.{key} = {int(value.contents())}: only hidden / heads = "
                f"{head_dim} is served"
            )
    if factors and len(factors) != head_dim // 2:
        raise CheckpointError(
            f"{path}: rope_freqs.weight has {len(factors)} values, not {head_dim // 2}"
        )
    return arch, config


def _tensor(t, path: Path) -> np.ndarray:  # type: ignore[no-untyped-def]
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind not in TENSOR_TYPES:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} is {kind}; served tensor types: {', '.join(TENSOR_TYPES)}"
        )
    try:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        return w.reshape([int(d) for d in reversed(t.shape)])
    except Exception as e:
        raise CheckpointError(f"{path}: tensor {t.name!r} does not parse ({e})") from e


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor name -> its [out, in] shape."""
    hd = c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c.vocab_size, c.hidden),
        "norm.weight": (c.hidden,),
    }
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden)
    for i in range(c.layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (c.hidden,),
            p + "ffn_norm.weight": (c.hidden,),
            p + "q.weight": (c.heads * hd, c.hidden),
            p + "k.weight": (c.kv_heads * hd, c.hidden),
            p + "v.weight": (c.kv_heads * hd, c.hidden),
            p + "o.weight": (c.hidden, c.heads * hd),
            p + "gate.weight": (c.intermediate, c.hidden),
            p + "up.weight": (c.intermediate, c.hidden),
            p + "down.weight": (c.hidden, c.intermediate),
        }
        if c.qkv_bias:
            shapes |= {
                p + "q.bias": (c.heads * hd,),
                p + "k.bias": (c.kv_heads * hd,),
                p + "v.bias": (c.kv_heads * hd,),
            }
    return shapes


def our_name(gguf: str) -> str | None:
    """blk.3.attn_q.weight -> layers.3.q.weight; None for a tensor we do not know."""
    top = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight"}
    if gguf in top:
        return top[gguf]
    if gguf == "output.weight":
        return "lm_head.weight"
    parts = gguf.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def check_state(state: dict[str, torch.Tensor], c: DecoderConfig, where: str, names: dict) -> None:
    """Every tensor the config implies, of its shape; `names` maps ours to the file's."""
    shapes = expected_shapes(c)
    for name, shape in shapes.items():
        if name not in state:
            raise CheckpointError(f"{where}: tensor {names.get(name, name)!r} is missing")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{where}: tensor {names.get(name, name)!r} has shape "
                f"{list(state[name].shape)}, expected {list(shape)} from the config"
            )
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise CheckpointError(f"{where}: tensor {names.get(extra[0], extra[0])!r} is not served")


def load_gguf(path: Path) -> Checkpoint:
    from quantize import gguf_tokenizer

    reader = _reader(path)
    arch, config = gguf_config(reader, path)
    state: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    names: dict[str, str] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        ours = our_name(t.name)
        if ours is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} is not served ({arch})")
        w = _tensor(t, path)
        role = ours.split(".")[2] if ours.startswith("layers.") else ""
        if arch in ROPE_PERMUTED and role in ("q", "k"):
            w = unpermute_rope(w, config.heads if role == "q" else config.kv_heads)
        state[ours] = torch.from_numpy(np.array(w, np.float32))  # a writable copy
        types[t.name] = t.tensor_type.name
        names[ours] = t.name
    check_state(state, config, str(path), names)
    try:
        tokenizer = gguf_tokenizer.tokenizer(reader, path)
    except gguf_tokenizer.TokenizerError as e:
        raise CheckpointError(str(e)) from e
    return Checkpoint(
        path, arch, config, state, tokenizer, gguf_tokenizer.tokenizer_config(reader), types
    )
