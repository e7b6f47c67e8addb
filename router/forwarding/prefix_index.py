"""What the router believes each replica's prefix cache holds: an approximate index over
the prompts it routed, in blocks of the prompt's bytes with chained keys.

The router does not tokenize (it forwards bytes untouched and keeps no tokenizer, torch or
numpy), so a block here is `block_bytes` bytes of the prompt text (64 bytes: about 16
tokens of English, the worker's block), each block's key hashed over the previous key, the
model, and the request's `cache_salt` (as the worker keys its own blocks: a salted request
is never credited with an unsalted prefix). A replica "holds" a block when this router sent
it a prompt with that block; it learns nothing from the workers (SGLang's cache-aware router
works the same way). What it may get wrong, and why that is fine:

- the worker evicted the block since: the router overestimates the overlap, the request
  prefills a little more than scored; load still counts in the cost;
- another router sent the prefix: underestimated, routed as a miss (balanced by load).

A restarted replica holds nothing: entries are keyed by replica id and start time, and
`forget` drops a replica's entries when the router sees it restart (a new start time) or
leave the registry. The index is
an LRU of at most `max_blocks` block keys (each with the few replicas that hold it), and a
prompt counts at most `max_prompt_blocks` blocks: bounded memory whatever clients send.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from google.protobuf.message import DecodeError

from common import llm_protocol
from protos.routing_pb2 import PromptHeader

BLOCK_BYTES = 64
PROMPT_INPUTS = (llm_protocol.TEXT_INPUT, llm_protocol.MESSAGES)


def prompt_of(raw: bytes) -> tuple[bytes, str] | None:
    """The prompt of a ModelInferRequest's bytes (text_input or messages, raw or typed
    contents) and its cache_salt ("" none); None when it has neither input or is not one."""
    try:
        header = PromptHeader.FromString(raw)
    except DecodeError:
        return None
    salt = ""
    p = header.parameters.get(llm_protocol.CACHE_SALT)
    if p is not None and p.WhichOneof("parameter_choice") == "string_param":
        salt = p.string_param[: llm_protocol.MAX_CACHE_SALT]
    for i, tensor in enumerate(header.inputs):
        if tensor.name not in PROMPT_INPUTS:
            continue
        if i < len(header.raw_input_contents):
            data = header.raw_input_contents[i]
            return data[4:], salt  # one BYTES element: a 4-byte length, then the bytes
        if tensor.contents.bytes_contents:
            return tensor.contents.bytes_contents[0], salt
    return None


def replica_key(replica_id: str, started_ms: int) -> str:
    return f"{replica_id}@{started_ms}"


class PrefixIndex:
    def __init__(
        self,
        max_blocks: int = 200_000,
        block_bytes: int = BLOCK_BYTES,
        max_prompt_blocks: int = 1024,
    ) -> None:
        self.max_blocks = max_blocks
        self.block_bytes = block_bytes
        self.max_prompt_blocks = max_prompt_blocks
        self._blocks: OrderedDict[bytes, dict[str, None]] = OrderedDict()
        self._held: dict[str, int] = {}  # replica key -> blocks it holds here
        self._started: dict[str, int] = {}  # replica id -> the start time its entries are of

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, model: str, prompt: bytes, salt: str = "") -> list[bytes]:
        """The chained keys of the prompt's whole blocks (at most max_prompt_blocks)."""
        n = min(len(prompt) // self.block_bytes, self.max_prompt_blocks)
        parent = hashlib.blake2b(f"{model}\x1f{salt}".encode(), digest_size=12).digest()
        out = []
        for b in range(n):
            block = prompt[b * self.block_bytes : (b + 1) * self.block_bytes]
            parent = hashlib.blake2b(parent + block, digest_size=12).digest()
            out.append(parent)
        return out

    def overlaps(self, keys: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each replica key, how many of the leading blocks it holds."""
        out = dict.fromkeys(replicas, 0)
        alive = set(out)
        for i, key in enumerate(keys):
            holders = self._blocks.get(key)
            if not holders:
                break
            alive &= holders.keys()
            if not alive:
                break
            for r in alive:
                out[r] = i + 1
        return out

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        """The prompt went to `replica`: it holds these blocks now."""
        for key in keys:
            holders = self._blocks.get(key)
            if holders is None:
                self._blocks[key] = holders = {}
            else:
                self._blocks.move_to_end(key)
            if replica not in holders:
                holders[replica] = None
                self._held[replica] = self._held.get(replica, 0) + 1
        while len(self._blocks) > self.max_blocks:
            for r in self._blocks.popitem(last=False)[1]:
                self._drop_held(r)

    def forget(self, replica: str) -> int:
        """Drop every entry of one replica (it restarted or left); how many blocks it held."""
        n = 0
        for key in list(self._blocks):
            holders = self._blocks[key]
            if replica in holders:
                del holders[replica]
                n += 1
                if not holders:
                    del self._blocks[key]
        self._held.pop(replica, None)
        return n

    def notice(self, live: Mapping[str, int]) -> list[str]:
        """The replicas now registered (id -> start time): forget the entries of those that
        restarted (a new start time) or left; which ids were forgotten."""
        gone = []
        for worker, started in list(self._started.items()):
            if live.get(worker) != started:
                self.forget(replica_key(worker, started))
                del self._started[worker]
                gone.append(worker)
        for worker, started in live.items():
            self._started.setdefault(worker, started)
        return gone

    def held_by_worker(self) -> dict[str, int]:
        """Replica id -> blocks held, 0 for a replica noticed that holds none."""
        out = dict.fromkeys(self._started, 0)
        for key, n in self._held.items():  # any instance of the id: a check
            worker = key.rsplit("@", 1)[0]
            out[worker] = out.get(worker, 0) + n
        return out

    def holders(self) -> set[str]:
        return set(self._held)

    def held(self) -> dict[str, int]:
        """Replica key -> how many blocks the index says it holds."""
        return dict(self._held)

    def _drop_held(self, replica: str) -> None:
        n = self._held[replica] - 1
        if n:
            self._held[replica] = n
        else:
            del self._held[replica]
