"""The scheduler: each engine step decided as a plain value, a StepPlan, before anything runs.

Decide, then do (vLLM v1's `schedule() -> SchedulerOutput`, then `execute_model`, then
`update_from_output`): worker/llm/engine.py runs the plan, samples, and hands the results
back (`computed` after a chunk, `finish` when a sequence ends). Nothing here runs a model,
so the policy is tested on its own (tests/worker/llm/test_scheduler.py).

`schedule()`, in order:

1. **Cancelled** sequences leave and give back their slot and reservation, so a freed slot
   is reused in the same step. **Preempted** (`_preempt_for_idle`, with `fair_preemption`):
   when the next to admit is a tenant's that runs nothing and finds no room, the newest
   sequence of the tenant running the most (two or more) goes back to the front of its
   tenant's queue; readmitted, it prefills its prompt and generated tokens again.
2. **Compaction** (`_compact`): at most one decoding sequence moves down into a free slot
   below it, so a decode run (one run over the slots its rows span) computes no empty row.
3. **Admission** (`_admit_one`), while the head of the queue fits: the queue is token-fair
   between tenants (worker/llm/fairness.py), and the last `reserved_slots` free slots wait
   for a tenant seen lately that runs nothing (`_next`); such a tenant's prompt is then read
   in one run of up to IDLE_TENANT_STEPS steps' budget, first, without waiting for a block
   another sequence is computing. A sequence gets a slot and `prompt + max_tokens` tokens of
   the budget, so it never runs out of cache (it is preempted only for fairness, above).
   With a prefix cache (worker/llm/kv_manager.py) the slot comes with the longest cached prefix
   of the prompt, copied in (`StepPlan.copies`); a whole cached prompt with its last row
   prefills nothing (`StepPlan.first`). Retained prefixes are evicted, least recently used
   first, to make room; running sequences never are. The head waits rather than be
   overtaken; while streams decode, a step admits further prefix hits only while the
   budget holds their copies (`copy_tokens`).
4. **Decode**: every sequence past its prompt decodes one token, or verifies k drafts when
   it decodes alone and speculation is on.
5. **Prefill**: decode rows (and, while streams decode, copies and each run's fixed cost,
   `run_tokens`) share one token budget (`step_budget`, growing with the decoding rows);
   what is left goes to prompts, oldest first, at most `prefill_chunk` tokens each, so a
   long prompt stalls streams by a bounded chunk. The oldest prompt always progresses. A
   sequence first copies blocks another has computed since (`_catch_up`), and waits for a
   block another is computing. With nothing decoding a prompt gets a whole chunk.

`finish` frees the slot; a sequence that ended normally leaves its prompt's rows in the
prefix cache for the next prompt that shares them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from common.errors import ResourceExhausted
from worker.llm.fairness import FairQueue
from worker.llm.kv_manager import KVCacheManager
from worker.llm.prefix import NO_MATCH


@dataclass(eq=False, kw_only=True)
class Sequence:
    """What the scheduler knows of a sequence: its tokens, its slot, how far it is."""

    id: int
    prompt: list[int]
    reserve: int  # tokens of KV budget held while running
    tokens: list[int] = field(default_factory=list)  # generated
    slot: int = -1
    computed: int = 0  # tokens whose keys and values are in the cache
    drafted: int = 0  # tokens whose keys and values are in the draft model's cache
    finish_reason: str | None = None
    cancelled: bool = False
    arrived_ns: int = field(default_factory=time.perf_counter_ns)
    root: bytes = b""  # the prefix cache's key root: model, version, cache_salt
    cached: int = 0  # prompt tokens the prefix cache served (copied or adopted, not prefilled)
    tenant: str = ""  # whose request (fair admission: worker/llm/fairness.py)
    weight: float = 1.0  # the tenant's share weight
    admitted_ns: int = 0  # when it got its slot (perf_counter_ns): its service time starts
    # generated tokens its prefill computes again: those it had when it was preempted
    # (`Scheduler._preempt`); its stream goes on from them once they are back in the cache
    recompute: int = 0
    preemptions: int = 0

    @property
    def speculates(self) -> bool:
        """Whether the sequence may verify drafts when it decodes alone."""
        return True

    @property
    def context(self) -> int:
        """The tokens its prefill computes: the prompt, and a preempted sequence's tokens."""
        return len(self.prompt) + self.recompute

    @property
    def prefilling(self) -> bool:
        return self.computed < self.context

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def since(self, position: int) -> list[int]:
        """The prompt and generated tokens from `position` on."""
        if position >= len(self.prompt):
            return self.tokens[position - len(self.prompt) :]
        return [*self.prompt[position:], *self.tokens]


