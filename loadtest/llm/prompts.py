"""The prompts an LLM load test sends: lines of a text file, records of a JSONL file, or
synthetic prompts of about N tokens cut from English text that ships with Python (the
language reference in `pydoc_data.topics`), never random bytes.

With a tokenizer (`tokenizer.json`, the served model's) a synthetic prompt is exactly N tokens
of that tokenizer's encoding (re-encoded after decoding it may differ by a token at the
edges); without one, N is approximated as words (English averages ~1.3 tokens a word, so
N / 1.3 words). Either way the server's `prompt_tokens` is what the report counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from common.corpus import python_reference

TOKENS_PER_WORD = 1.3


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int | None = None  # a JSONL record's own; else the run's --max-tokens


def from_file(path: Path) -> list[Prompt]:
    """`.jsonl`/`.json`: one JSON value a line, a string or an object with "text" (or
    "prompt", or "text_input") and optionally "max_tokens". Anything else: one prompt a
    line. Blank lines are skipped."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix not in (".jsonl", ".json"):
        return [Prompt(line) for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{number}: not JSON ({e}); a plain prompt needs .txt"
            ) from None
        if isinstance(record, str):
            prompts.append(Prompt(record))
            continue
        keys = ("text", "prompt", "text_input")
        text = (
            next((record[k] for k in keys if k in record), None)
            if isinstance(record, dict)
            else None
        )
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: expected a string or an object with 'text'")
        max_tokens = record.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{path}:{number}: max_tokens must be a positive integer")
        prompts.append(Prompt(text, max_tokens))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def corpus() -> str:
    """About 460 KB of English prose and code from Python's own language reference."""
    return python_reference()


def lengths(mean: int, stddev: float, count: int, seed: int = 0) -> list[int]:
    """`count` prompt lengths, normal around `mean` (clipped to >= 1); all `mean` if 0."""
    if stddev <= 0:
        return [mean] * count
    rng = np.random.default_rng(seed)
    return [max(1, round(x)) for x in rng.normal(mean, stddev, size=count)]


def synthetic(
    sizes: list[int], tokenizer: Tokenizer | None = None, seed: int = 0, text: str | None = None
) -> list[Prompt]:
    """One prompt per size, each a window of the corpus at its own random offset."""
    text = corpus() if text is None else text
    rng = np.random.default_rng(seed)
    if tokenizer is not None:
        ids = tokenizer.encode(text[: 40 * max(sizes) + 200_000], add_special_tokens=False).ids
        out = []
        for n in sizes:
            if n > len(ids):
                raise ValueError(f"a prompt of {n} tokens is longer than the corpus")
            start = int(rng.integers(0, len(ids) - n + 1))
            out.append(Prompt(tokenizer.decode(ids[start : start + n]).strip()))
        return out
    words = text.split(" ")
    prompts = []
    for n in sizes:
        count = max(1, round(n / TOKENS_PER_WORD))
        start = int(rng.integers(0, len(words) - count + 1))
        prompts.append(Prompt(" ".join(words[start : start + count])))
    return prompts


def load_tokenizer(path: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
