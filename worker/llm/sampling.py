"""Sampling parameters (parsed and checked) and the sampler that applies them to logits.

Keys and defaults follow vLLM's SamplingParams, which Triton's vLLM backend passes through, so
a client written for that backend means the same thing here. Values may come as JSON numbers
or as strings (genai-perf sends `{"max_tokens": "32"}`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import llm_protocol as P
from common.errors import InvalidArgument
from worker.llm import guided


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # choices of the request (worker/llm/engine.py: one sequence each)
    logprobs: int | None = None  # top alternatives per token (0: the token's own); None: off
    guide: guided.GuideSpec | None = field(default=None, compare=False)  # structured output
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _number(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise InvalidArgument(f"sampling parameter {key!r}: expected a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InvalidArgument(
                f"sampling parameter {key!r}: expected a number, got {value[:64]!r}"
            ) from None
        return _number(key, value, kind)
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise InvalidArgument(f"sampling parameter {key!r}: expected an integer, got {value!r}")
        return value
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"sampling parameter {key!r}: expected a number, got {value!r}")
    return float(value)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgument(f"sampling parameter {key!r}: expected true or false, got {value!r}")


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        value = parsed if isinstance(parsed, list) else value
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise InvalidArgument(
            f"sampling parameter 'stop': expected a non-empty string or a list of them, got "
            f"{value!r}"
        )
    if len(items) > 16:
        raise InvalidArgument(f"sampling parameter 'stop': at most 16 strings, got {len(items)}")
    return tuple(items)


# key -> (parser, allowed range for the message)
_RANGES = {
    "max_tokens": ">= 1 and <= the model's limit",
    "min_tokens": ">= 0 and <= max_tokens",
    "temperature": ">= 0",
    "top_p": "in (0, 1]",
    "top_k": "-1, 0 (off) or >= 1",
    "seed": "an integer",
    "repetition_penalty": "> 0 (1 = off)",
    "presence_penalty": "in [-2, 2]",
    "frequency_penalty": "in [-2, 2]",
    "stop": "a string or a list of strings",
    "ignore_eos": "true or false",
    "skip_special_tokens": "true or false",
    "n": f">= 1 and <= {P.MAX_N}",
    "logprobs": f">= 0 and <= {P.MAX_LOGPROBS}",
}
INT_KEYS = {"max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs"}
FLOAT_KEYS = {
    "temperature",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
}
BOOL_KEYS = {"ignore_eos", "skip_special_tokens"}
KEYS = frozenset(_RANGES) | frozenset(P.GUIDED_KEYS)
HEAD = 256  # tokens sorted for top-p before falling back to the whole vocabulary


def parse_json(text: str) -> dict[str, Any]:
    """The `sampling_parameters` input: a JSON object."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidArgument(
            f"sampling_parameters is not valid JSON ({e.msg} at position {e.pos}); expected an "
            'object such as {"max_tokens": 64, "temperature": 0}'
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"sampling_parameters must be a JSON object, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - KEYS)
    if unknown:
        raise InvalidArgument(
            f"unknown sampling parameter(s) {[k[:64] for k in unknown]}; allowed: {sorted(KEYS)}"
        )
    return value


def build(values: Mapping[str, Any], max_tokens_limit: int) -> SamplingParams:
    """Checked SamplingParams from raw values (from JSON or the request's parameters)."""
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key in INT_KEYS:
            kwargs[key] = _number(key, value, int)
        elif key in FLOAT_KEYS:
            kwargs[key] = _number(key, value, float)
        elif key in BOOL_KEYS:
            kwargs[key] = _bool(key, value)
        elif key == "stop":
            kwargs[key] = _stop(value)
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0
    p = SamplingParams(**kwargs, guide=guided.parse(values))
    checks = [
        ("max_tokens", 1 <= p.max_tokens <= max_tokens_limit, p.max_tokens),
        ("min_tokens", 0 <= p.min_tokens <= p.max_tokens, p.min_tokens),
        ("temperature", p.temperature >= 0.0, p.temperature),
        ("top_p", 0.0 < p.top_p <= 1.0, p.top_p),
        ("top_k", p.top_k >= 0, p.top_k),
        ("repetition_penalty", p.repetition_penalty > 0.0, p.repetition_penalty),
        ("presence_penalty", -2.0 <= p.presence_penalty <= 2.0, p.presence_penalty),
        ("frequency_penalty", -2.0 <= p.frequency_penalty <= 2.0, p.frequency_penalty),
        ("n", 1 <= p.n <= P.MAX_N, p.n),
        ("logprobs", p.logprobs is None or 0 <= p.logprobs <= P.MAX_LOGPROBS, p.logprobs),
    ]
    for key, ok, value in checks:
        if not ok:
            allowed = _RANGES[key].replace("the model's limit", str(max_tokens_limit))
            raise InvalidArgument(f"sampling parameter {key!r} = {value}: must be {allowed}")
    return p


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, largest first, ties the lower id first: what the step
    graph's own TopK returns (quantize/llm_graph.py), so that a row sampled from the full
    logits and one sampled from the graph's top-k see the same candidates in the same order."""
    kth = np.partition(logits, -k)[-k]
    above = np.flatnonzero(logits > kth)
    ids = np.concatenate([above, np.flatnonzero(logits == kth)[: k - above.size]])
    return ids[np.lexsort((ids, -logits[ids]))]