S = TypeVar("S", bound=Sequence)

# A prompt token is never computed in a run of one new token: onnxruntime rounds a one-token
# run differently from longer ones, and runs of >= 2 are bit-equal however a prompt was
# chunked, cached or batched (docs/llm.md, "Exact by construction").
MIN_CHUNK = 2
# While streams decode, a prefill chunk is charged a run's fixed cost and its reading of the
# rows cached before it, so a step cannot fill with many small runs (docs/decisions.md,
# "A prefill run's fixed cost is charged").
RUN_TOKENS = 6
ATTEND_ROWS_PER_TOKEN = 128


def run_tokens(cached: int) -> int:
    """A prefill run's cost beyond its own tokens, for a sequence with `cached` rows."""
    return RUN_TOKENS + cached // ATTEND_ROWS_PER_TOKEN


# While other tenants' streams decode, the first chunk of a tenant that runs nothing may take
# this many steps' budget at once: its prompt is read in one run, not over several steps
# each waiting behind the others' rows; the streams see one longer step instead of several
# slightly longer ones, for the same tokens (docs/decisions.md, "An idle tenant's prompt").
IDLE_TENANT_STEPS = 4


# A cache copy's cost, in rows per prompt token: between a memcpy into kept pages and page
# faults into fresh ones (docs/decisions.md, "Copies charged one token per 64 rows").
COPY_ROWS_PER_TOKEN = 64


