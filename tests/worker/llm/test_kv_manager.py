"""The KV cache manager's bookkeeping, without a model: room, index, reuse, claims, eviction."""

from __future__ import annotations

import random

import pytest

from worker.llm.kv_manager import KVCacheManager
from worker.llm.prefix import Match, block_keys, root_key

B = 4  # tokens per block, small so the arithmetic shows
ROOT = root_key("m", "1")


class Memory:
    """Notes what the manager asks of the memory (worker/llm/cache.py's KVCache does it)."""

    def __init__(
        self,
        discarded: list[tuple[int, int]] | None = None,
        moves: list[tuple[int, int, int]] | None = None,
    ) -> None:
        self.discarded = [] if discarded is None else discarded  # (slot, start)
        self.moves = [] if moves is None else moves  # (src, dst, rows)

    def discard_from(self, slot: int, start: int) -> None:
        self.discarded.append((slot, start))

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        assert start == 0, "a finished prompt's rows move from row 0"
        self.moves.append((src, dst, stop))


def finish(cache: KVCacheManager, slot: int, tokens: list[int], reserve: int) -> None:
    cache.computed(slot, tokens)
    cache.free(slot, reserve, keep=True)


def served(cache: KVCacheManager, prompt: list[int], reserve: int = 20, root: bytes = ROOT):
    match = cache.get_computed(root, prompt)
    assert cache.fits(reserve)
    plan = cache.allocate_slots(reserve, root, prompt, match)
    if plan.copy_from >= 0:
        cache.unpin(plan.copy_from)  # the engine copied the rows
    return match, plan


def test_keys_chain_and_never_cross_roots() -> None:
    a = block_keys(ROOT, list(range(9)), B)
    assert len(a) == 2  # whole blocks only
    assert block_keys(ROOT, [0, 1, 2, 3, 9, 9, 9, 9], B)[0] == a[0]
    assert block_keys(ROOT, [9, 1, 2, 3, 4, 5, 6, 7], B)[1] != a[1]  # chained: block 0 differs
    assert block_keys(a[0], list(range(9)), B, 1) == a[1:]
    roots = {root_key("m", "1"), root_key("m", "2"), root_key("n", "1"), root_key("m", "1", "lora")}
    roots.add(root_key("m", "1", salt="tenant-a"))
    assert len(roots) == 5


def test_a_finished_prompt_is_reused_to_the_token_and_its_last_two_tokens_run() -> None:
    cache = KVCacheManager(4, 100, B)
    first = list(range(10))
    match, plan = served(cache, first)
    assert match == Match(-1, 0) and plan.cached == 0
    finish(cache, plan.slot, [*first, 50, 51], 20)  # prompt + generated rows computed
    # the same prompt again: all but its last two tokens (they run together, as cold)
    kept = cache.slots  # the retained region's first slot
    assert cache.get_computed(ROOT, first) == Match(kept, 8)
    # a longer prompt sharing 11 tokens (mid-block: blocks 0, 1 and 3 tokens of block 2)
    longer = [*first, 50, 77, 78, 79]
    assert cache.get_computed(ROOT, longer) == Match(kept, 11)
    # another model, version or salt finds nothing
    for root in (root_key("m", "2"), root_key("m", "1", salt="t")):
        assert cache.get_computed(root, first) == Match(-1, 0)
    assert cache.get_computed(ROOT, [1, *first]) == Match(-1, 0)
    assert cache.get_computed(ROOT, first[:3]) == Match(-1, 0)  # less than one block


def test_a_finished_prompt_moves_to_the_retained_region_and_the_next_turn_copies() -> None:
    moves: list[tuple[int, int, int]] = []
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(4, 200, B, memory=Memory(discarded, moves))
    system = list(range(100, 112))  # 3 blocks
    _, plan = served(cache, [*system, 1, 2])
    assert plan.slot == 0
    finish(cache, plan.slot, [*system, 1, 2, 3], 20)
    # the prompt's rows went to the first retained slot (4), and the running slot is free,
    # its pages kept for the next sequence there (counted against the budget)
    assert moves == [(0, 4, 15)] and discarded == []
    assert cache.free_slots == 4 and cache.retained_tokens == 15 and cache.stats.moved_tokens == 15
    assert cache.stale_tokens == 20
    # the next turn copies them into a running slot, the lowest free one
    match, turn = served(cache, [*system, 1, 2, 3, 4, 5])
    assert match == Match(4, 15) and (turn.slot, turn.copy_from, turn.cached) == (0, 4, 15)
    # while it runs, another conversation on the same system prompt copies its rows
    cache.computed(turn.slot, [*system, 1, 2, 3, 4, 5])
    match, other = served(cache, [*system, 9, 9])
    assert (other.copy_from, other.cached) in ((turn.slot, 12), (4, 12))
    assert other.slot == 1
    assert cache.stats.hits == 2 and cache.stats.misses == 1


