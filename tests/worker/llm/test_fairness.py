"""Token-fair admission (worker/llm/fairness.py) through the real scheduler and KV budget,
with no model: a test plays the engine's part, as tests/worker/llm/test_scheduler.py does,
and finishes each sequence once it generated its max_tokens."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from tests.worker.llm.test_scheduler import run
from worker.llm.fairness import INPUT_COST, OUTPUT_COST, FairQueue
from worker.llm.kv_manager import KVCacheManager
from worker.llm.scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan

_ids = itertools.count(1)
PROMPT, MAX_TOKENS = 24, 16
STEP = 32  # the step's token budget
COST = PROMPT * INPUT_COST + MAX_TOKENS * OUTPUT_COST  # one request's service


def seq(tenant: str, weight: float = 1.0, prompt: int = PROMPT, max_tokens: int = MAX_TOKENS):
    return Sequence(
        id=next(_ids),
        prompt=list(range(prompt)),
        reserve=prompt + max_tokens,
        tenant=tenant,
        weight=weight,
    )


def make(slots: int = 4, reserved: int = 0, preempt: bool = False) -> Scheduler[Sequence]:
    config = SchedulerConfig(STEP, 64, 10_000, reserved_slots=reserved, fair_preemption=preempt)
    return Scheduler(KVCacheManager(slots, 4096, enabled=False), config)


def charge(
    plan: StepPlan[Sequence], served: Counter[str], tenant: Callable[[Sequence], str]
) -> None:
    """Each tenant's weighted service in one plan, as the engine's counters charge it."""
    for c in plan.prefill:
        served[tenant(c.seq)] += c.tokens * INPUT_COST
    for s in plan.decode:
        served[tenant(s)] += OUTPUT_COST


def step(sched: Scheduler[Sequence], served: Counter[str]) -> StepPlan[Sequence]:
    """Run one plan as the engine would; `served` gets each tenant's weighted service."""
    plan = sched.schedule()
    charge(plan, served, lambda s: s.tenant)
    run(plan)
    for s in [*plan.decode, *(c.seq for c in plan.prefill)]:
        if len(s.tokens) >= s.reserve - len(s.prompt):
            s.finish_reason = "length"
            sched.finish(s)
    return plan


def backlogged(sched: Scheduler[Sequence], tenant: str) -> bool:
    return any(s.tenant == tenant for s in sched.waiting)


def test_one_tenant_is_served_in_arrival_order() -> None:
    sched = make(slots=2)
    seqs = [seq("") for _ in range(6)]
    for s in seqs:
        sched.add(s)
    order: list[Sequence] = []
    for _ in range(200):
        order += step(sched, Counter()).admitted
    assert order == seqs


def test_backlogged_tenants_service_differs_by_a_bounded_amount() -> None:
    """Heavy queues 10x light's requests; while both are backlogged, their service never
    differs by more than the VTC bound (2 x (a request's cost + a step's)); served first
    come first served, light would wait behind heavy's whole backlog."""
    sched = make(slots=4)
    for i in range(200):
        sched.add(seq("heavy"))
        if i % 10 == 0:
            sched.add(seq("light"))
    # light's requests all arrived at once, and each pass tops light up to stay backlogged
    for _ in range(10):
        sched.add(seq("light"))
    served: Counter[str] = Counter()
    bound = 2 * (COST + STEP * OUTPUT_COST)
    worst = 0.0
    for _ in range(600):
        step(sched, served)
        if backlogged(sched, "heavy") and backlogged(sched, "light"):
            worst = max(worst, abs(served["heavy"] - served["light"]))
    assert served["light"] > 0 and served["heavy"] > 0
    assert worst <= bound, (worst, bound)


def test_first_come_first_served_would_break_that_bound() -> None:
    """The same arrivals with everyone as one tenant: the 'light' requests wait behind
    heavy's backlog, so the bound the test above checks is one a FIFO fails."""
    sched = make(slots=4)
    tenant_of = {}
    for i in range(200):
        s = seq("")
        tenant_of[s.id] = "heavy"
        sched.add(s)
        if i % 10 == 0:
            s = seq("")
            tenant_of[s.id] = "light"
            sched.add(s)
    served: Counter[str] = Counter()
    for _ in range(300):
        plan = sched.schedule()
        charge(plan, served, lambda s: tenant_of[s.id])
        run(plan)
        for s in plan.decode:
            if len(s.tokens) >= MAX_TOKENS:
                s.finish_reason = "length"
                sched.finish(s)
    assert served["heavy"] - served["light"] > 2 * (COST + STEP * OUTPUT_COST)


