"""Text in, embeddings out: the worker tokenizes, so clients send plain strings.

A model whose config names a tokenizer (`meshserve.tokenizer`, a tokenizer.json in the model
folder) and the task `meshserve.text_task: embed` takes a BYTES input TEXT [batch, 1]
besides its token-id inputs, which stay usable as before. (Text generation is the LLM
engine's, worker/llm/.)

Batching. Each request is tokenized here, before the batcher, and right-padded to the next
multiple of BUCKET tokens. The batcher stays shape-agnostic and merges requests
whose padded shapes are equal, so sentences of similar length (within 16 tokens) share one
session run, and no row carries more than BUCKET - 1 padding tokens. Padding every batch to
its longest member would merge more, but the batcher would then have to know pad values and
cut padding back off per-token outputs; bucketing gets the gain with neither.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from common import bytes_codec, model_keys
from common.errors import InvalidArgument
from worker.config import (
    TEXT_INPUT,
    TEXT_TASK,
    TOKENIZER,
    ConfigError,
    ModelSpec,
)

BUCKET = 16
EMBED = "embed"
IDS, MASK = "input_ids", "attention_mask"

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
        # A text past the model's own capacity (meshserve.max_input_tokens: its position
        # table) is refused by name, as OpenAI and vLLM refuse; within it the tokenizer's own
        # truncation (sentence-transformers' reading window) applies as before.
        self.max_tokens = _max_tokens(spec)
        self._untruncated = Tokenizer.from_str(self.tokenizer.to_str())
        self._untruncated.no_truncation()
        self.token_inputs = [n for n in spec.inputs if n != TEXT_INPUT]
        need = [IDS, MASK]
        if sorted(need) != sorted(self.token_inputs):
            raise ConfigError(
                f"model {spec.name!r}: text_task {self.task!r} needs graph inputs {need}, "
                f"the model has {self.token_inputs}"
            )
        self.pad = self.tokenizer.token_to_id("[PAD]") or 0

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict:
        return (await self.infer_counted(inputs, outputs))[0]

    async def infer_counted(
        self, inputs: dict[str, np.ndarray], outputs: list[str]
    ) -> tuple[dict, int]:
        """The outputs and the prompt tokens read (the mask's ones: padding is not counted),
        which OpenAI's embeddings usage reports."""
        if TEXT_INPUT not in inputs:
            missing = [n for n in self.token_inputs if n not in inputs]
            if missing:
                raise InvalidArgument(
                    f"model {self.spec.name!r} takes either {TEXT_INPUT} (BYTES [batch, 1]) or "
                    f"the token inputs {self.token_inputs}; missing {missing}"
                )
            read = inputs[MASK] if MASK in inputs else inputs[IDS]
            tokens = int(np.count_nonzero(read)) if MASK in inputs else int(read.size)
            return await self.submit(inputs, outputs), tokens
        # A generic client (perf_analyzer) fills every input of the metadata: TEXT is served
        # and the optional token inputs beside it are not read (worker/codec.py checked that
        # they describe the same batch).
        texts = [bytes_codec.text(x, TEXT_INPUT) for x in inputs[TEXT_INPUT].reshape(-1)]
        ids, mask = self.encode(texts, left=False)
        return await self.submit({IDS: ids, MASK: mask}, outputs), int(mask.sum())

    def encode(self, texts: list[str], left: bool) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        limit = self.max_tokens
        for i, e in enumerate(encodings if limit is not None else ()):
            n = len(self._untruncated.encode(texts[i]).ids) if e.overflowing else len(e.ids)
            if limit is not None and n > limit:
                raise InvalidArgument(
                    f"input {TEXT_INPUT!r} row {i} is too large: {n} tokens; model "
                    f"{self.spec.name!r} takes at most {limit} "
                    f"({model_keys.MAX_INPUT_TOKENS})"
                )
        width = bucket(max(len(e.ids) for e in encodings))
        ids = np.full((len(texts), width), self.pad, np.int64)
        mask = np.zeros((len(texts), width), np.int64)
        for i, e in enumerate(encodings):
            n = len(e.ids)
            span = slice(width - n, width) if left else slice(0, n)
            ids[i, span] = e.ids
            mask[i, span] = 1
        return ids, mask

    def warm_up(self, run: RunFn) -> None:
        """One real run through the session, on tokens of real text."""
        ids, mask = self.encode(["warm up"], left=False)
        run(list(self.spec.outputs), {IDS: ids, MASK: mask})


def _max_tokens(spec: ModelSpec) -> int | None:
    raw = spec.parameters.get(model_keys.MAX_INPUT_TOKENS)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(
            f"model {spec.name!r}: parameter {model_keys.MAX_INPUT_TOKENS} must be a positive "
            f"integer, got {raw!r}"
        )
    return int(raw)