def test_running_slots_never_hold_a_retained_prefix() -> None:
    """A decode run spans the running slots between its rows: a retained prefix there would
    be a dummy row attending to its whole length every step."""
    cache = KVCacheManager(2, 400, B)
    for i in range(6):
        prompt = [*range(10 * i, 10 * i + 10)]
        _, plan = served(cache, prompt)
        assert plan.slot < 2
        finish(cache, plan.slot, prompt, 20)
        assert cache.get_computed(ROOT, prompt).slot in (2, 3)  # the retained region's two slots
        assert cache.free_slots == 2
    # two retained slots: the third finished prompt evicted the least recently used
    assert cache.stats.evicted_blocks > 0 and cache.get_computed(ROOT, [*range(10)]) == Match(-1, 0)


def test_cancelled_mid_prefill_its_blocks_are_never_served() -> None:
    cache = KVCacheManager(2, 100, B)
    prompt = list(range(20))
    _, plan = served(cache, prompt)
    cache.computed(plan.slot, prompt[:8])  # one chunk in
    assert cache.get_computed(ROOT, prompt).tokens == 8  # a running sharer may copy computed rows
    cache.free(plan.slot, 20, keep=False)  # cancelled
    assert cache.get_computed(ROOT, prompt) == Match(-1, 0)
    assert cache.free_slots == 2 and cache.retained_tokens == 0 and cache.reserved_tokens == 0


def test_a_sharer_waits_for_the_claimed_block_then_catches_up() -> None:
    cache = KVCacheManager(4, 200, B)
    prompt = list(range(30, 50))
    _, a = served(cache, [*prompt, 1])
    _, b = served(cache, [*prompt, 2])  # admitted in the same step: nothing cached yet
    assert b.cached == 0
    assert not cache.waits(a.slot, ROOT, [*prompt, 1], 0)  # the claimer computes
    assert cache.waits(b.slot, ROOT, [*prompt, 2], 0)  # the sharer waits
    cache.computed(a.slot, prompt[:8])
    match = cache.catch_up(b.slot, ROOT, [*prompt, 2], 0)
    assert match == Match(a.slot, 8)
    assert cache.waits(b.slot, ROOT, [*prompt, 2], 8)  # block 2 still being computed by a
    cache.free(a.slot, 20, keep=False)  # a is cancelled: b computes the rest itself
    assert not cache.waits(b.slot, ROOT, [*prompt, 2], 8)
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def test_eviction_is_lru_tail_first_and_never_reserved() -> None:
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(3, 60, B, memory=Memory(discarded))
    system = list(range(8))
    for turn in range(2):
        prompt = [*system, *range(200 + 10 * turn, 208 + 10 * turn)]
        _, plan = served(cache, prompt, reserve=20)
        finish(cache, plan.slot, prompt, 20)
    assert cache.retained_tokens == 32 and cache.reserved_tokens == 0
    assert cache.fits(60)  # retained rows are free room
    _, big = served(cache, [999] * 10, reserve=40)  # needs 40: evicts the oldest tails
    assert cache.reserved_tokens + cache.retained_tokens <= 60
    assert cache.stats.evicted_blocks >= 1
    # the shared system prompt, touched by both turns, outlives their tails
    assert cache.get_computed(ROOT, [*system, 5, 5]).tokens == 8
    assert discarded and all(start % B == 0 for _, start in discarded)
    del big


def test_the_budget_holds_under_random_traffic() -> None:
    rng = random.Random(7)
    cache = KVCacheManager(4, 120, B)
    running: list[tuple[int, list[int], int]] = []
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    for _ in range(400):
        if running and (rng.random() < 0.5 or not cache.fits(40)):
            slot, prompt, reserve = running.pop(rng.randrange(len(running)))
            cache.computed(slot, prompt)
            cache.free(slot, reserve, keep=rng.random() < 0.8)
            continue
        prompt = rng.choice(prompts)
        reserve = len(prompt) + 10
        if cache.fits(reserve):
            match = cache.get_computed(ROOT, prompt)
            assert match.tokens < len(prompt)
            plan = cache.allocate_slots(reserve, ROOT, prompt, match)
            if plan.copy_from >= 0 and rng.random() < 0.7:
                cache.unpin(plan.copy_from)  # else: the copy runs after the next admission
            running.append((plan.slot, prompt, reserve))
        assert cache.reserved_tokens + cache.retained_tokens + cache.stale_tokens <= 120
        assert len({s for s, _, _ in running}) == len(running)  # no slot handed out twice
    assert cache.stats.hits > 0 and cache.stats.evicted_blocks > 0