def test_a_light_tenant_is_admitted_ahead_of_a_heavy_backlog() -> None:
    sched = make(slots=1)
    heavy = [seq("heavy") for _ in range(20)]
    for s in heavy:
        sched.add(s)
    for _ in range(40):  # heavy's first request runs to its end: heavy is served, light not
        step(sched, Counter())
    light = seq("light")
    sched.add(light)
    admitted: list[Sequence] = []
    for _ in range(200):
        admitted += step(sched, Counter()).admitted
        if light in admitted:
            break
    assert admitted[0] is light, [s.tenant for s in admitted]


def test_an_idle_tenant_cannot_bank_credit() -> None:
    """A tenant away while another was served comes back lifted to the backlogged
    counters: it alternates with the other instead of taking every slot until even."""
    sched = make(slots=1)
    for _ in range(30):
        sched.add(seq("a"))
    for _ in range(200):  # a is served alone for a while
        step(sched, Counter())
    for _ in range(10):
        sched.add(seq("b"))
    admitted: list[str] = []
    for _ in range(400):
        admitted += [s.tenant for s in step(sched, Counter()).admitted]
        if len(admitted) >= 8:
            break
    assert admitted[:8].count("a") >= 3, admitted  # not b eight times in a row


def test_weights_share_the_service_in_their_ratio() -> None:
    sched = make(slots=2)
    for _ in range(200):
        sched.add(seq("gold", weight=3.0))
        sched.add(seq("basic", weight=1.0))
    served: Counter[str] = Counter()
    for _ in range(500):
        step(sched, served)
    ratio = served["gold"] / served["basic"]
    assert 2.5 <= ratio <= 3.5, ratio


def test_the_queue_keeps_arrival_order_when_iterated_and_removes_by_identity() -> None:
    q: FairQueue[Sequence] = FairQueue()
    a, b, c = seq("x"), seq("y"), seq("x")
    for s in (a, b, c):
        q.append(s)
    assert list(q) == [a, b, c] and len(q) == 3 and b in q
    q.remove(b)
    assert list(q) == [a, c] and b not in q and q.head() is a


def light_after_its_first(reserved: int) -> tuple[int, list[str]]:
    """Heavy keeps 12 requests waiting on 4 slots; light sends one, then (once it ended)
    another: the steps light's second waited, and the tenants admitted meanwhile."""
    sched = make(slots=4, reserved=reserved)
    for _ in range(12):
        sched.add(seq("heavy"))
    light = seq("light")
    sched.add(light)
    for _ in range(200):
        plan = step(sched, Counter())
        if light.finish_reason is not None:
            break
        for _ in plan.admitted:
            if sum(s.tenant == "heavy" for s in sched.waiting) < 12:
                sched.add(seq("heavy"))  # heavy stays backlogged
    second = seq("light")
    sched.add(second)
    admitted: list[str] = []
    for waited in range(200):
        plan = step(sched, Counter())
        admitted += [s.tenant for s in plan.admitted]
        if second in plan.admitted:
            return waited, admitted
        sched.add(seq("heavy"))
    raise AssertionError("light's second request was never admitted")


def test_a_held_back_slot_starts_a_recent_tenants_next_request_at_once() -> None:
    """With one slot held back, light's second request starts in the step it arrives; with
    none, heavy's backlog took light's freed slot and light waits for a heavy one to end."""
    waited, admitted = light_after_its_first(reserved=1)
    assert waited == 0 and admitted == ["light"], admitted
    waited, admitted = light_after_its_first(reserved=0)
    assert waited > 0 and admitted[-1] == "light", (waited, admitted)


def test_one_tenant_alone_uses_every_slot() -> None:
    sched = make(slots=4, reserved=1)
    for _ in range(8):
        sched.add(seq("only"))
    plan = sched.schedule()
    assert len(plan.admitted) == 4  # no other tenant to hold a slot for


def test_the_only_slot_is_never_held_back() -> None:
    sched = make(slots=1, reserved=1)
    sched.add(seq("light"))
    step(sched, Counter())  # light was seen, and runs
    for _ in range(100):  # light's request ends; it is recent and runs nothing
        step(sched, Counter())
    heavy = seq("heavy")
    sched.add(heavy)
    assert step(sched, Counter()).admitted == (heavy,)


def first_chunk(tenant: str) -> int:
    """Heavy runs 3 streams; a 40-token prompt of `tenant` comes: its first chunk's tokens."""
    sched = make(slots=4)
    for _ in range(3):
        sched.add(seq("heavy", max_tokens=100))
    for _ in range(10):  # all three decode
        step(sched, Counter())
    newcomer = seq(tenant, prompt=40)
    sched.add(newcomer)
    plan = step(sched, Counter())
    assert plan.admitted == (newcomer,) and len(plan.decode) == 3
    return sum(c.tokens for c in plan.prefill if c.seq is newcomer)


def test_a_tenant_running_nothing_has_its_prompt_read_in_one_run() -> None:
    """Light's prompt is read whole beside heavy's streams; heavy's own next prompt is
    chunked by the step's budget (32 - 3 rows - a run's fixed cost), as one tenant's is."""
    assert first_chunk("light") == 40
    assert 0 < first_chunk("heavy") < 40


