"""Structured output: the tokens a grammar allows next, as a mask over the vocabulary.

A request names one grammar with one of the `guided_*` sampling parameters (vLLM's keys,
common/llm_protocol.py): a JSON schema, any JSON object, a regex, a list of choices, or a
Lark / GBNF grammar. llguidance (Microsoft's grammar engine, one of vLLM's and llama.cpp's)
turns it into a matcher over the model's own tokenizer. xgrammar computes a mask and
advances about 8x faster per token (benchmarks/llm_structured.py), but its Python package
imports torch and transformers (seconds, and a plain worker never imports torch) and takes
seconds to compile a schema; llguidance's tens of microseconds a row, computed while the
model runs, keep 16 constrained streams at about the unconstrained decode rate
(docs/decisions.md).

Each constrained sequence has a `Guide`: its matcher and the mask of its next token, which
a small thread pool computes (llguidance releases the GIL) while the model runs the step
that will be sampled with it; the sampler waits for it, masks the logits (worker/llm/
sampling.py), and `advance` commits the token and starts the next mask at once. EOS is in
the mask only where the grammar accepts; a grammar that allows nothing more ends its
sequence (`ended_at`: finish_reason stop) without waiting for the model's EOS.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from tokenizers import Tokenizer

from common import llm_protocol as P
from common.errors import InvalidArgument

# Threads computing masks: a mask takes 10-400 us, and on a CPU worker the model's runs
# want the cores, so two keep up with 16+ streams without crowding onnxruntime.
MASK_THREADS = 2
EXPECTED = {
    P.GUIDED_JSON: "a JSON schema (an object, or a string holding one)",
    P.GUIDED_JSON_OBJECT: "true or false",
    P.GUIDED_REGEX: "a regular expression (Rust regex syntax)",
    P.GUIDED_CHOICE: "a non-empty list of non-empty strings",
    P.GUIDED_GRAMMAR: "a Lark or GBNF grammar",
}


@dataclass(frozen=True)
class GuideSpec:
    key: str  # the sampling parameter it came from, for messages
    grammar: str  # llguidance's grammar text


def _bad(key: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"sampling parameter {key!r}: expected {EXPECTED[key]}; {why}"[:600])


def _json_value(key: str, value: Any) -> Any:
    """A value sent as JSON text (the request's parameters map carries strings)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise _bad(key, f"not valid JSON ({e.msg} at position {e.pos})") from None


def _json_grammar(schema: dict) -> str:
    # compact separators, as vLLM's default: a small model left free to indent may spend
    # its max_tokens on whitespace
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )


def parse(values: Mapping[str, Any]) -> GuideSpec | None:
    """The request's grammar from its sampling values (None: unconstrained); the grammar's
    own errors surface when it is compiled (`Vocabulary.guide`)."""
    given = [k for k in P.GUIDED_KEYS if values.get(k) not in (None, False, "false")]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgument(
            f"sampling parameters {given}: at most one guided_* key per request, got {len(given)}"
        )
    key = given[0]
    value = values[key]
    if key == P.GUIDED_JSON:
        schema = _json_value(key, value)
        if not isinstance(schema, dict):
            raise _bad(key, f"got {type(schema).__name__}")
        return GuideSpec(key, _json_grammar(schema))
    if key == P.GUIDED_JSON_OBJECT:
        if value not in (True, "true"):
            raise _bad(key, f"got {value!r}")
        return GuideSpec(key, _json_grammar({"type": "object"}))
    if key == P.GUIDED_CHOICE:
        choices = _json_value(key, value)
        if not isinstance(choices, list) or not choices:
            raise _bad(key, f"got {type(choices).__name__}")
        if not all(isinstance(c, str) and c for c in choices):
            raise _bad(key, "an item is not a non-empty string")
        return GuideSpec(key, llguidance.grammar_from("choice", json.dumps(choices)))
    if not isinstance(value, str) or not value:
        raise _bad(key, f"got {type(value).__name__}")
    if key == P.GUIDED_REGEX:
        return GuideSpec(key, llguidance.LLMatcher.grammar_from_regex(value))
    try:
        return GuideSpec(key, llguidance.grammar_from("grammar", value))
    except ValueError as e:
        raise _bad(key, str(e)) from None


class Vocabulary:
    """The model's tokenizer as llguidance sees it (built once, ~1 s, on first use: call
    `ready` off the event loop), the mask threads, and each token's bytes (for logprobs)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: set[int]) -> None:
        self.vocab_size = vocab_size
        self._source = (tokenizer, sorted(eos))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._bytes: dict[int, bytes] = {}

    def ready(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                tokenizer, eos = self._source
                self._tokenizer = llguidance.LLTokenizer(
                    tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
                self._pool = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="llm-mask")
            return self._tokenizer

    def guides(self, spec: GuideSpec, n: int = 1) -> list[Guide]:
        """`n` matchers for `spec` at its start (one compile; a resumed request's earlier
        ids advance it as they are replayed); a grammar llguidance refuses is
        INVALID_ARGUMENT naming the key."""
        tokenizer = self.ready()
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise _bad(spec.key, matcher.get_error())
        assert self._pool is not None
        matchers = [matcher, *(matcher.deep_copy() for _ in range(n - 1))]
        return [Guide(m, self.vocab_size, self._pool) for m in matchers]

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token may hold part of a
        character, which its text cannot show)."""
        found = self._bytes.get(token)
        if found is None:
            found = self._bytes[token] = self.ready().decode_bytes([token])
        return found

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Guide:
    """One sequence's matcher and its next token's mask, computed ahead on the mask threads.
    The step thread alone calls `allowed` and `advance`, one after the other per token."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, pool: ThreadPoolExecutor
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._pool = pool
        self.generated = 0
        self.ended_at: int | None = None  # tokens generated when the grammar allowed no more
        self._next: Future[np.ndarray] = pool.submit(self._fill)

    def _fill(self) -> np.ndarray:
        mask = np.empty(self._words, np.int32)
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def allowed(self) -> np.ndarray:
        """The next token's mask as bools [vocab] (waits for it: it was started when the
        last token was committed, so it is ready unless the run was faster than it)."""
        bits = self._next.result().view(np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(np.bool_)

    def advance(self, token: int) -> None:
        """Commit the sampled token; start the next mask, unless the grammar is done."""
        self.generated += 1
        if not self.matcher.consume_token(token) or self.matcher.is_stopped():
            self.ended_at = self.generated
            return
        self._next = self._pool.submit(self._fill)

    def ends(self, generated: int) -> bool:
        """Whether the grammar ended with the sequence's `generated`-th token."""
        return self.ended_at is not None and self.ended_at == generated
