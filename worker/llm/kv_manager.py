"""The KV cache manager: the one owner of the cache's room, as vLLM's KVCacheManager is.

A sequence holds one slot for its lifetime and reserves `prompt + max_tokens` tokens of the
budget when admitted (`allocate_slots`), so it never runs out of cache and nothing is
preempted. Slots 0..slots-1 run sequences; slots slots.. retain finished prompts' rows,
indexed by block keys (worker/llm/prefix.py), to be copied into a new sequence whose prompt
starts with them (`get_computed` finds the longest such prefix). Retained rows and the pages
free slots keep for their next rows count as free room: the manager gives them back (kept
pages first, then retained blocks, LRU) when a reservation needs them. With the prefix cache
off it is the same room, retaining nothing. The memory is the caller's (worker/llm/cache.py):
the manager tells it which rows to copy or discard. docs/llm.md, "Prefix cache", has the
rules: exact reuse, whole prompts, sharers waiting for claimed blocks, eviction order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from worker.llm.prefix import (
    BLOCK_TOKENS,
    NO_MATCH,
    RERUN,
    Held,
    Match,
    Plan,
    PrefixStats,
    block_keys,
)


def retained_slots(slots: int, enabled: bool = True) -> int:
    """Slots of the retained region: as many as run (a finished prompt per running slot),
    none with the cache off."""
    return slots if enabled else 0


class KVMemory(Protocol):
    """What the manager's decisions move in the memory (worker/llm/cache.py's KVCache)."""

    def discard_from(self, slot: int, start: int) -> None: ...

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None: ...


class KVCacheManager:
    """Slots, reservations, retained prefixes, kept pages and eviction, behind what the
    scheduler asks: `fits`, `get_computed`, `allocate_slots`, `free`, `compact` (a running
    sequence down into a lower free slot), `catch_up` and `waits` (sharers of a prompt being
    computed), `computed` (rows that may be shared now) and `unpin` (a copy's source, planned
    by `allocate_slots` or `catch_up`, may be evicted again)."""

    def __init__(
        self,
        slots: int,
        budget_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
        enabled: bool = True,
        memory: KVMemory | None = None,
    ) -> None:
        self.slots = slots  # the running region; the retained one follows it
        self.kept_slots = retained_slots(slots, enabled)
        self.budget_tokens = budget_tokens
        self.block = block_tokens
        self.enabled = enabled
        self.reserved_tokens = 0
        self.retained_tokens = 0
        self.stats = PrefixStats()
        self._memory = memory  # None: bookkeeping only (the scheduler's tests)
        self._free = list(range(slots - 1, -1, -1))  # pop() gives the lowest slot
        # free slots whose pages are kept (rows written, at most), since the next sequence
        # or prefix there writes them again: a page given back costs a page fault on the
        # next write. Counted against the budget, and given back first when room is needed.
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

    @property
    def stale_tokens(self) -> int:
        """Rows of pages kept for the next rows written there (counted against the budget)."""
        return sum(self._stale.values()) + sum(self._extra.values())

    @property
    def retained_blocks(self) -> int:
        return len(self._lru)

    def fits(self, tokens: int, match: Match | None = None) -> bool:
        """A free running slot and the tokens free once every retained block that may go has
        gone: not one pinned by a planned copy, nor the source of `match` (to be copied)."""
        src = match.slot if match is not None and match.tokens else -1
        pinned = sum(
            len(h.tokens)
            for h in self._held.values()
            if not h.running and (h.pins or h.slot == src)
        )
        return self.free_slots > 0 and tokens <= self.free_tokens - pinned

    def allocate_slots(
        self, tokens: int, root: bytes = b"", prompt: Sequence[int] = (), match: Match | None = None
    ) -> Plan:
        """The lowest free running slot for a sequence that may grow to `tokens` (the caller
        checked `fits` with the match), with the prefix `match` (from `get_computed`) in it
        once the plan's copy is done."""
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

    def free(self, slot: int, tokens: int, keep: bool = False) -> None:
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
        if self._memory is not None:
            self._memory.copy_rows(slot, dst, 0, len(held.tokens))
        self._free.append(slot)
        self._stale[slot] = tokens + self._extra.pop(slot, 0)
        self._make_room()

    def compact(self, src: int) -> int:
        """The running sequence in `src` moves into the lowest free running slot, if one is
        below it (the caller copies its rows): what it holds, its index entries and its
        claims follow it. The new slot; -1 when none is below."""
        held = self._held.get(src)
        if held is None or not held.running:
            raise ValueError(f"slot {src} holds no running sequence")
        dst = min(self._free, default=-1)
        if dst < 0 or dst > src:
            return -1
        self._free.remove(dst)
        self._reuse(dst, held.reserve)
        self._free.append(src)
        self._stale[src] = held.reserve + self._extra.pop(src, 0)
        self._rehome(held, dst)
        for key, slot in self._claims.items():
            if slot == src:
                self._claims[key] = dst
        self._make_room()
        return dst

    # ---- the index -----------------------------------------------------------------------

    def get_computed(
        self,
        root: bytes,
        prompt: Sequence[int],
        whole: Callable[[object], bool] | None = None,
    ) -> Match:
        """The longest prefix of `prompt` some slot holds, at most len(prompt) - 2 tokens
        (the last two run, in one run, as they would cold: scheduler.MIN_CHUNK), and at
        least one whole block; NO_MATCH when none. With `whole` (which kept rows the
        caller can sample from), a slot holding exactly this prompt and its last row
        matches it all: Match(slot, len(prompt), row)."""
        if not self.enabled:
            return NO_MATCH
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
            return NO_MATCH
        self._touch(best.slot, min(n, -(-m // self.block)))
        return Match(best.slot, m)

    def waits(self, slot: int, root: bytes, prompt: Sequence[int], computed: int) -> bool:
        """Whether the sequence in `slot` should wait rather than compute its next block:
        another running sequence claimed it and is computing it now."""
        if not self.enabled or computed % self.block:
            return False
        b = computed // self.block
        if (b + 1) * self.block > len(prompt) - 1:
            return False
        key = block_keys(root, prompt[: (b + 1) * self.block], self.block)[b]
        holder = self._claims.get(key)
        return holder is not None and holder != slot and key not in self._index

    def computed(self, slot: int, tokens: Sequence[int], last: object | None = None) -> None:
        """The slot's rows 0..len(tokens)-1 are computed (after a prefill chunk or a decode
        step): their whole blocks join the index. `last`: when `tokens` are a whole prompt,
        the row its run gave for the last of them (the caller's own copy), kept while the
        slot holds exactly them."""
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
        if last is not None:
            held.last = last

    def catch_up(self, slot: int, root: bytes, prompt: Sequence[int], computed: int) -> Match:
        """A running sequence at `computed` whose next blocks another sequence computed
        meanwhile (it waited for them): the match past `computed`, its source pinned until
        the copy is done (`unpin`); NO_MATCH when there is nothing more."""
        match = self.get_computed(root, prompt)
        if match.slot == slot or match.tokens <= computed:
            return NO_MATCH
        if computed == 0:  # counted a miss when admitted
            self.stats.misses -= 1
            self.stats.hits += 1
        self.stats.cached_tokens += match.tokens - computed
        self._held[match.slot].pins += 1
        return match

    def unpin(self, slot: int) -> None:
        """A planned copy from `slot` is done: it may be evicted again."""
        held = self._held.get(slot)
        if held is not None and held.pins > 0:
            held.pins -= 1

    # ---- internals -----------------------------------------------------------------------

    def _touch(self, slot: int, blocks: int) -> None:
        """A match used the slot's first `blocks` blocks: most recently used, deepest first."""
        for b in range(blocks - 1, -1, -1):
            if (slot, b) in self._lru:
                self._lru.move_to_end((slot, b))

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

    def _discard(self, slot: int, start: int) -> None:
        """The pages of the slot's rows start.. go back to the OS."""
        if self._memory is not None:
            self._memory.discard_from(slot, start)

    def _reuse(self, slot: int, tokens: int) -> None:
        """A free slot taken for `tokens` rows: a running slot keeps its pages past them (the
        next sequence there may be longer), a retained one gives them back."""
        rows = self._stale.pop(slot, 0)
        if rows > tokens and slot < self.slots:
            self._extra[slot] = rows - tokens
        elif rows > tokens:
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
        for slot, row in trimmed.items():
            self._discard(slot, row)

    def _give_back_kept(self) -> None:
        """Kept pages go back least likely written next first: a free retained slot's (rows
        move there only when no twin holds them), largest first; then a running sequence's
        past its reservation; then a free running slot's, from the highest slot down, since
        admission takes the lowest free one. A copy into pages given back faults per page."""
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
        self._discard(slot, start)

    def _room_kept(self) -> bool:
        """A free retained slot, evicting the least recently used retained slot whole for
        one (the one whose most recent block is the oldest); False when every retained
        slot is pinned by a planned copy. Whole: its pages stay for the rows moved in
        next, where trimming it block by block would give back pages the move then faults
        in again."""
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
        else:
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
