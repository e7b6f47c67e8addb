"""Running one StepPlan (worker/llm/scheduler.py): the "do" after the scheduler's "decide".

In order: the plan's cache copies (reused prefixes), the first token of each whole prompt
the prefix cache held (sampled from the row its own run gave: no run), one prefill run per
chunk (onnxruntime's GroupQueryAttention on CPU takes several new tokens for one row only), then
one decode run for every decoding row: rows of different lengths share one run, each
attending to its own cache. Each result goes to worker/llm/generation.py's `Results`: a
chunk that ends its prompt gives the first token, a decode row the next one. Model runs go
to one thread (onnxruntime releases the GIL), so gRPC keeps being served while a step
computes. A decode run's rows are sampled on that thread, which then starts the next decode
run at once while nothing waits for the scheduler (up to EngineConfig.num_scheduler_steps
runs; `_decode`), and the event loop detokenizes and streams each run's tokens while the
next one computes.

With speculative decoding (worker/llm/speculative.py: a draft model, or n-gram lookup) and
one sequence decoding, its decode run becomes: the proposer proposes up to k tokens (a draft
model greedily; a lookup finding nothing proposes none, and the plain decode run goes
instead); the target scores the last token and the drafts in one run (logits at all of
those positions); the sequence then samples position by position with its own sampler,
keeping tokens while they equal the drafts, and ends with the first that differs (or the
bonus token after all hit). With
several sequences decoding, the plain batched step runs: a verify run cannot batch rows,
and separate runs per row would read the target's weights once per row where one decode
step reads them once for all (vLLM, too, turns speculation off above a batch size).

Every emitted token is the target's own choice, so greedy output is the target's, token for
token. For sampled sequences this exact-match rule is the rejection-sampling rule of
Leviathan et al. / Chen et al. for a greedy (one-hot) draft: a draft token d is kept with
probability p(d), and on a miss the token comes from p without d, renormalized; it draws one
random number per emitted token, as without a draft, so a seeded request gives the same
text with or without one (but for float noise: a verify run's logits are computed for k + 1
positions at once).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np

from worker.llm import scheduler
from worker.llm.cache import KVCache
from worker.llm.generation import EngineStats, Results, Row, Sequence
from worker.llm.model import Model, TopModel, VerifyingModel
from worker.llm.speculative import Proposer

# (kind, rows, tokens, ns) of every model run, for Triton's statistics
OnExecution = Callable[[str, int, int, int], None]


class StepRunner:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        sched: scheduler.Scheduler[Sequence],
        drafter: Proposer | None,
        results: Results,
        stats: EngineStats,
    ) -> None:
        self.model = model
        self.cache = cache
        self.scheduler = sched
        self.drafter = drafter
        self.results = results
        self.stats = stats
        self.on_execution: OnExecution | None = None
        # the graph's own top-k, read instead of the logits when the rows allow (`_run`)
        self.top = model if isinstance(model, TopModel) and model.top_k > 0 else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-step")
        # decode runs the step thread may run back to back before the scheduler decides again
        # (EngineConfig.num_scheduler_steps), and whether they must stop (`interrupt`)
        self.chain = 1
        self._interrupted = False
        # Each decode run's tokens reach the event loop through a thread of its own
        # (`_hand_over`): the step thread waking the loop itself would give the loop the GIL,
        # and the step thread would wait for the loop's work before starting the next run.
        self._handoff: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._waker = threading.Thread(target=self._hand_over, name="llm-emit", daemon=True)
        self._waker.start()

    def close(self) -> None:
        """Stop the step thread and the hand-over thread (no run may be in flight)."""
        self._handoff.put(None)
        self._waker.join()
        self.pool.shutdown(wait=True)

    async def run(self, plan: scheduler.StepPlan[Sequence]) -> None:
        """Run the plan: its copies, its prefill chunks, then its decode rows; accept each
        result."""
        self.stats.steps += 1
        start = time.perf_counter_ns()
        try:
            await self._run_plan(plan)
        finally:
            self.stats.step_ns += time.perf_counter_ns() - start

    async def _run_plan(self, plan: scheduler.StepPlan[Sequence]) -> None:
        loop = asyncio.get_running_loop()
        if plan.copies:
            start = time.perf_counter_ns()
            await loop.run_in_executor(self.pool, self._copy, plan.copies)
            self.stats.copy_ns += time.perf_counter_ns() - start
            self.stats.copied_rows += sum(c.rows for c in plan.copies)
        for seq, row in plan.first:
            self._first(seq, row)
        for chunk in plan.prefill:
            await self._prefill(loop, chunk, joining=bool(plan.decode))
        decoding = [s for s in plan.decode if s.finish_reason is None and not s.cancelled]
        if not decoding:
            return
        if plan.drafts and await self._speculate(loop, decoding[0], plan.drafts):
            return
        await self._decode(loop, decoding)

    async def _prefill(
        self, loop: asyncio.AbstractEventLoop, chunk: scheduler.Chunk[Sequence], joining: bool
    ) -> None:
        seq, n = chunk.seq, chunk.tokens
        ids = np.asarray([seq.since(chunk.start)[:n]])  # a preempted one's tokens follow
        lengths = np.asarray([chunk.start + n])
        start = time.perf_counter_ns()
        sampling = [seq] if chunk.completes else []  # an earlier chunk's logits go unread
        rows = await self._run(loop, sampling, ids, lengths, seq.slot, seq.slot + 1)
        self._executed("prefill", 1, n, time.perf_counter_ns() - start)
        seq.computed = chunk.start + n
        # the prompt's last row is kept with its rows: the same prompt again samples from it
        row = rows(0) if chunk.completes else None
        last = copied(row) if row is not None and not seq.recompute else None
        self.scheduler.computed(seq, last)
        self.stats.prefill_runs += 1
        self.stats.prefill_tokens += n
        if row is not None and not seq.cancelled:
            if joining:
                self.stats.joined_running += 1
            self.results.accept(seq, row)

    def _first(self, seq: Sequence, row: object) -> None:
        """A whole prompt the prefix cache held, its rows copied into the sequence's slot:
        its first token is sampled from the row the prompt's own run gave, with no run."""
        self.scheduler.computed(seq, row)  # its slot holds the prompt: others may share it
        self.stats.first_from_cache += 1
        if not seq.cancelled:
            self.results.accept(seq, copied(cast(Row, row)))  # sampling may alter its row

    async def _decode(self, loop: asyncio.AbstractEventLoop, decoding: list[Sequence]) -> None:
        """One token for every decoding row, in one run over the slots they span; then, while
        nothing else waits for the scheduler, the next and the next, up to `chain` runs in
        all (`_steps`): the step thread samples each run's rows and starts the next run at
        once, and the event loop emits the tokens (`_emit`) while that run computes."""
        lo = min(s.slot for s in decoding)
        hi = max(s.slot for s in decoding) + 1
        runs = DecodeRuns(
            decoding,
            lo,
            np.zeros((hi - lo, 1), np.int64),
            np.ones(hi - lo, np.int64),
            loop.create_future(),
        )
        # Rows between the decoding ones (free slots, prompts mid-prefill; retained prefixes
        # live in their own region, worker/llm/kv_manager.py) run a dummy token written just
        # past their own data, where their next real token will overwrite it.
        for seq in self.scheduler.running:
            if lo <= seq.slot < hi:
                runs.lengths[seq.slot - lo] = seq.computed + 1
        for seq in decoding:
            runs.ids[seq.slot - lo, 0] = seq.tokens[-1]
        # The runs go on only while nothing the scheduler decides on changes: no request
        # waits, none prefills, no run verifies drafts. An arrival, a cancel, a stop string
        # or close interrupts them (`interrupt`), and a row that ends stops them.
        self._interrupted = (
            self.chain < 2
            or bool(self.scheduler.waiting)
            or len(self.scheduler.running) != len(decoding)
            or (self.drafter is not None and len(decoding) == 1 and decoding[0].speculates)
        )
        self.results.hold_leaves()  # an ended row's slot is the runs' until they stop
        try:
            await loop.run_in_executor(self.pool, self._steps, runs)
            await runs.emitted  # every run's tokens have joined their sequences
        except BaseException as e:
            runs.error = runs.error or e  # tokens still on their way are dropped
            raise
        finally:
            self.results.release_leaves()
        if runs.error is not None:
            raise runs.error

    def interrupt(self) -> None:
        """Something the scheduler must decide on happened (an arrival, a cancel, close):
        decode runs going on ahead stop after the current one."""
        self._interrupted = True

    def _steps(self, runs: DecodeRuns) -> None:
        """On the step thread: decode runs of `runs.rows`, each sampled here and handed to
        the event loop (`_emit`, through the hand-over thread), until a row ends, `chain`
        runs are done, or the engine interrupts; then `_emitted`."""
        try:
            self._chain(runs)
        finally:  # after the last run's tokens
            self._handoff.put((self._emitted, runs))

    def _chain(self, runs: DecodeRuns) -> None:
        rows, ids, lengths, lo = runs.rows, runs.ids, runs.lengths, runs.lo
        hi = lo + len(ids)
        at = [s.slot - lo for s in rows]
        generated = [len(s.tokens) for s in rows]
        real = sum(s.computed + 1 for s in rows)  # the positions the rows attend to
        for _ in range(self.chain):
            start = time.perf_counter_ns()
            picked: list[Row]
            top = self._top(rows, generated)
            if top:
                assert self.top is not None
                values, best = self.top.run_top(self.cache, ids, lengths, lo, hi)
                picked = [(values[i], best[i]) for i in at]
            else:
                logits = self.model.run(self.cache, ids, lengths, lo, hi)
                picked = [logits[i] for i in at]
            ns = time.perf_counter_ns() - start
            tokens = []
            ended = False
            for j, seq in enumerate(rows):
                # a constrained row waits here for its grammar's mask, computed while this
                # run ran: chaining goes on, one mask ahead (worker/llm/guided.py)
                token = self.results.sample(seq, picked[j], generated[j])
                generated[j] += 1
                tokens.append(token)
                ended = ended or self.results.ends(seq, token, generated[j])
            padding = int(lengths.sum()) - real
            stop = ended or self._interrupted
            if not stop:  # the next run's inputs
                ids[at, 0] = tokens
                lengths[at] += 1
                real += len(rows)
            self._handoff.put((self._emit, runs, tokens, top, ns, padding))
            if stop:
                return

    def _hand_over(self) -> None:
        """On a thread of its own: each item `_steps` puts, called on the event loop in
        order. The step thread then only releases a lock, and this thread takes the GIL
        when the next run releases it."""
        while (item := self._handoff.get()) is not None:
            call, runs, *args = item
            runs.emitted.get_loop().call_soon_threadsafe(call, runs, *args)

    def _emitted(self, runs: DecodeRuns) -> None:
        if not runs.emitted.done():  # cancelled when the engine's loop task was
            runs.emitted.set_result(None)

    def _emit(self, runs: DecodeRuns, tokens: list[int], top: bool, ns: int, padding: int) -> None:
        """On the event loop: one decode run's sampled tokens join their sequences (`top`:
        it read the graph's top-k; `padding`: the positions the rows between them attended
        to)."""
        if runs.error is not None:
            return
        rows = runs.rows
        self._executed("decode", len(rows), len(rows), ns)
        self.stats.decode_runs += 1
        self.stats.decode_tokens += len(rows)
        self.stats.decode_batches[len(rows)] += 1
        self.stats.padding_rows += len(runs.ids) - len(rows)
        self.stats.padding_tokens += padding
        self.stats.top_runs += top
        try:
            for seq, token in zip(rows, tokens, strict=True):
                seq.computed += 1
                if not seq.cancelled and seq.finish_reason is None:
                    self.results.emit(seq, token)
                    if seq.finish_reason is not None:  # a stop string (or an end the
                        self._interrupted = True  # thread saw too): its row runs no more
        except Exception as e:  # the step fails its sequences, as a run's error does
            runs.error = e
            self._interrupted = True

    def _top(self, sampling: list[Sequence], generated: list[int] | None = None) -> bool:
        """Whether a run reads the graph's top-k (k values and ids per row copied out, not the
        vocabulary): when every sequence sampling from it needs no more (greedy, or top_k <=
        the graph's k, without penalties), with `generated` tokens each (None: their tokens
        so far); else the logits."""
        top = self.top
        if top is None:
            return False
        counts = [len(s.tokens) for s in sampling] if generated is None else generated
        return all(
            (n := self.results.top_needed(s, g)) is not None and n <= top.top_k
            for s, g in zip(sampling, counts, strict=True)
        )

    async def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        sampling: list[Sequence],
        ids: np.ndarray,
        lengths: np.ndarray,
        lo: int,
        hi: int,
    ) -> Callable[[int], Row]:
        """One run over slots lo..hi-1; its rows by index: the graph's top-k (k values and
        ids per row copied out, not the vocabulary) when every sequence sampling from the
        run needs no more (greedy, or top_k <= the graph's k, without penalties), else the
        logits."""
        if self._top(sampling):
            assert self.top is not None
            values, best = await loop.run_in_executor(
                self.pool, self.top.run_top, self.cache, ids, lengths, lo, hi
            )
            self.stats.top_runs += 1
            return lambda i: (values[i], best[i])
        logits = await loop.run_in_executor(
            self.pool, self.model.run, self.cache, ids, lengths, lo, hi
        )
        return lambda i: logits[i]

    async def _speculate(self, loop: asyncio.AbstractEventLoop, seq: Sequence, k: int) -> bool:
        """One decode step of one sequence with up to k drafts: the proposer proposes (a
        draft model catches up first), the target scores the last token and the drafts in
        one run, the sequence keeps the longest prefix the target agrees with plus the
        target's own next token. False: nothing was proposed, nothing ran."""
        assert self.drafter is not None
        if self.drafter.runs_model:
            drafts = await loop.run_in_executor(self.pool, self.drafter.propose, seq, k)
        else:
            drafts = self.drafter.propose(seq, k)
        self.stats.draft_ns = self.drafter.ns
        if not drafts:
            return False
        k = len(drafts)
        ids = np.asarray([[seq.tokens[-1], *drafts]], np.int64)
        target = cast(VerifyingModel, self.model)
        start = time.perf_counter_ns()
        logits = await loop.run_in_executor(
            self.pool,
            target.run_positions,
            self.cache,
            ids,
            np.asarray([seq.length + k]),
            seq.slot,
            seq.slot + 1,
        )
        self._executed("decode", 1, k + 1, time.perf_counter_ns() - start)
        self.stats.decode_runs += 1
        self.stats.decode_batches[1] += 1
        self.stats.draft_tokens += k
        length = seq.length
        emitted = 0
        while not seq.cancelled and seq.finish_reason is None and emitted <= k:
            token = self.results.accept(seq, logits[0, emitted])
            hit = emitted < k and token == drafts[emitted]
            emitted += 1
            self.stats.accepted_tokens += int(hit)
            if not hit:
                break
        self.stats.decode_tokens += emitted
        # The row's last token and the kept drafts are in the target's cache, and but for
        # the last draft in the draft's; what lies past them is dead in both.
        seq.computed += max(emitted, 1)
        seq.drafted = min(seq.computed, length + k - 1)
        return True

    def _copy(self, copies: tuple[scheduler.Copy, ...]) -> None:
        """The plan's reused prefixes and moved sequences, row by row into their new slots
        (a memcpy)."""
        for c in copies:
            self.cache.copy_rows(c.src, c.dst, c.start, c.stop)
            if c.move and self.drafter is not None:  # the draft model relearns it
                self.drafter.release(c.src)

    def _executed(self, kind: str, rows: int, tokens: int, ns: int) -> None:
        if kind == "prefill":
            self.stats.prefill_ns += ns
        else:
            self.stats.decode_ns += ns
        if self.on_execution is not None:
            self.on_execution(kind, rows, tokens, ns)


@dataclass
class DecodeRuns:
    """Decode runs of `rows` over the slots from `lo` on, their next input `ids` [slots, 1]
    and `lengths` [slots]; `emitted`: done once the last run's tokens are emitted (on the
    event loop the runs report to); `error`: what emitting them raised, or the runs (the
    runs stop, and the step fails)."""

    rows: list[Sequence]
    lo: int
    ids: np.ndarray
    lengths: np.ndarray
    emitted: asyncio.Future[None]
    error: BaseException | None = None


def copied(row: Row) -> Row:
    """A row of its own: the sampler adjusts a logits row in place (penalties, bans)."""
    if isinstance(row, tuple):
        return (np.array(row[0]), np.array(row[1]))
    return np.array(row)
