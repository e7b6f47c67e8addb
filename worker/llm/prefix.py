"""The prefix cache: what the KV cache's slots hold, found by token-id blocks, kept while
memory allows.

A sequence's keys and values live in one slot, rows 0..n-1 (worker/llm/cache.py). When it
finishes, its prompt's rows are not wiped: they stay **retained**, indexed, until their
memory is needed. A new prompt looks up the longest prefix some slot holds, and starts from there:

- **Index.** A prompt is cut into blocks of `block_tokens` token ids; block i's key is a
  hash chained over block i-1's key and block i's ids (vLLM's scheme), starting from a root
  that hashes the model, its version, an adapter and the request's `cache_salt`. So a match
  of block i is a match of every token before it, and never crosses models, versions,
  adapters or salts. BLAKE2b, 16 bytes: no collision to fear, and the slot's own token ids
  are checked on every match anyway. Past the last whole block, the match extends token by
  token against the holding slot's ids, so a prefix that ends mid-block (a prompt that
  another extends) is reused to the token.
- **Exact.** A hit changes no token: only prompt rows are kept (computed in runs of >= 2
  tokens, which give bit-equal rows however the prompt was chunked), never generated rows
  (computed one per run, which onnxruntime rounds differently: worker/llm/scheduler.py's
  MIN_CHUNK). A prompt that is cached only in part runs its last two tokens (`RERUN`) at
  least, in one run, as a cold prefill computes them; their logits give the first
  generated token.
- **Whole prompts.** A slot whose rows are a whole prompt also keeps that run's row for the
  prompt's last position (`Held.last`: its logits, or the step graph's top-k of them), and
  the same prompt again (same root) is served without any run: its rows are copied and its
  first token is sampled from the kept row, the very numbers the cold run sampled from
  (`lookup(..., whole=True)`, `Match.last`). A row is kept only while the slot holds the
  whole prompt; evicting any of its blocks drops it.
- **Two regions.** Slots 0..slots-1 are the running region: only running sequences live
  there, so a decode run (one run over the contiguous slots its rows span) pays for no
  retained prefix between its rows. Slots slots..slots+kept-1 hold retained prefixes: a
  sequence that finishes normally has its prompt rows moved there (`move`, a memcpy), and
  its running slot is free at once; unless a retained slot holds those rows already (its
  `_twin`, most often the slot they were copied from): then nothing moves, and no second
  copy of the same rows takes the room of other prefixes.
- **Reuse.** A hit's rows are copied into the new sequence's running slot (`Plan.copy_from`),
  from a retained slot or from a running sequence that has computed them.
- **Concurrent sharers.** A prompt's blocks are claimed by the first running sequence that
  will compute them; a later sequence that needs a claimed block waits for it (`waits`)
  instead of computing it again, then copies it: several conversations on one system
  prompt prefill it once.
- **Budget.** Running sequences reserve prompt + max_tokens, as before; retained rows are
  never reserved. A free slot keeps its pages (`stale_tokens`) for the next rows written
  there, since a page given back costs a page fault on the next write; so does a running
  slot past a reservation shorter than its last one's. The memory held is reserved +
  retained + kept tokens <= the budget: kept pages go back first (a free retained slot's,
  then a running slot's past its reservation, then a free running slot's from the highest
  slot down: admission takes the lowest), then retained blocks; admission evicts before it
  waits (`fits` counts both as free), and a finished prompt that finds no retained slot
  free evicts the least recently used slot whole.
- **Eviction.** LRU over the retained blocks, touched deepest first on a match, so the
  oldest block is always the tail of some slot (a shared system prompt outlives the
  conversations under it); evicting block i drops the slot's blocks from i on and returns
  their whole pages to the OS (block 0: the slot is free, its pages kept as above). Only
  retained slots are evicted: a running sequence's rows are never touched, and a source is
  pinned while it is being copied.
- **Never served unfinished.** Only computed rows are indexed, when the engine says they
  are computed; a sequence cancelled or failed mid-prefill drops its blocks and claims.

Pure bookkeeping: the memory moves are the caller's (`discard`, `move`, and the plan's
copies).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
# A prompt's last tokens that always run, even when cached: two, in one run, as in a cold
# prefill (scheduler.MIN_CHUNK: a prompt token never runs alone)
RERUN = 2


def retained_slots(slots: int, enabled: bool = True) -> int:
    """Slots of the retained region: as many as run (a finished prompt per running slot),
    none with the cache off."""
    return slots if enabled else 0


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
    pins: int = 0  # copies from it in flight
    # the run's row for the last of `tokens` when they are a whole prompt (logits, or the
    # graph's top-k as (values, ids)): the prompt's first token, without a run
    last: object | None = None


@dataclass(frozen=True)
class Match:
    slot: int  # the slot holding the prefix
    tokens: int  # prompt tokens it holds (0: no match)
    last: object | None = None  # a whole prompt: the row its first token is sampled from


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


class PrefixCache:
    """The KV cache's room (running slots, reservations) and what its slots hold. It answers
    the scheduler's room questions (`fits`, `allocate`, `release`) as worker/llm/kv_budget.py
    does, with retained rows counted as free room."""

    def __init__(
        self,
        slots: int,
        budget_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
        discard: Callable[[int, int], None] | None = None,
        enabled: bool = True,
        move: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.slots = slots  # the running region; the retained one follows it
        self.kept_slots = retained_slots(slots, enabled)
        self.budget_tokens = budget_tokens
        self.block = block_tokens
        self.enabled = enabled
        self.reserved_tokens = 0
        self.retained_tokens = 0
        self.stats = PrefixStats()
        self._discard = discard  # (slot, start): give the pages of rows start.. back
        self._move = move  # (src, dst, n): rows 0..n-1 of src into dst
        self._free = list(range(slots - 1, -1, -1))  # pop() gives the lowest slot
        # free slots whose pages are kept (rows written, at most), since the next sequence
        # or prefix there writes them again: giving pages back costs a page fault per 4 KiB
        # on the next write (75 ms for 1,000 rows of SmolLM2 on this VM, against 10 ms for
        # the copy itself). Counted against the budget, and given back first when room is
        # needed.
        self._stale: dict[int, int] = {}
        # running slots' pages past their reservation (rows): a slot's previous sequence
        # wrote them, and a longer one may again; counted and given back as kept pages
        self._extra: dict[int, int] = {}
        self._free_kept = list(range(slots + self.kept_slots - 1, slots - 1, -1))
        self._held: dict[int, Held] = {}
        self._index: dict[bytes, dict[int, None]] = {}  # block key -> slots holding it
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()  # retained (slot, block)
        self._claims: dict[bytes, int] = {}  # block key -> running slot that will compute it

    # ---- the room ------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def fits(self, tokens: int, match: Match | None = None) -> bool:
        """A free running slot and the tokens free once every retained block that may go has
        gone: not one pinned by a copy in flight, nor the source of `match` (to be copied)."""
        src = match.slot if match is not None and match.tokens else -1
        pinned = sum(
            len(h.tokens)
            for h in self._held.values()
            if not h.running and (h.pins or h.slot == src)
        )
        return self.free_slots > 0 and tokens <= self.free_tokens - pinned

    def allocate(self, tokens: int) -> int:
        return self.admit(tokens).slot

    def admit(
        self, tokens: int, root: bytes = b"", prompt: Sequence[int] = (), match: Match | None = None
    ) -> Plan:
        """A slot for a sequence that may grow to `tokens` (the caller checked `fits` with
        the match), with the prefix `match` (from `lookup`) in it once the plan's copy is
        done."""
        if not self.fits(tokens, match):
            raise ValueError(
                f"no room for {tokens} tokens: {self.free_slots} free slots, "
                f"{self.free_tokens} free tokens"
            )
        src = self._held.get(match.slot) if match is not None and match.tokens else None
        if src is not None:
            src.pins += 1  # not evicted before its copy is done (`unpin`)
        self._free.sort(reverse=True)
        slot = self._free.pop()
        self._reuse(slot, tokens)
        self.reserved_tokens += tokens
        held = self._held[slot] = Held(slot, root, reserve=tokens)  # before room is made:
        self._make_room()  # a running slot's kept pages past its reservation start there
        cached = match.tokens if src is not None and match is not None else 0
        self._count(cached)
        self._begin(held, root, prompt, cached)
        return Plan(slot, cached, src.slot if src is not None else -1)

    def release(self, slot: int, tokens: int, keep: bool = False) -> None:
        """A sequence that ended gives back its slot and reservation; `keep`: it finished
        normally, and its indexed rows move to a retained slot (else they are dropped now).
        The running slot is free either way."""
        held = self._held.get(slot)
        if held is None or not held.running:
            raise ValueError(f"slot {slot} is not allocated")
        self.reserved_tokens -= tokens
        self._unclaim(slot)
        held.running = False
        self.retained_tokens += len(held.tokens)  # until dropped or moved
        twin = self._twin(held) if keep and self.enabled and held.keys else None
        if twin is not None:  # retained already (most often: where its rows were copied from)
            if twin.last is None and held.last is not None and twin.tokens == held.tokens:
                twin.last = held.last
            self._touch(twin.slot, len(twin.keys))
            self.stats.twins += 1
        if twin is not None or not (keep and self.enabled and held.keys and self._room_kept()):
            self._drop_from(held, 0)
            return
        dst = self._free_kept.pop()
        self._reuse(dst, len(held.tokens))
        self._rehome(held, dst)
        for b in range(len(held.keys) - 1, -1, -1):  # block 0 the most recent
            self._lru[(dst, b)] = None
        self.stats.moved_tokens += len(held.tokens)
        if self._move is not None:
            self._move(slot, dst, len(held.tokens))
        self._free.append(slot)
        self._stale[slot] = tokens + self._extra.pop(slot, 0)
        self._make_room()

    def lowest_free(self) -> int:
        """The lowest free running slot, -1 when none."""
        return min(self._free, default=-1)

    def move(self, src: int, dst: int) -> None:
        """The running sequence in `src` now lives in the free running slot `dst` (the caller
        moves its rows): what it holds, its index entries and its claims follow it."""
        held = self._held.get(src)
        if held is None or not held.running or dst not in self._free:
            raise ValueError(f"cannot move slot {src} to {dst}")
        self._free.remove(dst)
        self._reuse(dst, held.reserve)
        self._free.append(src)
        self._stale[src] = held.reserve + self._extra.pop(src, 0)
        self._rehome(held, dst)
        for key, slot in self._claims.items():
            if slot == src:
                self._claims[key] = dst
        self._make_room()

    # ---- the index -----------------------------------------------------------------------

    def lookup(
        self,
        root: bytes,
        prompt: Sequence[int],
        whole: Callable[[object], bool] | None = None,
    ) -> Match:
        """The longest prefix of `prompt` some slot holds, at most len(prompt) - 2 tokens
        (the last two run, in one run, as they would cold: scheduler.MIN_CHUNK), and at
        least one whole block; Match(-1, 0) when none. With `whole` (which kept rows the
        caller can sample from), a slot holding exactly this prompt and its last row
        matches it all: Match(slot, len(prompt), row)."""
        if not self.enabled:
            return Match(-1, 0)
        last: dict[int, None] = {}
        n = 0
        for key in block_keys(root, prompt, self.block):
            holders = self._index.get(key)
            if not holders:
                break
            last = holders
            n += 1
        if whole is not None:
            for slot in last:  # a slot holding this very prompt, with its last row kept
                held = self._held[slot]
                if held.last is not None and held.tokens == list(prompt) and whole(held.last):
                    self._touch(held.slot, n)
                    return Match(held.slot, len(prompt), held.last)
        best: Held | None = None
        m = 0
        for slot in last:  # of the slots holding the last block: the longest match
            held, k = self._held[slot], n * self.block
            if held.tokens[:k] != list(prompt[:k]):
                continue  # a collision: cannot happen with 16-byte hashes
            limit = min(len(held.tokens), len(prompt) - RERUN)
            while k < limit and held.tokens[k] == prompt[k]:
                k += 1  # to the token, within the holder's rows
            if best is None or k > m:
                best, m = held, k
        m = min(m, len(prompt) - RERUN)
        if best is None or m <= 0:
            return Match(-1, 0)
        self._touch(best.slot, min(n, -(-m // self.block)))
        return Match(best.slot, m)

    def _touch(self, slot: int, blocks: int) -> None:
        """A match used the slot's first `blocks` blocks: most recently used, deepest first."""
        for b in range(blocks - 1, -1, -1):
            if (slot, b) in self._lru:
                self._lru.move_to_end((slot, b))

    def waits(self, slot: int, root: bytes, prompt: Sequence[int], computed: int) -> bool:
        """Whether the sequence in `slot` should wait rather than compute its next block:
        another running sequence claimed it and is computing it now."""
        if not self.enabled or computed % self.block:
            return False
        b = computed // self.block
        if (b + 1) * self.block > len(prompt) - 1:
            return False
        key = self._key_at(root, prompt, b)
        holder = self._claims.get(key)
        return holder is not None and holder != slot and key not in self._index

    def computed(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's rows 0..len(tokens)-1 are computed (after a prefill chunk or a decode
        step): their whole blocks join the index."""
        held = self._held.get(slot)
        if held is None or not self.enabled:
            return
        if len(tokens) < len(held.tokens):
            return
        if len(tokens) > len(held.tokens):
            held.last = None  # kept for a shorter prompt
        held.tokens = list(tokens)
        start = len(held.keys)
        parent = held.keys[-1] if held.keys else held.root
        for key in block_keys(parent, held.tokens, self.block, start):
            held.keys.append(key)
            self._index.setdefault(key, {})[slot] = None
            if self._claims.get(key) == slot:
                del self._claims[key]

    def keep_last(self, slot: int, prompt: Sequence[int], row: object) -> None:
        """The run that computed the slot's last prompt row gave `row` for it (the caller's
        own copy): kept while the slot holds exactly this prompt."""
        held = self._held.get(slot)
        if held is not None and self.enabled and held.tokens == list(prompt):
            held.last = row

    def catch_up(self, slot: int, root: bytes, prompt: Sequence[int], computed: int) -> Match:
        """A running sequence at `computed` whose next blocks another sequence computed
        meanwhile (it waited for them): the match past `computed`, to copy; Match(-1, 0)
        when there is nothing more."""
        match = self.lookup(root, prompt)
        if match.slot == slot or match.tokens <= computed:
            return Match(-1, 0)
        if computed == 0:  # counted a miss when admitted
            self.stats.misses -= 1
            self.stats.hits += 1
        self.stats.cached_tokens += match.tokens - computed
        return match

    def pin(self, slot: int) -> None:
        """A copy from `slot` is planned: it is not evicted until `unpin`."""
        self._held[slot].pins += 1

    def unpin(self, slot: int) -> None:
        """A planned copy from `slot` is done."""
        held = self._held.get(slot)
        if held is not None and held.pins > 0:
            held.pins -= 1

    def drop_all(self) -> None:
        """Forget every retained block (a restart of the model)."""
        for held in [h for h in self._held.values() if not h.running]:
            self._drop_from(held, 0)

    @property
    def retained_blocks(self) -> int:
        return len(self._lru)

    # ---- internals -----------------------------------------------------------------------

    def _begin(self, held: Held, root: bytes, prompt: Sequence[int], cached: int) -> None:
        """A sequence starts in `held` with `cached` prompt tokens: claim the rest."""
        held.running, held.root = True, root
        if not self.enabled:
            return
        for key in block_keys(root, prompt[: len(prompt) - 1], self.block)[cached // self.block :]:
            if key not in self._index:
                self._claims.setdefault(key, held.slot)

    def _count(self, cached: int) -> None:
        if cached:
            self.stats.hits += 1
            self.stats.cached_tokens += cached
        else:
            self.stats.misses += 1

    def _rehome(self, held: Held, dst: int) -> None:
        """What `held` holds now lives in slot `dst`: its index entries follow it."""
        src = held.slot
        for key in held.keys:
            holders = self._index[key]
            del holders[src]
            holders[dst] = None
        del self._held[src]
        held.slot = dst
        self._held[dst] = held

    @property
    def stale_tokens(self) -> int:
        return sum(self._stale.values()) + sum(self._extra.values())

    def _reuse(self, slot: int, tokens: int) -> None:
        """A free slot taken for `tokens` rows: a running slot keeps its pages past them (the
        next sequence there may be longer), a retained one gives them back."""
        rows = self._stale.pop(slot, 0)
        if rows > tokens and slot < self.slots:
            self._extra[slot] = rows - tokens
        elif rows > tokens and self._discard is not None:
            self._discard(slot, tokens)

    def _make_room(self) -> None:
        """Reserved + retained + kept free-slot rows within the budget: free slots' pages go
        first (they hold nothing), then retained blocks, LRU."""
        # slot -> its first row whose pages go: one discard per slot trimmed (a madvise per
        # layer and head), not one per block evicted
        trimmed: dict[int, int] = {}
        while self.reserved_tokens + self.retained_tokens + self.stale_tokens > self.budget_tokens:
            if self._stale or self._extra:
                self._give_back_kept()
            else:
                self._evict_one(trimmed)
        if self._discard is not None:
            for slot, row in trimmed.items():
                self._discard(slot, row)

    def _give_back_kept(self) -> None:
        """Kept pages go back least likely written next first: a free retained slot's (rows
        move there only when no twin holds them), largest first; then a running sequence's
        past its reservation; then a free running slot's, from the highest slot down, since
        admission takes the lowest free one. A copy into pages given back faults per 4 KiB:
        7x the copy itself (10 against 1.5 ms for 350 rows of SmolLM2 on this VM)."""
        retained = [s for s in self._stale if s >= self.slots]
        start = 0
        if retained:
            slot = max(retained, key=self._stale.__getitem__)
            del self._stale[slot]
        elif self._extra:
            slot = max(self._extra, key=self._extra.__getitem__)
            del self._extra[slot]
            start = self._held[slot].reserve
        else:
            slot = max(self._stale)
            del self._stale[slot]
        if self._discard is not None:
            self._discard(slot, start)

    def _room_kept(self) -> bool:
        """A free retained slot, evicting the least recently used retained slot whole for
        one (the one whose most recent block is the oldest); False when every retained
        slot is pinned by a copy in flight. Whole: its pages stay for the rows moved in
        next, where trimming slots block by block gave back pages (a madvise per layer and
        head each time) that the move then faulted in again: 16 sequences finishing in one
        step had spent 0.5 s evicting on the event loop."""
        while not self._free_kept:
            held = next(
                (self._held[s] for s, b in self._lru if b == 0 and self._evictable(self._held[s])),
                None,
            )
            if held is None:
                return False
            self.stats.evicted_blocks += len(held.keys)
            self._drop_from(held, 0)
        return True

    def _twin(self, held: Held) -> Held | None:
        """A retained slot that holds every row `held` holds (and maybe more)."""
        n = len(held.tokens)
        for slot in self._index.get(held.keys[-1], {}):
            other = self._held[slot]
            if not other.running and other is not held and other.tokens[:n] == held.tokens:
                return other
        return None

    def _evictable(self, held: Held) -> bool:
        return not held.running and not held.pins

    def _evict_one(self, trimmed: dict[int, int] | None = None) -> None:
        for slot, b in self._lru:
            held = self._held[slot]
            if self._evictable(held):
                self.stats.evicted_blocks += len(held.keys) - b
                self._drop_from(held, b, trimmed)
                return
        raise ValueError("no retained block to evict")  # fits() said there was room

    def _drop_from(self, held: Held, b: int, trimmed: dict[int, int] | None = None) -> None:
        """Drop the slot's blocks from b on; a slot left empty is free again. With
        `trimmed`, the pages past a slot's remaining rows are noted there for the caller to
        give back, instead of now."""
        for i in range(b, len(held.keys)):
            self._lru.pop((held.slot, i), None)
            self._unindex(held.keys[i], held.slot)
        old = len(held.tokens)
        rows = held.reserve if held.running or held.slot < self.slots else old
        self.retained_tokens -= old - min(old, b * self.block)
        if b * self.block < old:
            held.last = None  # no longer the whole prompt
        del held.keys[b:]
        del held.tokens[b * self.block :]
        if b == 0:  # a free slot, its pages kept for the next rows written there
            del self._held[held.slot]
            (self._free if held.slot < self.slots else self._free_kept).append(held.slot)
            self._stale[held.slot] = rows + self._extra.pop(held.slot, 0)
            self._make_room()
            return
        if trimmed is not None:
            trimmed[held.slot] = min(trimmed.get(held.slot, b * self.block), b * self.block)
        elif self._discard is not None:
            self._discard(held.slot, b * self.block)

    def _unindex(self, key: bytes, slot: int) -> None:
        holders = self._index.get(key)
        if holders is not None:
            holders.pop(slot, None)
            if not holders:
                del self._index[key]

    def _unclaim(self, slot: int) -> None:
        for key in [k for k, s in self._claims.items() if s == slot]:
            del self._claims[key]

    def _key_at(self, root: bytes, prompt: Sequence[int], b: int) -> bytes:
        return block_keys(root, prompt[: (b + 1) * self.block], self.block)[b]
