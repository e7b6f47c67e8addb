"""Our own compact torch definitions of the two reference models.

- `BertEncoder`: BERT with mean pooling over the attention mask and L2 normalisation
  (all-MiniLM-L6-v2's sentence-transformers pipeline in one module).
- `LlamaDecoder`: Llama (RoPE, grouped-query attention, RMSNorm, SwiGLU) whose KV cache is
  an explicit input and output, so one ONNX graph serves both the prompt and every decode
  step, and the server, not the graph, owns the cache.

Every projection is its own `nn.Linear` with heads as plain attributes, so the
tensor-parallel issue can split q/k/v/gate/up by output rows and o/down by input columns.
Attention is written out (matmul, mask, softmax) rather than fused: the exported graph is
then plain MatMul/Softmax that every onnxruntime quantizer understands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Added to the scores of keys a query may not see. Finite, so fp16 conversion cannot
# overflow it and a row that sees nothing (a padding query) stays finite instead of NaN.
MASKED = -1.0e4


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    eps: float = 1e-12


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 49152
    hidden: int = 576
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    intermediate: int = 1536
    rope_theta: float = 100000.0
    eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # q/k/v projections with a bias (qwen2)
    context_length: int = 8192  # the positions it was trained for (RoPE tables this long)
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by this
    # per-frequency divisors of RoPE's angles (llama3's scaling; GGUF's rope_freqs.weight)
    rope_freq_factors: tuple[float, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def inv_freq(c: DecoderConfig) -> torch.Tensor:
    """RoPE's angle per position for each pair of dimensions (float64), with the model's
    scaling: llama.cpp's theta = pos * base^(-2i/d) / factor_i / scale."""
    freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    if c.rope_freq_factors:
        freq = freq / torch.tensor(c.rope_freq_factors, dtype=torch.float64)
    return freq / c.rope_scale


# The pieces below take `m`, the module that holds the projections: a whole layer, or one
# tensor-parallel rank's slice of it (quantize/shard.py), so both compute the same way.


def attention(m: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """BERT self-attention through m.q/k/v/o over however many heads of m.head_dim they hold."""
    b, s, _ = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, s, -1, m.head_dim).transpose(1, 2)

    q, k, v = split(m.q(x)), split(m.k(x)), split(m.v(x))
    scores = q @ k.transpose(-1, -2) / m.head_dim**0.5 + bias
    return m.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


def gelu_mlp(m: Any, x: torch.Tensor) -> torch.Tensor:
    return m.down(nn.functional.gelu(m.up(x)))


