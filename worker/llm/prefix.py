"""The prefix cache's keys and records: a prompt cut into blocks of token ids, each named
by a hash, and what worker/llm/kv_manager.py keeps and answers about its slots.

Block i's key is BLAKE2b (16 bytes) chained over block i-1's key and block i's ids (vLLM's
scheme), from a root that hashes the model, its version, an adapter and the request's
`cache_salt`: a match of block i is a match of every token before it, and never crosses
models, versions, adapters or salts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
# A prompt's last tokens that always run, even when cached: two, in one run, as in a cold
# prefill (scheduler.MIN_CHUNK: a prompt token never runs alone)
RERUN = 2


def root_key(model: str, version: str, adapter: str = "", salt: str = "") -> bytes:
    """The chain's start: what a match must agree on besides the tokens."""
    text = "\x1f".join((model, version, adapter, salt)).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def block_keys(root: bytes, tokens: Sequence[int], block: int, start: int = 0) -> list[bytes]:
    """The chained keys of the whole blocks of `tokens`; `start` > 0 continues a chain whose
    last key is `root` (blocks from `start` on)."""
    keys = []
    parent = root
    for b in range(start, len(tokens) // block):
        ids = b"".join(t.to_bytes(4, "little") for t in tokens[b * block : (b + 1) * block])
        parent = hashlib.blake2b(parent + ids, digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Held:
    """What one slot holds: the token ids of its valid rows, from position 0."""

    slot: int
    root: bytes
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # of its whole blocks
    running: bool = True
    reserve: int = 0  # tokens reserved while running
    pins: int = 0  # copies from it planned, not yet done
    # the run's row for the last of `tokens` when they are a whole prompt (logits, or the
    # graph's top-k as (values, ids)): the prompt's first token, without a run
    last: object | None = None


@dataclass(frozen=True)
class Match:
    slot: int  # the slot holding the prefix
    tokens: int  # prompt tokens it holds (0: no match)
    last: object | None = None  # a whole prompt: the row its first token is sampled from


NO_MATCH = Match(-1, 0)


@dataclass(frozen=True)
class Plan:
    """Admission's answer: the slot, and the rows to copy into it (copy_from -1: none)."""

    slot: int
    cached: int  # prompt tokens already in the slot once the copy is done
    copy_from: int = -1


@dataclass
class PrefixStats:
    hits: int = 0  # admitted sequences that reused a prefix
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled
    evicted_blocks: int = 0
    moved_tokens: int = 0  # finished prompts' rows moved to the retained region
    twins: int = 0  # finished prompts not moved: a retained slot held their rows already
