"""Text in, embeddings or text out: the worker tokenizes, so clients send plain strings.

A model whose config names a tokenizer (`meshserve.tokenizer`, a tokenizer.json in the model
folder) and a task (`meshserve.text_task`: `embed` or `generate`) takes a BYTES input TEXT
[batch, 1] besides its token-id inputs, which stay usable as before.

Batching. Each request is tokenized here, before the batcher, and padded to the next
multiple of BUCKET tokens (right padding for the encoder, left padding for the decoder,
whose positions come from the mask). The batcher stays shape-agnostic and merges requests
whose padded shapes are equal, so sentences of similar length (within 16 tokens) share one
session run, and no row carries more than BUCKET - 1 padding tokens. Padding every batch to
its longest member would merge more, but the batcher would then have to know pad values and
cut padding back off per-token outputs; bucketing gets the gain with neither.

Generation is greedy, with the KV cache held here between steps: a prefill, then one
step per token, each submitted to the batcher, so concurrent generations whose cache
lengths line up (same prompt bucket, same step) run as one batch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from common.errors import InvalidArgument
from worker.config import (
    MAX_NEW_TOKENS,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TEXT_TASK,
    TOKENIZER,
    ConfigError,
    ModelSpec,
)

BUCKET = 16
EMBED, GENERATE = "embed", "generate"
IDS, MASK, PAST_KEYS, PAST_VALUES = "input_ids", "attention_mask", "past_keys", "past_values"
LOGITS, PRESENT_KEYS, PRESENT_VALUES = "logits", "present_keys", "present_values"
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>")

Submit = Callable[[dict[str, np.ndarray], list[str]], Awaitable[dict[str, np.ndarray]]]
RunFn = Callable[[list[str], dict[str, np.ndarray]], list[np.ndarray]]


def bucket(length: int) -> int:
    return max(BUCKET, -(-length // BUCKET) * BUCKET)


class TextModel:
    """Tokenizer + task for one model version; `infer` replaces a plain batcher submit."""

    def __init__(self, spec: ModelSpec, model_dir: Path, submit: Submit) -> None:
        self.spec = spec
        self.submit = submit
        self.task = spec.parameters[TEXT_TASK]
        path = model_dir / spec.parameters[TOKENIZER]
        if not path.is_file():
            raise ConfigError(f"model {spec.name!r}: tokenizer {path} does not exist")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.token_inputs = [n for n in spec.inputs if n != TEXT_INPUT]
        need = [IDS, MASK] + ([PAST_KEYS, PAST_VALUES] if self.task == GENERATE else [])
        if sorted(need) != sorted(self.token_inputs):
            raise ConfigError(
                f"model {spec.name!r}: text_task {self.task!r} needs graph inputs {need}, "
                f"the model has {self.token_inputs}"
            )
        self.max_new_tokens = int(spec.parameters.get(MAX_NEW_TOKENS, "32"))
        self.eos = {i for t in EOS_TOKENS if (i := self.tokenizer.token_to_id(t)) is not None}
        self.pad = self.tokenizer.token_to_id("[PAD]") or 0

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict:
        if TEXT_INPUT not in inputs:
            missing = [n for n in self.token_inputs if n not in inputs]
            if missing:
                raise InvalidArgument(
                    f"model {self.spec.name!r} takes either {TEXT_INPUT} (BYTES [batch, 1]) or "
                    f"the token inputs {self.token_inputs}; missing {missing}"
                )
            return await self.submit(inputs, [o for o in outputs if o != TEXT_OUTPUT])
        extra = sorted(set(inputs) - {TEXT_INPUT})
        if extra:
            raise InvalidArgument(
                f"send {TEXT_INPUT}, or instead the token inputs {self.token_inputs} (optional "
                f"in ModelConfig), not both (got {TEXT_INPUT} and {extra})"
            )
        texts = [_text(x) for x in inputs[TEXT_INPUT].reshape(-1)]
        if self.task == EMBED:
            ids, mask = self.encode(texts, left=False)
            return await self.submit({IDS: ids, MASK: mask}, outputs)
        if TEXT_OUTPUT not in outputs:
            raise InvalidArgument(f"a {TEXT_INPUT} request to a generator returns {TEXT_OUTPUT}")
        generated = await self.generate(texts)
        out = np.empty((len(texts), 1), dtype=object)
        out[:, 0] = [self.tokenizer.decode(g, skip_special_tokens=True).encode() for g in generated]
        return {TEXT_OUTPUT: out}

    def encode(self, texts: list[str], left: bool) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        width = bucket(max(len(e.ids) for e in encodings))
        ids = np.full((len(texts), width), self.pad, np.int64)
        mask = np.zeros((len(texts), width), np.int64)
        for i, e in enumerate(encodings):
            n = len(e.ids)
            span = slice(width - n, width) if left else slice(0, n)
            ids[i, span] = e.ids
            mask[i, span] = 1
        return ids, mask

    def empty_cache(self, rows: int) -> np.ndarray:
        layers, heads, _, dim = self.spec.inputs[PAST_KEYS].dims
        return np.zeros((rows, layers, heads, 0, dim), np.float32)

    async def generate(self, texts: list[str]) -> list[list[int]]:
        ids, mask = self.encode(texts, left=True)
        keys = values = self.empty_cache(len(texts))
        generated: list[list[int]] = [[] for _ in texts]
        done = np.zeros(len(texts), bool)
        names = [LOGITS, PRESENT_KEYS, PRESENT_VALUES]
        for _ in range(self.max_new_tokens):
            out = await self.submit(
                {IDS: ids, MASK: mask, PAST_KEYS: keys, PAST_VALUES: values}, names
            )
            tokens = out[LOGITS][:, -1].argmax(-1)
            for i, t in enumerate(tokens):
                if done[i] or int(t) in self.eos:
                    done[i] = True
                else:
                    generated[i].append(int(t))
            if done.all():
                break
            keys, values = out[PRESENT_KEYS], out[PRESENT_VALUES]
            ids = tokens.astype(np.int64)[:, None]
            mask = np.concatenate([mask, np.ones((len(texts), 1), np.int64)], axis=1)
        return generated

    def warm_up(self, run: RunFn) -> None:
        """One real run through the session (the zero-filled generic warm-up cannot build
        a consistent mask and cache for a decoder)."""
        ids, mask = self.encode(["warm up"], left=self.task == GENERATE)
        feeds = {IDS: ids, MASK: mask}
        if self.task == GENERATE:
            feeds[PAST_KEYS] = feeds[PAST_VALUES] = self.empty_cache(1)
        run([n for n in self.spec.outputs if n != TEXT_OUTPUT], feeds)


def _text(item: object) -> str:
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"{TEXT_INPUT} is not valid UTF-8: {e}") from e
    return str(item)
