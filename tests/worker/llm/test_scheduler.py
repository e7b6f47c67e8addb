"""The scheduler on its own: plans decided over the real KV budget, with no model and no
onnxruntime (as vLLM tests its scheduler, tests/v1/core/test_scheduler.py). A test plays
the engine's part: it advances the sequences as a run would."""

from __future__ import annotations

import itertools

import pytest

from common.errors import ResourceExhausted
from worker.llm.kv_manager import KVCacheManager
from worker.llm.scheduler import (
    ATTEND_ROWS_PER_TOKEN,
    RUN_TOKENS,
    Copy,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StepPlan,
    chunk_tokens,
    copy_tokens,
)

_ids = itertools.count(1)


def seq(prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(id=next(_ids), prompt=list(range(prompt_len)), reserve=prompt_len + max_tokens)


def make(
    slots: int = 4,
    budget: int = 4096,
    step: int = 64,
    chunk: int = 512,
    waiting: int = 8,
    k: int = 0,
    positions: int = 2048,
    per_row: int = 0,
) -> tuple[Scheduler[Sequence], KVCacheManager]:
    room = KVCacheManager(slots, budget, enabled=False)  # the room, no prefix cache
    config = SchedulerConfig(
        step,
        chunk,
        waiting,
        num_speculative_tokens=k,
        position_limit=positions,
        step_tokens_per_row=per_row,
    )
    return Scheduler(room, config), room


def decoding(
    sched: Scheduler[Sequence], n: int, prompt_len: int, max_tokens: int = 16
) -> list[Sequence]:
    """n prompts of prompt_len tokens, admitted and prefilled in one step: from the next
    step on they decode."""
    streams = [seq(prompt_len, max_tokens) for _ in range(n)]
    for s in streams:
        sched.add(s)
    run(sched.schedule())
    return streams


def run(plan: StepPlan[Sequence]) -> None:
    """What the engine does with a plan: the chunks' tokens are now cached (a completed
    prompt samples its first token); each decode row caches its last token and samples."""
    for c in plan.prefill:
        c.seq.computed = c.start + c.tokens
        if c.completes:
            c.seq.tokens.append(0)
    for s in plan.decode:
        s.computed += 1
        s.tokens.append(0)


def test_a_lone_prompt_prefills_its_whole_chunk_then_decodes() -> None:
    sched, room = make(step=64, chunk=512)
    a = seq(300)
    sched.add(a)
    plan = sched.schedule()
    assert plan.admitted == (a,) and a.slot == 0 and room.reserved_tokens == 316
    # nothing decodes: no stream to stall, so the prompt gets prefill_chunk, not the budget
    assert [(c.seq, c.start, c.tokens, c.completes) for c in plan.prefill] == [(a, 0, 300, True)]
    assert plan.decode == () and plan.tokens == 300
    run(plan)
    plan = sched.schedule()
    assert plan.prefill == () and plan.decode == (a,) and plan.tokens == 1


def test_decode_rows_and_prefill_chunks_share_the_step_budget() -> None:
    sched, _ = make(step=64)
    streams = decoding(sched, 3, 4)  # the three short prompts prefill together (12 <= 512)
    long = seq(1000, max_tokens=8)
    sched.add(long)
    starts = []
    for _ in range(40):
        plan = sched.schedule()
        assert plan.tokens <= 64, "a step never exceeds its token budget while streams decode"
        assert set(streams) <= set(plan.decode), "running streams decode in every step"
        starts += [(c.start, c.tokens) for c in plan.prefill]
        run(plan)
        if not long.prefilling:
            break
    # 64 - 3 decode rows - a run's fixed cost and its reading of the rows cached before it:
    # 55 prompt tokens a step while under 128 are cached, one fewer per 128 cached after
    # that; in order, with no gap, to the end
    assert starts[0] == (0, 64 - 3 - RUN_TOKENS)
    assert all(n == 55 - a // ATTEND_ROWS_PER_TOKEN for a, n in starts[:-1])
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(starts))
    assert starts[-1][0] + starts[-1][1] == 1000
    assert long in sched.schedule().decode


def test_two_prompts_split_what_the_decode_rows_leave_oldest_first() -> None:
    sched, _ = make(step=50, chunk=30)
    a = seq(2)
    sched.add(a)
    run(sched.schedule())
    b, c = seq(100), seq(100)
    sched.add(b)
    sched.add(c)
    plan = sched.schedule()
    assert plan.admitted == (b, c)
    assert plan.decode == (a,)
    # 49 tokens left: b gets its chunk cap (30) and costs a run's fixed part too (6); c gets
    # the 13 left less its own run's part
    assert RUN_TOKENS == 6
    assert [(x.seq, x.tokens) for x in plan.prefill] == [(b, 30), (c, 7)]


def test_the_step_budget_grows_with_the_decoding_rows() -> None:
    """A decode step costs more with more rows, so it can carry a larger chunk for the same
    stall: the budget is max(max_step_tokens, step_tokens_per_row x decoding rows)."""
    sched, _ = make(slots=16, step=24, chunk=512, per_row=4, waiting=16)
    assert [sched.step_budget(n) for n in (0, 1, 6, 8, 16, 32)] == [512, 24, 24, 32, 64, 128]
    decoding(sched, 12, 2)
    late = seq(500)
    sched.add(late)
    plan = sched.schedule()
    assert len(plan.decode) == 12
    # 12 rows: 48 tokens, less the rows and one run's fixed part
    assert [(c.seq, c.tokens) for c in plan.prefill] == [(late, 48 - 12 - RUN_TOKENS)]


def test_many_small_chunks_cannot_fill_a_step_with_runs() -> None:
    """Prefix-cache hits leave prompts with a few tokens each to compute; each is a run of
    its own, whose fixed part is charged too, so a step takes a bounded number of them."""
    sched, _ = make(slots=16, step=40, waiting=16)
    decoding(sched, 1, 2)
    tails = [seq(2) for _ in range(10)]
    for s in tails:
        sched.add(s)
    plan = sched.schedule()
    # 39 tokens left; each 2-token chunk costs 2 + 6: four fit, and the next step goes on
    assert [c.tokens for c in plan.prefill] == [2, 2, 2, 2]


def test_the_oldest_prompt_progresses_when_decode_rows_take_the_whole_budget() -> None:
    sched, _ = make(slots=8, step=4)
    decoding(sched, 5, 1)
    late = seq(10)
    sched.add(late)
    plan = sched.schedule()
    assert len(plan.decode) == 5
    assert [(c.seq, c.tokens) for c in plan.prefill] == [(late, 2)]  # never one token alone


def test_no_chunk_is_one_token_nor_leaves_one_behind() -> None:
    """A prompt token never runs alone (scheduler.MIN_CHUNK): whatever the budget left by
    the decode rows, every chunk of a prompt of >= 2 tokens has >= 2 tokens."""
    assert [chunk_tokens(r, limit) for r, limit in [(10, 9), (10, 1), (3, 2), (2, 5), (1, 5)]] == [
        8, 0, 3, 2, 1,
    ]  # fmt: skip
    for step in range(1, 12):
        sched, _ = make(slots=8, step=step, chunk=7)
        decoding(sched, 3, 2)
        prompts = [seq(n) for n in (2, 3, 9, 17, 33)]
        for s in prompts:
            sched.add(s)
        sizes = []
        for _ in range(200):
            plan = sched.schedule()
            sizes += [c.tokens for c in plan.prefill]
            run(plan)
            if all(not s.prefilling for s in prompts):
                break
        assert all(not s.prefilling for s in prompts) and min(sizes) >= 2, (step, sizes)


def test_admission_waits_in_order_for_slots_and_budget() -> None:
    sched, room = make(slots=2, budget=100)
    a, b, c = seq(10, 40), seq(10, 40), seq(10, 10)  # reserve 50, 50, 20
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert plan.admitted == (a, b) and list(sched.waiting) == [c]
    assert room.free_slots == 0 and room.free_tokens == 0
    run(plan)
    assert sched.finish(a) == 0 and a.slot == -1
    plan = sched.schedule()
    # b, decoding, moves down into a's slot (its rows copied first); c is admitted above it
    assert plan.copies == (Copy(1, 0, 0, b.computed, move=True),) and b.slot == 0
    assert plan.admitted == (c,) and c.slot == 1 and room.reserved_tokens == 70
    assert plan.decode == (b,)


def test_one_move_a_step_closes_the_holes_below_the_decoding_rows() -> None:
    sched, room = make(slots=4, budget=400)
    streams = decoding(sched, 4, 10, max_tokens=20)
    sched.finish(streams[0])
    sched.finish(streams[1])  # holes at slots 0 and 1 under streams in slots 2 and 3
    plan = sched.schedule()
    top = streams[3]
    assert plan.copies == (Copy(3, 0, 0, top.computed, move=True),) and top.slot == 0
    run(plan)
    plan = sched.schedule()
    assert plan.copies == (Copy(2, 1, 0, streams[2].computed, move=True),)
    assert sorted(s.slot for s in streams[2:]) == [0, 1] and room.free_slots == 2


def test_the_head_of_the_queue_is_not_overtaken() -> None:
    sched, _ = make(slots=4, budget=100)
    a, big, small = seq(10, 50), seq(10, 50), seq(2, 2)  # 60, 60, 4
    for s in (a, big, small):
        sched.add(s)
    plan = sched.schedule()
    assert plan.admitted == (a,)
    assert list(sched.waiting) == [big, small], "small would fit, but waits behind big"


def test_cancelled_sequences_free_their_room_before_admission_in_the_same_step() -> None:
    sched, room = make(slots=1, budget=100)
    a, b, queued = seq(10), seq(10), seq(5)
    for s in (a, b, queued):
        sched.add(s)
    run(sched.schedule())
    a.cancelled = True
    queued.cancelled = True
    plan = sched.schedule()
    assert set(plan.cancelled) == {a, queued}
    assert plan.freed == (0,)
    assert plan.admitted == (b,) and b.slot == 0
    assert room.reserved_tokens == b.reserve
    assert a not in sched.running and queued not in sched.waiting


def test_a_full_queue_is_refused() -> None:
    sched, _ = make(slots=1, budget=100, waiting=1)
    sched.add(seq(10))
    with pytest.raises(ResourceExhausted, match="already waiting"):
        sched.add(seq(10))


def test_a_lone_decoding_sequence_verifies_drafts_within_the_positions() -> None:
    sched, _ = make(k=4, positions=12)
    a = seq(5)
    sched.add(a)
    run(sched.schedule())
    plan = sched.schedule()
    assert plan.decode == (a,) and plan.drafts == 4 and plan.tokens == 5
    a.tokens += [0] * 4  # 10 tokens: a verify run may write 2 more
    assert sched.schedule().drafts == 2
    b = seq(5)
    sched.add(b)
    run(sched.schedule())
    plan = sched.schedule()
    assert len(plan.decode) == 2 and plan.drafts == 0, "two rows decode in one plain run"


def test_finish_is_idempotent_and_gives_the_slot_back_once() -> None:
    sched, room = make(slots=1)
    a = seq(3)
    sched.add(a)
    sched.schedule()
    assert sched.finish(a) == 0
    assert sched.finish(a) == -1
    assert room.free_slots == 1 and room.reserved_tokens == 0
    with pytest.raises(ValueError, match="not allocated"):
        room.free(0, 1)


def test_prefix_copies_come_out_of_the_step_budget_while_streams_decode() -> None:
    """A prefix-cache hit is a copy of its cached rows (page faults, ~35 us a row): while
    streams decode, a step takes the first hit waiting and further ones only as far as the
    budget holds; the others wait for the next step. With nothing decoding, all go at once."""
    room = KVCacheManager(8, 8000, block_tokens=4)
    sched = Scheduler(room, SchedulerConfig(24, 512, 8, step_tokens_per_row=4))
    long_prompt = [[2000 * (i + 1) + t for t in range(1000)] for i in range(2)]
    first = [Sequence(id=next(_ids), prompt=p, reserve=1020) for p in long_prompt]
    for s in first:
        sched.add(s)
    while any(s.prefilling for s in first):  # nothing decodes: 512 prompt tokens a step
        run(sched.schedule())
    for s in first:
        s.finish_reason = "length"
        sched.finish(s)  # their prompts stay cached, in the retained region
    streams = decoding(sched, 2, 4)
    again = [Sequence(id=next(_ids), prompt=p, reserve=1020) for p in long_prompt]
    for s in again:
        sched.add(s)
    plan = sched.schedule()
    # 2 rows: a budget of 24, less 2 rows; the first hit's 998 rows cost 16 tokens, which
    # leaves 6: the second (16 more) waits
    assert copy_tokens(998) == 16
    assert plan.admitted == (again[0],) and plan.decode == tuple(streams)
    assert [(c.start, c.stop) for c in plan.copies if not c.move] == [(0, 998)]
    run(plan)
    assert sched.schedule().admitted == (again[1],)