def bert_inputs(
    m: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings (m.word/position/token_type/embed_norm) and the padding bias."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = m.embed_norm(m.word(input_ids) + m.position(positions) + m.token_type.weight[0])
    bias = ((1.0 - attention_mask.to(x.dtype)) * MASKED)[:, None, None, :]
    return x, bias


def mean_pool(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens, normalized to unit length (sentence-transformers)."""
    mask = attention_mask.to(x.dtype)
    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
    return nn.functional.normalize(pooled, dim=-1)


class BertLayer(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.head_dim = c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.hidden)
        self.k = nn.Linear(c.hidden, c.hidden)
        self.v = nn.Linear(c.hidden, c.hidden)
        self.o = nn.Linear(c.hidden, c.hidden)
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.eps)
        self.up = nn.Linear(c.hidden, c.intermediate)
        self.down = nn.Linear(c.intermediate, c.hidden)
        self.ffn_norm = nn.LayerNorm(c.hidden, eps=c.eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + attention(self, x, bias))
        return self.ffn_norm(x + gelu_mlp(self, x))


class BertEncoder(nn.Module):
    """input_ids, attention_mask [batch, seq] int64 -> unit-length embeddings [batch, hidden]."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden)
        self.embed_norm = nn.LayerNorm(c.hidden, eps=c.eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x, bias = bert_inputs(self, input_ids, attention_mask)
        for layer in self.layers:
            x = layer(x, bias)
        return mean_pool(x, attention_mask)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def gqa_attention(
    m: Any,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    bias: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-query attention with RoPE and the KV cache, through m.q/k/v/o over m.heads
    query heads sharing m.kv_heads KV heads; returns (output, keys, values) with the cache."""
    b, s, _ = h.shape
    hd = m.head_dim
    q = m.q(h).reshape(b, s, m.heads, hd).transpose(1, 2)
    k = m.k(h).reshape(b, s, m.kv_heads, hd).transpose(1, 2)
    v = m.v(h).reshape(b, s, m.kv_heads, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = torch.cat((past_k, k), dim=2)
    v = torch.cat((past_v, v), dim=2)
    rep = m.heads // m.kv_heads
    t = k.shape[2]
    kr = k[:, :, None].expand(b, m.kv_heads, rep, t, hd).reshape(b, -1, t, hd)
    vr = v[:, :, None].expand(b, m.kv_heads, rep, t, hd).reshape(b, -1, t, hd)
    scores = q @ kr.transpose(-1, -2) / hd**0.5 + bias
    attn = (scores.softmax(-1) @ vr).transpose(1, 2).reshape(b, s, -1)
    return m.o(attn), k, v


def swiglu_mlp(m: Any, h: torch.Tensor) -> torch.Tensor:
    return m.down(nn.functional.silu(m.gate(h)) * m.up(h))


def decoder_inputs(
    m: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings (m.embed), RoPE angles (m.inv_freq) and the causal + padding bias.

    Positions come from the mask, so left-padded rows get the positions they would have
    alone; attention_mask covers the past and the new tokens."""
    s = input_ids.shape[1]
    total = attention_mask.shape[1]
    past = total - s
    x = m.embed(input_ids)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    freqs = positions[..., None].to(x.dtype) * m.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, head_dim]
    query_at = torch.arange(s, device=x.device)[:, None] + past
    key_at = torch.arange(total, device=x.device)[None, :]
    visible = (key_at <= query_at)[None, None] & (attention_mask[:, None, None, :] > 0)
    bias = torch.where(visible, 0.0, MASKED).to(x.dtype)
    return x, angles.cos(), angles.sin(), bias


class LlamaLayer(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.head_dim
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.qkv_bias)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)
        self.attn_norm = RMSNorm(c.hidden, c.eps)
        self.ffn_norm = RMSNorm(c.hidden, c.eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, k, v = gqa_attention(self, self.attn_norm(x), cos, sin, bias, past_k, past_v)
        x = x + attn
        x = x + swiglu_mlp(self, self.ffn_norm(x))
        return x, k, v


class LlamaDecoder(nn.Module):
    """One step of a Llama decoder with the KV cache passed in and out.

    inputs: input_ids [batch, seq] int64; attention_mask [batch, past + seq] int64 (1 = a real
    token; left padding allowed); past_keys, past_values [batch, layers, kv_heads, past,
    head_dim] float32 (past may be 0; batch first, so a server can merge decode steps).
    outputs: logits [batch, seq, vocab]; present_keys, present_values [batch, layers,
    kv_heads, past + seq, head_dim]. Positions come from the mask, so left-padded rows get
    the positions they would have alone.
    """

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq(c).float(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, cos, sin, bias = decoder_inputs(self, input_ids, attention_mask)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, bias, past_keys[:, i], past_values[:, i])
            keys.append(k)
            values.append(v)
        logits = self.lm_head(self.norm(x))
        return logits, torch.stack(keys, dim=1), torch.stack(values, dim=1)

    def empty_cache(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        shape = (batch, c.layers, c.kv_heads, 0, c.head_dim)
        return torch.zeros(shape), torch.zeros(shape)


@torch.no_grad()
def greedy(
    model: LlamaDecoder, input_ids: torch.Tensor, new_tokens: int, eos: int | None = None
) -> list[int]:
    """Greedy continuation of one prompt [1, seq] using the KV cache; returns new token ids."""
    keys, values = model.empty_cache(1)
    mask = torch.ones_like(input_ids)
    ids = input_ids
    out: list[int] = []
    for _ in range(new_tokens):
        logits, keys, values = model(ids, mask, keys, values)
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
        ids = torch.tensor([[token]])
        mask = torch.cat((mask, torch.ones(1, 1, dtype=mask.dtype)), dim=1)
    return out
