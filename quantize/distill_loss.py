"""What a distilled student is trained to match (quantize/distill.py trains it): an
encoder's sentence embeddings, each kept layer's hidden states and MiniLM's self-attention
relations; a decoder's next-token distributions at a temperature (Hinton et al.)."""

from __future__ import annotations

import torch
from torch import nn

from quantize.models import MASKED, BertEncoder, BertLayer, LlamaDecoder, bert_inputs, mean_pool


def encoder_states(
    model: BertEncoder, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The sentence embedding, every layer's hidden states (BertEncoder.forward's steps)
    and the last layer's input."""
    x, bias = bert_inputs(model, ids, mask)
    hidden = []
    last_input = x
    for layer in model.layers:
        last_input = x
        x = layer(x, bias)
        hidden.append(x)
    return mean_pool(x, mask), hidden, last_input


def relations(layer: BertLayer, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MiniLM's (Wang et al., 2020) self-attention relations of `layer` on its input `x`:
    log softmax(QK^T / sqrt d) and log softmax(VV^T / sqrt d) over the real keys, per head,
    stacked [2, batch, heads, seq, seq]."""
    b, s, _ = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, s, -1, layer.head_dim).transpose(1, 2)

    q, k, v = split(layer.q(x)), split(layer.k(x)), split(layer.v(x))
    bias = ((1.0 - mask.to(x.dtype)) * MASKED)[:, None, None, :]
    scale = layer.head_dim**0.5
    return torch.stack(
        [
            (q @ k.transpose(-1, -2) / scale + bias).log_softmax(-1),
            (v @ v.transpose(-1, -2) / scale + bias).log_softmax(-1),
        ]
    )


def encoder_loss(
    teacher: BertEncoder,
    student: BertEncoder,
    kept: list[int],
    ids: torch.Tensor,
    mask: torch.Tensor,
    intermediate_weight: float,
    relation_weight: float = 0.0,
) -> torch.Tensor:
    """1 - cosine of the sentence embeddings; with `intermediate_weight`, of each kept
    layer's hidden state at every real token; with `relation_weight`, KL(teacher ||
    student) of the last layer's `relations`, over the real query tokens."""
    with torch.no_grad():
        target, target_hidden, target_last = encoder_states(teacher, ids, mask)
    embedding, hidden, last = encoder_states(student, ids, mask)
    loss = (1.0 - (embedding * target).sum(-1)).mean()  # both unit length
    if relation_weight:
        with torch.no_grad():
            t = relations(teacher.layers[-1], target_last, mask)  # type: ignore[arg-type]
        r = relations(student.layers[-1], last, mask)  # type: ignore[arg-type]
        kl = (t.exp() * (t - r)).sum(-1)  # [2, batch, heads, seq]
        m = mask.to(kl.dtype)[None, :, None, :]
        loss = loss + relation_weight * (kl * m).sum() / (m.sum() * kl.shape[0] * kl.shape[2])
    if intermediate_weight:
        m = mask.to(embedding.dtype)
        per_layer = [
            ((1.0 - nn.functional.cosine_similarity(h, target_hidden[t], dim=-1)) * m).sum()
            / m.sum()
            for h, t in zip(hidden, kept, strict=True)
        ]
        loss = loss + intermediate_weight * torch.stack(per_layer).mean()
    return loss


def decoder_loss(
    teacher: LlamaDecoder,
    student: LlamaDecoder,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at `temperature`, times T^2,
    averaged over the real (unpadded) positions."""
    with torch.no_grad():
        target = teacher(ids, mask, *teacher.empty_cache(ids.shape[0]))[0]
    logits = student(ids, mask, *student.empty_cache(ids.shape[0]))[0]
    t = nn.functional.log_softmax(target / temperature, dim=-1)
    s = nn.functional.log_softmax(logits / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum() * temperature**2