def test_off_caches_nothing() -> None:
    cache = KVCacheManager(2, 100, B, enabled=False)
    _, plan = served(cache, list(range(12)))
    finish(cache, plan.slot, list(range(12)), 20)
    assert cache.get_computed(ROOT, list(range(12))) == Match(-1, 0) and cache.free_slots == 2
    with pytest.raises(ValueError):
        cache.free(plan.slot, 20)


def test_a_moved_sequence_takes_its_blocks_and_claims_along() -> None:
    cache = KVCacheManager(4, 200, B)
    prompt = list(range(40, 60))
    _, low = served(cache, [9, 9, 9, 9, 9])
    _, a = served(cache, [*prompt, 1])
    _, b = served(cache, [*prompt, 2])  # waits for a's claimed blocks
    cache.computed(a.slot, prompt[:8])
    cache.free(low.slot, 20, keep=False)
    assert cache.compact(a.slot) == low.slot  # the scheduler compacts a down, to the lowest
    assert cache.get_computed(ROOT, prompt).slot == low.slot
    assert cache.waits(b.slot, ROOT, [*prompt, 2], 8)  # block 2: still a's claim, in its new slot
    assert cache.compact(low.slot) == -1  # no free slot below it
    _, c = served(cache, [8, 8, 8, 8, 8])
    assert c.slot == a.slot  # a's old slot is the lowest free one
    with pytest.raises(ValueError):
        cache.compact(a.slot + 10)  # not a running sequence's slot


def test_a_free_slots_kept_pages_go_first_when_room_is_needed() -> None:
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(2, 60, B, memory=Memory(discarded))
    _, a = served(cache, list(range(8)), reserve=30)
    cache.free(a.slot, 30, keep=False)  # cancelled: nothing kept, the pages are
    assert cache.stale_tokens == 30 and discarded == []
    _, b = served(cache, [7] * 8, reserve=12)  # slot 0 again: its pages past 12 rows stay
    assert b.slot == a.slot and discarded == [] and cache.stale_tokens == 18
    _, c = served(cache, [5] * 8, reserve=40)  # slot 1: 12 + 40 + 18 kept > 60
    assert c.slot != b.slot and discarded == [(b.slot, 12)] and cache.stale_tokens == 0
    cache.free(c.slot, 40, keep=False)
    assert cache.stale_tokens == 40
    _, d = served(cache, [6] * 8, reserve=44)  # 12 + 44 + 40 kept > 60: slot 1's pages go
    assert discarded[-1] == (c.slot, 0) or d.slot == c.slot
    assert cache.reserved_tokens + cache.retained_tokens + cache.stale_tokens <= 60


def test_kept_pages_go_back_where_the_next_sequence_is_least_likely_to_write() -> None:
    """A running slot reused by a shorter sequence keeps the pages past its reservation
    (counted as kept: the next sequence there may be longer), and its slot keeps them all
    when it ends. When room is needed they go before a free running slot's kept pages,
    which the next admission (the lowest free slot) writes into: a copy into pages given
    back faults per page."""
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(3, 95, B, memory=Memory(discarded))
    _, a = served(cache, [1] * 8, reserve=40)
    _, x = served(cache, [2] * 8, reserve=20)
    _, y = served(cache, [3] * 8, reserve=30)
    cache.free(y.slot, 30, keep=False)
    cache.free(a.slot, 40, keep=False)
    _, b = served(cache, [4] * 8, reserve=10)  # a's slot: 30 rows past b's 10 kept
    assert b.slot == a.slot and discarded == []
    assert cache.reserved_tokens + cache.stale_tokens == 30 + 30 + 30
    finish(cache, x.slot, [2] * 8, 20)  # its prompt moves to a retained slot: 98 > 95
    assert discarded == [(b.slot, 10)]  # b's extra pages, not the free slots' (y's, x's)
    assert cache.stale_tokens == 30 + 20
    cache.free(b.slot, 10, keep=False)
    assert cache.stale_tokens == 30 + 20 + 10 and len(discarded) == 1
    assert cache.reserved_tokens + cache.retained_tokens + cache.stale_tokens <= 95


def test_budget_eviction_gives_back_a_slots_pages_once_however_many_blocks_go() -> None:
    """Trimming a retained slot block by block for room ends in one discard for it (a
    madvise per layer and head), from its first dropped row."""
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(2, 60, B, memory=Memory(discarded))
    prompt = list(range(40))
    _, plan = served(cache, prompt, reserve=40)
    finish(cache, plan.slot, prompt, 40)
    kept = cache.get_computed(ROOT, prompt).slot
    assert cache.retained_tokens == 40
    discarded.clear()
    _, other = served(cache, [999] * 10, reserve=50)  # 50 + 40 > 60: 30 rows, 8 blocks go
    assert cache.stats.evicted_blocks == 8
    assert [d for d in discarded if d[0] == kept] == [(kept, 8)]  # 2 blocks stay
    assert cache.get_computed(ROOT, prompt).tokens == 8
    del other


