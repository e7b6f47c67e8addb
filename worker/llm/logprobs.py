"""Log-probabilities of generated tokens: the log-softmax of the model's own logits (before
penalties, bans, a grammar's mask or temperature, as vLLM reports them by default) for the
sampled token and the top-N alternatives, in common/llm_protocol.py's RESPONSE_LOGPROBS shape.
"""

from __future__ import annotations

import numpy as np

from worker.llm.guided import Vocabulary
from worker.llm.sampling import top_ids


def log_normalizer(logits: np.ndarray) -> float:
    """log(sum(exp(logits))), computed stably."""
    m = float(logits.max())
    return m + float(np.log(np.exp(logits - m, dtype=np.float64).sum()))


def entry(logits: np.ndarray, token: int, top: int, vocab: Vocabulary) -> dict:
    """The sampled `token`'s entry: its logprob and the `top` most likely tokens' (largest
    first, ties the lower id first), from the row's unmodified logits."""
    z = log_normalizer(logits)
    ids = top_ids(logits, top) if top else ()
    alternatives = [_one(int(i), float(logits[i]) - z, vocab) for i in ids]
    return {**_one(token, float(logits[token]) - z, vocab), "top_logprobs": alternatives}


def _one(token: int, logprob: float, vocab: Vocabulary) -> dict:
    data = vocab.token_bytes(token)
    return {
        "id": token,
        "token": data.decode("utf-8", errors="replace"),
        "bytes": list(data),
        "logprob": logprob,
    }
