"""The generation engine: iteration-level scheduling over a server-owned KV cache.

One loop owns the model, the cache and every sequence. Each iteration decides, then does:

1. `schedule()` returns a StepPlan (worker/llm/scheduler.py): who was cancelled or
   admitted, which prompts prefill how many tokens, which sequences decode, all within the
   step's token budget;
2. the plan runs: one prefill run per chunk (onnxruntime's GroupQueryAttention on CPU
   takes several new tokens for one row only), then one decode run for every decoding row:
   rows of different lengths share one run, each attending to its own cache;
3. the results are accepted: each sequence samples, detokenizes and gets its new text; a
   chunk that ends its prompt gives the first token; a finished sequence leaves at once and
   frees its cache.

Model runs go to one thread (onnxruntime releases the GIL), so gRPC keeps being served while
a step computes; sampling and detokenizing run on the event loop between steps.

With a draft model (speculative decoding, worker/llm/speculative.py), step 4 becomes, while
one sequence is decoding: the draft proposes k tokens, greedily; the target scores the last
token and the k drafts in one run (logits at all k + 1 positions); the sequence then samples
position by position with its own sampler, keeping tokens while they equal the drafts, and
ends with the first that differs (or the bonus token after k hits). With several sequences
decoding, the plain batched step runs: onnxruntime's GroupQueryAttention on CPU takes
several new tokens over a cache for one row only, so a verify run cannot batch rows, and
separate runs per row would read the target's weights once per row where one decode step
reads them once for all (vLLM, too, turns speculation off above a batch size).

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
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import structlog
from tokenizers import Tokenizer

from common.errors import InvalidArgument, ResourceExhausted, Unavailable
from worker.llm import scheduler
from worker.llm.cache import KVCache, page_aligned
from worker.llm.detokenize import Detokenizer
from worker.llm.model import Model, VerifyingModel
from worker.llm.prefix import PrefixCache
from worker.llm.sampling import Sampler, SamplingParams
from worker.llm.speculative import DraftConfig, Drafter

log = structlog.get_logger()

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_seqs: int = 16  # sequences generating at once (cache slots)
    kv_cache_tokens: int = 16384  # the KV budget, in tokens, shared by running sequences
    prefill_chunk: int = 512  # prompt tokens of one sequence per step, at most
    max_step_tokens: int = 48  # decode rows + prefill tokens per step while streams decode
    max_waiting: int = 256  # requests queued for admission; beyond: RESOURCE_EXHAUSTED
    prefix_caching: bool = True  # keep finished sequences' KV to reuse (worker/llm/prefix.py)


@dataclass
class Output:
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # the run failed: the sequence ends without more text
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(eq=False, kw_only=True)
class Sequence(scheduler.Sequence):
    """A scheduled sequence with what generating needs: its sampler, its detokenizer and
    the queue its outputs go to."""

    params: SamplingParams
    sampler: Sampler
    detok: Detokenizer
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_runs: int = 0
    prefill_tokens: int = 0
    decode_runs: int = 0
    decode_tokens: int = 0
    decode_batches: Counter[int] = field(default_factory=Counter)  # rows -> decode runs
    joined_running: int = 0  # sequences that began decoding while others were decoding
    finished: Counter[str] = field(default_factory=Counter)  # finish reason -> count
    rejected: int = 0
    draft_tokens: int = 0  # proposed by the draft model (k per speculative step)
    accepted_tokens: int = 0  # drafts the target kept
    draft_ns: int = 0  # time in the draft model's runs (not in on_execution's)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        on_execution=None,  # type: ignore[no-untyped-def]
        draft: DraftConfig | None = None,
    ) -> None:
        facts = model.facts
        positions = [facts.max_positions]
        if draft is not None:
            positions.append(draft.model.facts.max_positions)
            if draft.model.facts.vocab_size != facts.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.model.facts.vocab_size}) is not the "
                    f"target's ({facts.vocab_size})"
                )
            if not getattr(model, "position_logits", False):
                raise ValueError(
                    "the target's step graph returns the last position's logits only; a draft "
                    "needs one built with all_positions (quantize/llm_graph.py)"
                )
            if draft.num_tokens < 1:
                raise ValueError(f"num_speculative_tokens {draft.num_tokens}: must be >= 1")
        if config.max_model_len > min(positions):
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the graph's RoPE table of "
                f"{min(positions)} positions"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = {i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
        budget = min(config.kv_cache_tokens, config.max_num_seqs * config.max_model_len)
        row = facts.kv_heads * facts.head_dim
        itemsize = facts.cache_shape(1, 1).itemsize  # the graph's KV dtype
        self.cache = KVCache(
            facts.cache_shape(
                config.max_num_seqs,
                page_aligned(config.max_model_len, row, itemsize=itemsize),
            ),
            budget,
        )
        # the cache's room: slots and reservations, and the prefixes its slots keep
        self.prefix = PrefixCache(
            config.max_num_seqs,
            budget,
            discard=self.cache.discard_from,
            enabled=config.prefix_caching,
        )
        self.cache.room = self.prefix
        self.drafter = None
        if draft is not None:
            shape = self.cache.shape
            self.drafter = Drafter(draft, shape.slots, shape.max_len, budget)
        self.scheduler: scheduler.Scheduler[Sequence] = scheduler.Scheduler(
            self.cache.room,
            scheduler.SchedulerConfig(
                max_step_tokens=config.max_step_tokens,
                prefill_chunk=config.prefill_chunk,
                max_waiting=config.max_waiting,
                num_speculative_tokens=draft.num_tokens if draft is not None else 0,
                # positions a run may write to (a draft writes up to k past a length)
                position_limit=min(self.cache.shape.max_len, *positions),
            ),
        )
        self.stats = EngineStats()
        self.on_execution = on_execution  # (kind, rows, tokens, ns) for Triton statistics
        # (ns a request waited for admission): Triton's queue statistics, which perf_analyzer
        # and genai-perf read to find the model version that served them
        self.on_admit: Callable[[int], None] = lambda ns: None
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-step")
        self._closed = False
        self._task: asyncio.Task | None = None

    # ---- the API the servicer uses -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids  # type: ignore[no-any-return]

    def add(self, prompt: list[int], params: SamplingParams, root: bytes = b"") -> Sequence:
        """Queue a request, or refuse it at once with the numbers that did not fit. `root`:
        its prefix cache key root (prefix.root_key: model, version, cache_salt)."""
        if self._closed:
            raise Unavailable("the engine is shutting down")
        limit = self.config.max_model_len
        if not prompt:
            raise InvalidArgument("the prompt is empty: text_input must hold at least one token")
        if len(prompt) >= limit:
            raise InvalidArgument(
                f"the prompt is {len(prompt)} tokens; max_model_len is {limit} (prompt + "
                "generated tokens), so a prompt may have at most "
                f"{limit - 1} tokens"
            )
        bad = next((t for t in prompt if not 0 <= t < self.model.facts.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary [0, {self.model.facts.vocab_size})"
            )
        reserve = min(len(prompt) + params.max_tokens, limit)
        if reserve > self.cache.budget_tokens:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt) + params.max_tokens} exceeds the KV cache budget of "
                f"{self.cache.budget_tokens} tokens; lower max_tokens"
            )
        seq = Sequence(
            id=next(self._ids),
            prompt=prompt,
            params=params,
            sampler=Sampler(params, prompt, self.model.facts.vocab_size),
            detok=Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
            reserve=reserve,
            root=root,
        )
        try:
            self.scheduler.add(seq)
        except ResourceExhausted:
            self.stats.rejected += 1
            raise
        self._wake.set()
        return seq

    async def stream(self, seq: Sequence) -> AsyncIterator[Output]:
        """The sequence's outputs as they come; leaving early cancels it."""
        try:
            while True:
                out = await seq.outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            if seq.finish_reason is None:
                self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._wake.set()

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def depth(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def kv_used_tokens(self) -> int:
        return self.cache.reserved_tokens

    def schedule(self) -> scheduler.StepPlan[Sequence]:
        """The next step, decided (worker/llm/scheduler.py); nothing has run yet."""
        return self.scheduler.schedule()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, CANCELLED)
        self._pool.shutdown(wait=True)
        self.cache.close()
        if self.drafter is not None:
            self.drafter.close()

    # ---- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            plan = self.schedule()
            self._cancelled(plan)
            if plan.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step(loop, plan)
            except Exception as e:  # a failed run fails the sequences in it, not the worker
                log.exception("llm_step_failed")
                for seq in list(self.running):
                    self._fail(seq, e)
        log.info("llm_engine_stopped", **{k: v for k, v in self.stats.__dict__.items()})

    def _cancelled(self, plan: scheduler.StepPlan[Sequence]) -> None:
        now = time.perf_counter_ns()
        for seq in plan.admitted:
            self.on_admit(now - seq.arrived_ns)
        for slot in plan.freed:
            if self.drafter is not None:
                self.drafter.release(slot)
        for seq in plan.cancelled:
            self._finish(seq, CANCELLED)

    async def _step(
        self, loop: asyncio.AbstractEventLoop, plan: scheduler.StepPlan[Sequence]
    ) -> None:
        """Run the plan: its prefill chunks, then its decode rows; accept each result."""
        self.stats.steps += 1
        if plan.copies:
            await loop.run_in_executor(self._pool, self._copy, plan.copies)
        for chunk in plan.prefill:
            await self._prefill(loop, chunk, joining=bool(plan.decode))
        decoding = [s for s in plan.decode if s.finish_reason is None and not s.cancelled]
        if not decoding:
            return
        if plan.drafts:
            await self._speculate(loop, decoding[0], plan.drafts)
            return
        await self._decode(loop, decoding)

    async def _prefill(
        self, loop: asyncio.AbstractEventLoop, chunk: scheduler.Chunk[Sequence], joining: bool
    ) -> None:
        seq, n = chunk.seq, chunk.tokens
        ids = np.asarray([seq.prompt[chunk.start : chunk.start + n]])
        lengths = np.asarray([chunk.start + n])
        start = time.perf_counter_ns()
        logits = await loop.run_in_executor(
            self._pool, self.model.run, self.cache, ids, lengths, seq.slot, seq.slot + 1
        )
        self._executed("prefill", 1, n, time.perf_counter_ns() - start)
        seq.computed = chunk.start + n
        self.scheduler.computed(seq)
        self.stats.prefill_runs += 1
        self.stats.prefill_tokens += n
        if chunk.completes and not seq.cancelled:
            if joining:
                self.stats.joined_running += 1
            self._accept(seq, logits[0])

    async def _decode(self, loop: asyncio.AbstractEventLoop, decoding: list[Sequence]) -> None:
        """One token for every decoding row, in one run over the slots they span."""
        lo = min(s.slot for s in decoding)
        hi = max(s.slot for s in decoding) + 1
        ids = np.zeros((hi - lo, 1), np.int64)
        lengths = np.ones(hi - lo, np.int64)
        # Rows between the decoding ones (free slots, prompts mid-prefill, retained prefixes)
        # run a dummy token written just past their own data, where their next real token
        # will overwrite it.
        for slot in range(lo, hi):
            lengths[slot - lo] = self.prefix.held_length(slot) + 1
        for seq in self.running:
            if lo <= seq.slot < hi:
                lengths[seq.slot - lo] = seq.computed + 1
        for seq in decoding:
            ids[seq.slot - lo, 0] = seq.tokens[-1]
        start = time.perf_counter_ns()
        logits = await loop.run_in_executor(
            self._pool, self.model.run, self.cache, ids, lengths, lo, hi
        )
        self._executed("decode", len(decoding), len(decoding), time.perf_counter_ns() - start)
        self.stats.decode_runs += 1
        self.stats.decode_tokens += len(decoding)
        self.stats.decode_batches[len(decoding)] += 1
        for seq in decoding:
            seq.computed += 1
            if not seq.cancelled:
                self._accept(seq, logits[seq.slot - lo])

    async def _speculate(self, loop: asyncio.AbstractEventLoop, seq: Sequence, k: int) -> None:
        """One decode step of one sequence with k drafts: the draft catches up and proposes,
        the target scores the last token and the drafts in one run, the sequence keeps the
        longest prefix the target agrees with plus the target's own next token."""
        assert self.drafter is not None
        pending = seq.since(seq.drafted)  # tokens the draft has not seen yet (1 or 2 mostly)
        drafts = await loop.run_in_executor(
            self._pool, self.drafter.propose, pending, seq.length, seq.slot, k
        )
        ids = np.asarray([[seq.tokens[-1], *drafts]], np.int64)
        target = cast(VerifyingModel, self.model)
        start = time.perf_counter_ns()
        logits = await loop.run_in_executor(
            self._pool,
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
        self.stats.draft_ns = self.drafter.ns
        length = seq.length
        emitted = 0
        while not seq.cancelled and seq.finish_reason is None and emitted <= k:
            token = self._accept(seq, logits[0, emitted])
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

    def _copy(self, copies: tuple[scheduler.Copy, ...]) -> None:
        """The plan's reused prefixes, row by row into their new slots (a memcpy)."""
        for c in copies:
            self.cache.copy_rows(c.src, c.dst, c.start, c.stop)
            self.prefix.unpin(c.src)

    def cached_tokens(self) -> int:
        """Tokens in the cache over the generating sequences (what a decode run reads)."""
        return sum(s.computed for s in self.running if not s.prefilling)

    def _executed(self, kind: str, rows: int, tokens: int, ns: int) -> None:
        if self.on_execution is not None:
            self.on_execution(kind, rows, tokens, ns)

    def _accept(self, seq: Sequence, logits: np.ndarray) -> int:
        """Sample the sequence's next token and hand it its new text; the token."""
        p = seq.params
        banned = None
        if len(seq.tokens) < p.min_tokens and not p.ignore_eos:
            banned = sorted(self.eos)
        token = seq.sampler.sample(logits, banned)  # a row of this step's own logits
        seq.sampler.observe(token)
        seq.tokens.append(token)
        reason = None
        if token in self.eos and not p.ignore_eos:
            reason = STOP
            piece = ""
        else:
            piece = seq.detok.add(token)
            if seq.detok.stopped:
                reason = STOP
        if reason is None and (
            len(seq.tokens) >= p.max_tokens or seq.length >= self.config.max_model_len
        ):
            reason = LENGTH
        if reason is None:
            if piece:
                # Running counts on every piece: what a stream cut here has sent.
                seq.outputs.put_nowait(
                    Output(piece, False, None, len(seq.prompt), len(seq.tokens), None, seq.cached)
                )
            return token
        self._finish(seq, reason, piece)
        return token

    def _finish(self, seq: Sequence, reason: str, piece: str = "") -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if reason != CANCELLED:
            piece += seq.detok.finish()
        seq.outputs.put_nowait(
            Output(piece, True, reason, len(seq.prompt), len(seq.tokens), None, seq.cached)
        )
        self.stats.finished[reason] += 1
        self._leave(seq)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """A run that raised: the sequence ends with the error instead of text."""
        seq.finish_reason = "error"
        self.stats.finished["error"] += 1
        seq.outputs.put_nowait(
            Output("", True, "error", len(seq.prompt), len(seq.tokens), f"{error}", seq.cached)
        )
        self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        """A running sequence that ended gives back its slot and its KV budget."""
        slot = self.scheduler.finish(seq)
        if slot >= 0 and self.drafter is not None:
            self.drafter.release(slot)