def test_a_finished_prompt_evicts_the_least_recently_used_retained_slot_whole() -> None:
    """No retained slot free: the one used longest ago is dropped whole and its pages stay
    for the moved rows (no discard), the other keeps all its blocks."""
    discarded: list[tuple[int, int]] = []
    cache = KVCacheManager(2, 400, B, memory=Memory(discarded))
    a, b, c = (list(range(k, k + 24)) for k in (0, 100, 200))
    for prompt in (a, b):
        _, plan = served(cache, prompt)
        finish(cache, plan.slot, prompt, 40)
    # all but their last two tokens
    assert cache.get_computed(ROOT, a).tokens == cache.get_computed(ROOT, b).tokens == 22
    discarded.clear()
    _, plan = served(cache, c)
    finish(cache, plan.slot, c, 40)  # both retained slots held: the older, `a`, goes whole
    assert cache.get_computed(ROOT, a) == Match(-1, 0)
    assert cache.get_computed(ROOT, b).tokens == 22 and cache.get_computed(ROOT, c).tokens == 22
    assert cache.stats.evicted_blocks == 6
    # no retained slot trimmed block by block (a running slot taken trims its own pages
    # past the new reservation)
    assert not [d for d in discarded if d[0] >= cache.slots and d[1] > 0]


def test_a_whole_prompt_comes_with_its_last_row_while_the_slot_holds_exactly_it() -> None:
    """computed(..., last): the row the prompt's run gave for its last position is matched with the
    whole prompt when the caller can sample from it; not for a longer or shorter prompt,
    and not once a block of the slot has gone."""
    cache = KVCacheManager(2, 60, B)
    prompt = list(range(10))
    _, plan = served(cache, prompt)
    cache.computed(plan.slot, prompt)
    row = object()
    cache.computed(plan.slot, prompt[:8], row)  # not the prompt the slot holds: ignored
    assert cache.get_computed(ROOT, prompt, lambda r: True).last is None
    cache.computed(plan.slot, prompt, row)
    # while running, and once retained: the whole prompt and its row
    assert cache.get_computed(ROOT, prompt, lambda r: True) == Match(plan.slot, 10, row)
    finish(cache, plan.slot, prompt, 20)
    kept = cache.slots
    assert cache.get_computed(ROOT, prompt, lambda r: r is row) == Match(kept, 10, row)
    # a row the caller cannot sample from (it needs the logits, the row is a top-k), or no
    # caller asking: the last two tokens run, as before
    assert cache.get_computed(ROOT, prompt, lambda r: False) == Match(kept, 8)
    assert cache.get_computed(ROOT, prompt) == Match(kept, 8)
    assert cache.get_computed(ROOT, [*prompt, 7, 7], lambda r: True) == Match(kept, 10)
    assert cache.get_computed(ROOT, prompt[:9], lambda r: True) == Match(kept, 7)
    # its last block evicted (a reservation needs the room): the row goes with it
    _, big = served(cache, [999] * 10, reserve=55)
    assert cache.stats.evicted_blocks >= 1
    assert cache.get_computed(ROOT, prompt, lambda r: True) == Match(kept, 4)
    del big


def test_a_finished_prompt_a_retained_slot_holds_already_is_not_moved_again() -> None:
    """The same prompt served twice: the second finishes with rows its retained source
    holds, so nothing moves and the retained region keeps one copy (with the kept row);
    a longer prompt on the same prefix is moved, its rows being new."""
    moves: list[tuple[int, int, int]] = []
    cache = KVCacheManager(2, 200, B, memory=Memory(moves=moves))
    prompt = list(range(10))
    _, plan = served(cache, prompt)
    finish(cache, plan.slot, prompt, 20)
    kept = cache.slots
    assert moves == [(plan.slot, kept, 10)]
    match, again = served(cache, prompt)
    assert (again.copy_from, again.cached) == (kept, 8)
    row = object()
    cache.computed(again.slot, prompt, row)  # the retained copy had none: it gets this one
    cache.free(again.slot, 20, keep=True)
    assert moves == [(plan.slot, kept, 10)] and cache.stats.twins == 1
    assert cache.retained_tokens == 10 and cache.free_slots == 2
    assert cache.get_computed(ROOT, prompt, lambda r: True) == Match(kept, 10, row)
    longer = [*prompt, 20, 21, 22]
    _, third = served(cache, longer)
    finish(cache, third.slot, longer, 20)
    assert moves[-1] == (third.slot, kept + 1, 13) and cache.retained_tokens == 23