class Sampler:
    """Per-sequence sampling state: its random generator and token counts for penalties.

    Two ways in, one result: `sample` reads a row of the full logits; `sample_top` reads the
    step graph's own top-k of that row (largest first), which is all a greedy or top-k
    sampler needs (`top_needed`), so the logits never leave onnxruntime. Both pick the
    candidates the same way (`top_ids`) and draw from them with the same arithmetic, so a
    seed gives the same tokens either way."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(params.seed)
        self._seen: np.ndarray | None = None  # prompt + output tokens, for repetition
        self._counts: np.ndarray | None = None  # output tokens, for presence / frequency
        if params.penalized:
            self._seen = np.zeros(vocab_size, bool)
            self._seen[np.asarray(prompt, dtype=np.int64)] = True
            self._counts = np.zeros(vocab_size, np.int32)

    def top_needed(self, banned: int = 0) -> int | None:
        """How many of a row's largest logits this sampler needs, with `banned` ids to skip;
        None: the whole row (penalties change any logit; top_p alone spans the vocabulary)."""
        p = self.params
        if p.penalized or p.guide is not None or p.logprobs is not None:
            return None  # a mask or a log-softmax needs the whole row
        if p.greedy:
            return 1 + banned
        if p.top_k and p.top_k < self.vocab_size:
            return p.top_k + banned
        return None

    def observe(self, token: int) -> None:
        if self._seen is not None and self._counts is not None:
            self._seen[token] = True
            self._counts[token] += 1

    def sample(
        self,
        logits: np.ndarray,
        banned: list[int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        """One token from logits [vocab] (float32, modified in place); `allowed`: a grammar's
        mask [vocab] (worker/llm/guided.py), applied before temperature, top-k and top-p."""
        p = self.params
        if self._seen is not None and self._counts is not None:
            if p.repetition_penalty != 1.0:
                seen = logits[self._seen]
                logits[self._seen] = np.where(
                    seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty
                )
            if p.presence_penalty or p.frequency_penalty:
                logits -= p.presence_penalty * (self._counts > 0)
                logits -= p.frequency_penalty * self._counts
        if banned:
            logits[banned] = -np.inf
        if allowed is not None:
            logits[~allowed] = -np.inf
        if p.greedy:
            return int(logits.argmax())
        if p.top_k and p.top_k < logits.shape[0]:
            ids = top_ids(logits, p.top_k)
            return self._draw(logits[ids], ids)
        return self._draw(logits, None)

    def sample_top(
        self, values: np.ndarray, ids: np.ndarray, banned: list[int] | None = None
    ) -> int:
        """One token from a row's largest logits `values` [k] and their `ids` [k], largest
        first (ties: the lower id first), k >= top_needed(len(banned)): the same token
        `sample` gives for the full row."""
        if banned:
            keep = ~np.isin(ids, banned)
            values, ids = values[keep], ids[keep]
        p = self.params
        if p.greedy:
            return int(ids[0])
        return self._draw(values[: p.top_k], ids[: p.top_k])

    def _draw(self, logits: np.ndarray, ids: np.ndarray | None) -> int:
        """A token drawn from the candidates' logits (top_p within them); ids: theirs (None:
        the candidates are the whole vocabulary)."""
        p = self.params
        logits = logits / p.temperature
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            # The nucleus is almost always within the top few hundred tokens: sort those,
            # and the whole vocabulary only when they do not hold top_p of the mass.
            head = min(HEAD, probs.shape[0])
            top = np.argpartition(probs, -head)[-head:]
            top = top[np.argsort(-probs[top], kind="stable")]
            mass = np.cumsum(probs[top])
            if mass[-1] < p.top_p and head < probs.shape[0]:
                top = np.argsort(-probs, kind="stable")
                mass = np.cumsum(probs[top])
            keep = min(int(np.searchsorted(mass, p.top_p)) + 1, top.shape[0])
            top = top[:keep]
            choice = top[int(np.searchsorted(mass[:keep], self.rng.random() * mass[keep - 1]))]
        else:
            cdf = np.cumsum(probs)
            choice = int(np.searchsorted(cdf, self.rng.random() * cdf[-1]))
            choice = min(choice, probs.shape[0] - 1)
        return int(choice if ids is None else ids[choice])