def copy_tokens(rows: int) -> int:
    """What copying `rows` cache rows costs of a step's budget, in prompt tokens."""
    return -(-rows // COPY_ROWS_PER_TOKEN)


def chunk_tokens(remaining: int, limit: int) -> int:
    """How many of a prompt's `remaining` tokens one chunk takes within `limit`: never one
    alone, and never so many that one is left alone; 0 when `limit` allows none."""
    if remaining < MIN_CHUNK:
        return remaining if limit >= remaining else 0  # a one-token prompt: nothing to match
    n = min(remaining, limit)
    if n < MIN_CHUNK:
        return 0
    if remaining - n == 1:
        n = n - 1 if n > MIN_CHUNK else remaining
    return n


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int  # with step_tokens_per_row: a step's budget (`step_budget`)
    prefill_chunk: int  # prompt tokens of one sequence per step, at most
    max_waiting: int  # requests queued for admission; beyond: RESOURCE_EXHAUSTED
    reserved_slots: int = 0  # free slots held for a tenant seen lately that runs nothing
    fair_preemption: bool = False  # a tenant running nothing may preempt one running several
    step_tokens_per_row: int = 0
    num_speculative_tokens: int = 0  # k drafts for a lone decoding sequence; 0: no draft
    position_limit: int = 0  # positions a run may write to (a verify run writes k past)


@dataclass(frozen=True)
class Chunk(Generic[S]):
    """`tokens` prompt tokens of `seq` from position `start` on."""

    seq: S
    start: int
    tokens: int

    @property
    def completes(self) -> bool:
        """The chunk ends the prompt (or a preempted sequence's tokens): its last logits give
        the next generated token."""
        return self.start + self.tokens == self.seq.context


@dataclass(frozen=True)
class Copy:
    """Rows start..stop-1 of slot `src` into slot `dst`, done before the step's runs: a reused
    prefix (worker/llm/kv_manager.py), or `move`: a decoding sequence moved down into a free
    slot (`Scheduler._compact`), whose old slot keeps its pages for its next sequence."""

    src: int
    dst: int
    start: int
    stop: int
    move: bool = False

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    cancelled: tuple[S, ...] = ()
    admitted: tuple[S, ...] = ()
    preempted: tuple[S, ...] = ()  # back in the queue, their slots in `freed`
    prefill: tuple[Chunk[S], ...] = ()
    decode: tuple[S, ...] = ()
    drafts: int = 0  # k > 0: the one decode row verifies k drafts
    freed: tuple[int, ...] = ()  # slots given back by the cancelled and preempted sequences
    copies: tuple[Copy, ...] = ()  # cached prefixes to copy first
    # admitted whole prompts the prefix cache held with their last row: (seq, row), each
    # sampling its first token from that row once the copies are done, without a run
    first: tuple[tuple[S, object], ...] = ()

    @property
    def idle(self) -> bool:
        return not self.prefill and not self.decode and not self.copies and not self.first

    @property
    def tokens(self) -> int:
        """The step's tokens: what it costs of the budget."""
        return sum(c.tokens for c in self.prefill) + len(self.decode) * (1 + self.drafts)


class Scheduler(Generic[S]):
    def __init__(
        self,
        kv: KVCacheManager,
        config: SchedulerConfig,
        whole: Callable[[S, object], bool] | None = None,
    ) -> None:
        if config.max_step_tokens < 1 or config.prefill_chunk < MIN_CHUNK:
            raise ValueError(
                f"max_step_tokens {config.max_step_tokens} must be >= 1 and prefill_chunk "
                f"{config.prefill_chunk} >= {MIN_CHUNK} (a prompt token never runs alone)"
            )
        self.kv = kv  # the KV cache's room: slots, reservations, retained prefixes
        self.config = config
        # whether a sequence can sample its first token from a kept row (the logits, or the
        # graph's top-k of them); None: a whole prompt still runs its last two tokens
        self.whole = whole
        self.waiting: FairQueue[S] = FairQueue()
        self.running: list[S] = []

    def add(self, seq: S, queued: bool = False) -> None:
        """Queue `seq`; `queued`: its room in the queue was counted already (a request's
        further choices, Engine.add_choices)."""
        if not queued and len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"{len(self.waiting)} requests are already waiting for KV cache "
                f"(max {self.config.max_waiting}); retry later"
            )
        self.waiting.append(seq)

    def schedule(self) -> StepPlan[S]:
        cancelled, freed = self._drop_cancelled()
        # tenants running something (a preempted sequence's tenant still runs another)
        busy = {s.tenant for s in self.running}
        preempted, favoured = self._preempt_for_idle(busy)
        freed += tuple(s.slot for s in preempted)
        for seq in preempted:
            self._preempt(seq)
        admitted: list[S] = []
        idle: set[S] = set()  # admitted while other tenants' streams decode, running nothing
        copies: list[Copy] = []
        first: list[tuple[S, object]] = []
        self._compact(copies)
        decode = tuple(s for s in self.running if not s.prefilling)  # admitted ones prefill
        drafts = self._drafts(decode)
        c = self.config
        budget = self.step_budget(len(decode))
        budget -= len(decode) * (1 + drafts)
        # while streams decode, each chunk (a run of its own) also costs a run's fixed part
        # and its reading of the rows cached before it, and each copy (a compaction move, a
        # reused prefix) its rows
        if decode:
            budget -= sum(copy_tokens(x.rows) for x in copies)
        # the room preemption made is the favoured head's (the fair order might put the
        # preempted one, back first in its queue, level with it)
        while (head := favoured or self._next(busy)) is not None:
            favoured = None
            before = len(copies)
            if not self._admit_one(head, copies, first, budget if decode and admitted else None):
                break
            self.waiting.admit(head)
            admitted.append(head)
            if decode and head.tenant not in busy:
                idle.add(head)
            busy.add(head.tenant)
            if decode:
                budget -= sum(copy_tokens(x.rows) for x in copies[before:])
        prefill: list[Chunk[S]] = []
        # a tenant running nothing goes first and does not wait for a block another sequence
        # computes (chunk by chunk, behind the streams): its prompt is read now, in one run
        for seq in sorted(self.running, key=lambda s: s not in idle):  # stable: oldest first
            if not seq.prefilling or not (self._catch_up(seq, copies) or seq in idle):
                continue
            left = seq.context - seq.computed
            overhead = run_tokens(seq.computed) if decode else 0
            limit = budget - overhead
            if seq in idle:  # its first chunk: a few steps' budget at once
                limit = max(limit, IDLE_TENANT_STEPS * self.step_budget(len(decode)))
            n = chunk_tokens(left, min(c.prefill_chunk, limit))
            if n < 1:
                if prefill:
                    break
                n = chunk_tokens(left, 2)  # the oldest progresses
            prefill.append(Chunk(seq, seq.computed, n))
            budget -= n + overhead
        self._charge(prefill, decode, drafts)
        self._planned(copies)
        return StepPlan(
            tuple(cancelled),
            tuple(admitted),
            tuple(preempted),
            tuple(prefill),
            decode,
            drafts,
            freed,
            tuple(copies),
            tuple(first),
        )

    def _next(self, busy: set[str]) -> S | None:
        """The sequence to admit next: the fair queue's head, but the last `reserved_slots`
        free slots (never every slot) only go to a tenant seen lately that runs nothing (not
        in `busy`), while there is one (worker/llm/fairness.py); None: nothing to admit now."""
        held = min(self.config.reserved_slots, self.kv.slots - 1)
        if self.kv.free_slots > held:
            return self.waiting.head()
        idle = self.waiting.recent() - busy
        return self.waiting.head(among=idle) if idle else self.waiting.head()

    def _preempt_for_idle(self, busy: set[str]) -> tuple[list[S], S | None]:
        """With `fair_preemption`: when the next to admit is a tenant's that runs nothing and
        the cache has no room for it, the sequences to preempt to make that room, each the
        newest of the tenant running the most (while it runs at least two; ties: the one
        served most), so that a tenant arriving on a cache another tenant fills waits a
        step, not a whole request (vLLM preempts by recompute under memory pressure and for
        priority; here for fairness); and that head. ([], None): nothing to preempt."""
        if not self.config.fair_preemption or not self.waiting or not self.running:
            return [], None
        head = self._next(busy)
        if head is None or head.tenant in busy or self.kv.fits(head.reserve):
            return [], None
        running = list(self.running)
        counters = self.waiting.counters
        room = self.kv.free_tokens - head.reserve
        victims: list[S] = []
        while True:
            counts = Counter(s.tenant for s in running)
            tenant = max(counts, key=lambda t: (counts[t], counters.get(t, 0.0)))
            if counts[tenant] < 2:
                return [], None  # no tenant runs several: the head waits for a slot to free
            victim = max((s for s in running if s.tenant == tenant), key=lambda s: s.admitted_ns)
            running.remove(victim)
            victims.append(victim)
            room += victim.reserve
            if room >= 0:
                return victims, head

    def _preempt(self, seq: S) -> None:
        """`seq` leaves its slot for the front of its tenant's queue: its prompt's rows stay
        cached, and once admitted again it prefills its prompt and generated tokens (those
        the prefix cache does not give back), then decodes on; its stream only pauses."""
        self.running.remove(seq)
        slot, seq.slot = seq.slot, -1
        self.kv.computed(slot, seq.prompt[: seq.computed])
        self.kv.free(slot, seq.reserve, keep=True)
        seq.recompute = len(seq.tokens)
        seq.computed = seq.drafted = 0
        seq.preemptions += 1
        self.waiting.requeue(seq)

    def _charge(self, prefill: list[Chunk[S]], decode: tuple[S, ...], drafts: int) -> None:
        """The step's service to the tenants' counters (fair admission)."""
        for chunk in prefill:
            self.waiting.charge(chunk.seq, input_tokens=chunk.tokens)
        for seq in decode:
            self.waiting.charge(seq, output_tokens=1 + drafts)

    def step_budget(self, decoding: int) -> int:
        """Decode rows + prefill tokens a step may run with `decoding` rows decoding."""
        c = self.config
        if not decoding:
            return max(c.max_step_tokens, c.prefill_chunk)
        return max(c.max_step_tokens, c.step_tokens_per_row * decoding)

    def _compact(self, copies: list[Copy]) -> None:
        """Move the highest decoding sequence into the lowest free slot below it, if any: a
        free slot inside a decode run is a row computed for nothing at every step, a move is
        one memcpy. One move a step, since several into fresh pages stall every stream
        (docs/decisions.md, "One compaction move per step")."""
        decoding = [s for s in self.running if not s.prefilling]
        if not decoding:
            return
        top = max(decoding, key=lambda s: s.slot)
        hole = self.kv.compact(top.slot)
        if hole < 0:
            return
        copies.append(Copy(top.slot, hole, 0, top.computed, move=True))
        top.slot, top.drafted = hole, 0  # the draft model relearns it (speculative.py)

    def _admit_one(
        self,
        seq: S,
        copies: list[Copy],
        first: list[tuple[S, object]],
        copy_budget: int | None = None,
    ) -> bool:
        """Give `seq` a slot and its reservation if the cache has room for them; with a
        prefix cache, the longest cached prefix of its prompt comes with the slot (the whole
        prompt, with the row its first token is sampled from, when the cache kept one that
        `whole` says it can sample from: it then prefills nothing, `first`). With a
        `copy_budget` (tokens; a step that already admitted while streams decode), a prefix
        whose copy would cost more waits for the next step; the step's first admission
        always goes, so the head of the queue progresses."""
        kv = self.kv
        if not kv.fits(seq.reserve):
            return False
        whole = None if seq.recompute else self.whole  # a preempted one has tokens to recompute
        usable = None if whole is None else (lambda row: whole(seq, row))
        match = kv.get_computed(seq.root, seq.prompt, usable)
        if not kv.fits(seq.reserve, match):  # no room to keep the source too
            match = NO_MATCH
        if copy_budget is not None and copy_tokens(match.tokens) > copy_budget:
            return False
        plan = kv.allocate_slots(seq.reserve, seq.root, seq.prompt, match)
        seq.slot = plan.slot
        seq.computed = plan.cached
        if not seq.preemptions:  # what the prefix cache served it: its first admission's
            seq.cached = plan.cached
        if plan.copy_from >= 0:
            copies.append(Copy(plan.copy_from, plan.slot, 0, plan.cached))
        if match.last is not None:
            first.append((seq, match.last))
        seq.admitted_ns = time.perf_counter_ns()
        self.running.append(seq)
        return True

    def _catch_up(self, seq: S, copies: list[Copy]) -> bool:
        """Whether `seq` prefills this step: not while another sequence computes the block
        it needs next (it copies that block once computed, extending its prefix)."""
        kv = self.kv
        if seq.computed >= len(seq.prompt):  # a preempted sequence's generated tokens
            return True
        match = kv.catch_up(seq.slot, seq.root, seq.prompt, seq.computed)  # its source pinned
        if match.tokens > seq.computed:
            copies.append(Copy(match.slot, seq.slot, seq.computed, match.tokens))
            if not seq.preemptions:
                seq.cached += match.tokens - seq.computed
            seq.computed = match.tokens
        return not kv.waits(seq.slot, seq.root, seq.prompt, seq.computed)

    def computed(self, seq: S, last: object | None = None) -> None:
        """The engine ran a prefill chunk of `seq` (or copied its whole prompt in): its
        computed rows may be shared now. `last`: the prompt is whole, and this is the row its
        run gave for its last position (the engine's own copy), kept with it."""
        if seq.slot >= 0:
            self.kv.computed(seq.slot, seq.prompt[: seq.computed], last)

    def _planned(self, copies: list[Copy]) -> None:
        """The step's copies are planned: their sources, pinned while later admissions made
        room, may be evicted again. The engine runs a plan's copies first, before any sequence
        leaves, so nothing changes the room before they are done."""
        for c in copies:
            if not c.move:
                self.kv.unpin(c.src)

    def _drafts(self, decode: tuple[S, ...]) -> int:
        """k for a lone decoding sequence: a verify run writes k + 1 tokens from its last one
        on, within the cache and the RoPE tables."""
        k = self.config.num_speculative_tokens
        if k < 1 or len(decode) != 1 or not decode[0].speculates:
            return 0
        return max(0, min(k, self.config.position_limit - decode[0].length))

    def _drop_cancelled(self) -> tuple[list[S], tuple[int, ...]]:
        cancelled = [s for s in self.waiting if s.cancelled]
        for seq in cancelled:
            self.waiting.remove(seq)
        freed = []
        for seq in [s for s in self.running if s.cancelled]:
            freed.append(self.finish(seq))
            cancelled.append(seq)
        return cancelled, tuple(freed)

    def finish(self, seq: S) -> int:
        """A sequence that ended leaves, and gives back its slot and reservation; the slot
        it held (-1: none, it was not running)."""
        if seq not in self.running:
            if seq in self.waiting:
                self.waiting.remove(seq)
            return -1
        self.running.remove(seq)
        slot, seq.slot = seq.slot, -1
        # a sequence that ended normally leaves its prompt's rows cached (its generated rows
        # were computed one token per run, which a cold prefill of them would not match:
        # MIN_CHUNK); one cancelled or failed (mid-prefill, maybe) leaves nothing to serve
        keep = not seq.cancelled and seq.finish_reason in ("stop", "length")
        if keep:
            self.kv.computed(slot, seq.prompt[: seq.computed])
        self.kv.free(slot, seq.reserve, keep)
        return slot