def heavy_fills_every_slot(preempt: bool) -> tuple[Scheduler[Sequence], list[Sequence]]:
    """Heavy's 8 requests on 4 slots (no slot held), its 4 running ones decoding."""
    sched = make(slots=4, preempt=preempt)
    heavy = [seq("heavy", max_tokens=100) for _ in range(8)]
    for s in heavy:
        sched.add(s)
    for _ in range(6):
        step(sched, Counter())
    assert all(not s.prefilling and len(s.tokens) > 1 for s in sched.running)
    return sched, heavy


def test_a_tenant_running_nothing_preempts_the_newest_of_one_running_several() -> None:
    sched, heavy = heavy_fills_every_slot(preempt=True)
    newest = max(sched.running, key=lambda s: s.admitted_ns)
    slot, had = newest.slot, list(newest.tokens)
    light = seq("light")
    sched.add(light)
    plan = step(sched, Counter())
    assert plan.preempted == (newest,) and plan.admitted == (light,)
    assert slot in plan.freed and light.slot == slot
    assert newest.recompute == len(had) and newest.computed == 0 and newest.tokens == had
    # first of heavy's queue, ahead of its four later requests
    assert sched.waiting.head(among={"heavy"}) is newest
    # readmitted (once a slot frees), it prefills its prompt and its tokens; the last
    # chunk's row gives its next token, and it decodes on
    chunks = []
    for _ in range(200):
        plan = step(sched, Counter())
        chunks += [(c.start, c.tokens) for c in plan.prefill if c.seq is newest]
        if newest in plan.decode:
            break
    covered = [i for start, n in chunks for i in range(start, start + n)]
    assert covered == list(range(PROMPT + len(had))), chunks
    assert newest.tokens[: len(had)] == had and len(newest.tokens) == len(had) + 2


def test_without_fair_preemption_the_new_tenant_waits_for_a_slot_to_free() -> None:
    sched, _ = heavy_fills_every_slot(preempt=False)
    light = seq("light")
    sched.add(light)
    plan = step(sched, Counter())
    assert plan.preempted == () and plan.admitted == ()


def test_no_tenant_loses_its_only_sequence_and_none_preempts_itself() -> None:
    sched = make(slots=2, preempt=True)
    a, b = seq("a", max_tokens=100), seq("b", max_tokens=100)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched, Counter())
    sched.add(seq("c"))  # a and b run one each: c waits
    sched.add(seq("a"))  # a runs already: it waits its turn, preempting nothing
    for _ in range(3):
        plan = step(sched, Counter())
        assert plan.preempted == () and plan.admitted == ()


def shared_prompt_first_chunk(tenant: str) -> int:
    """Heavy runs 3 streams and has just been admitted a 64-token prompt (read 16 tokens a
    step); a prompt of `tenant` sharing its first 48 tokens comes: its tokens prefilled in
    its admission step."""
    config = SchedulerConfig(STEP, 16, 10_000)
    sched: Scheduler[Sequence] = Scheduler(KVCacheManager(5, 4096, block_tokens=16), config)
    for _ in range(3):
        sched.add(seq("heavy", prompt=8, max_tokens=100))
    for _ in range(4):
        step(sched, Counter())
    system = list(range(1000, 1048))
    sched.add(Sequence(id=next(_ids), prompt=[*system, *range(16)], reserve=80, tenant="heavy"))
    step(sched, Counter())  # heavy's prompt: its first chunk, its next blocks claimed
    newcomer = Sequence(id=next(_ids), prompt=[*system, 7, 7], reserve=66, tenant=tenant)
    sched.add(newcomer)
    plan = step(sched, Counter())
    assert newcomer in plan.admitted
    return sum(c.tokens for c in plan.prefill if c.seq is newcomer)


def test_a_tenant_running_nothing_does_not_wait_for_a_block_another_computes() -> None:
    """Heavy's second prompt waits for the blocks heavy's first is computing (a sharer
    prefills them once); light, running nothing, computes what the cache lacks at once."""
    assert shared_prompt_first_chunk("heavy") == 0
    assert shared_prompt_first_chunk("light") > 0


def test_a_tenant_running_nothing_is_read_before_prompts_that_take_the_budget() -> None:
    """Heavy decodes one stream and reads two 60-token prompts, which take every step's
    budget; light's prompt, coming then, is read whole in the step that admits it."""
    sched = make(slots=4)
    sched.add(seq("heavy", max_tokens=100))
    for _ in range(3):
        step(sched, Counter())
    for _ in range(2):
        sched.add(seq("heavy", prompt=60))
    step(sched, Counter())
    light = seq("light", prompt=40)
    sched.add(light)
    plan = step(sched, Counter())
    assert plan.admitted == (light,)
    assert (plan.prefill[0].seq, plan.prefill[0].tokens) == (light, 40)
