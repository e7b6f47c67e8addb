"""The generation engine: iteration-level scheduling over a server-owned KV cache.

One loop owns the model, the cache and every sequence. Each iteration decides, then does:

1. `schedule()` returns a StepPlan (worker/llm/scheduler.py): who was cancelled or
   admitted, which prompts prefill how many tokens, which sequences decode, all within the
   step's token budget;
2. the plan runs (worker/llm/step.py): its cache copies, one prefill run per chunk, one
   decode run for every decoding row (or a speculative verify run for a lone one);
3. the results are accepted (worker/llm/generation.py): each sequence samples (a decode
   row on the step thread, which may go on to the next decode run), detokenizes and gets
   its new text; a chunk that ends its prompt gives the first token; a finished sequence
   leaves and frees its cache.

This module is the engine's face: requests are admitted (`add`, refused at once with the
numbers that did not fit), streamed (`stream`, leaving early cancels) and cancelled, and the
loop runs the steps.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import structlog
from tokenizers import Tokenizer

from common.errors import InvalidArgument, ResourceExhausted, Unavailable
from worker.llm import scheduler
from worker.llm.cache import KVCache, page_aligned
from worker.llm.detokenize import Detokenizer
from worker.llm.engine_config import EngineConfig
from worker.llm.generation import (
    CANCELLED,
    EOS_TOKENS,
    LENGTH,
    STOP,
    EngineStats,
    Output,
    Results,
    Sequence,
)
from worker.llm.guided import Vocabulary
from worker.llm.kv_manager import KVCacheManager, retained_slots
from worker.llm.model import Model
from worker.llm.sampling import Sampler, SamplingParams
from worker.llm.speculative import DraftConfig, SpeculativeConfig, proposer
from worker.llm.step import OnExecution, StepRunner

log = structlog.get_logger()

__all__ = ["CANCELLED", "LENGTH", "STOP", "Engine", "EngineConfig", "Output", "Sequence"]


def positions_limit(model: Model, config: EngineConfig, draft: SpeculativeConfig | None) -> int:
    """The positions a run may use (the RoPE tables of the target and its draft), checked
    against the config; a draft that cannot serve this target is refused here."""
    facts = model.facts
    positions = [facts.max_positions]
    if isinstance(draft, DraftConfig):
        positions.append(draft.model.facts.max_positions)
        if draft.model.facts.vocab_size != facts.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.model.facts.vocab_size}) is not the "
                f"target's ({facts.vocab_size})"
            )
    if draft is not None:
        if not getattr(model, "position_logits", False):
            raise ValueError(
                "the target's step graph returns the last position's logits only; verifying "
                "drafts needs one built with all_positions (quantize/llm_graph.py)"
            )
        if draft.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens {draft.num_tokens}: must be >= 1")
    if config.max_model_len > min(positions):
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the graph's RoPE table of "
            f"{min(positions)} positions"
        )
    return min(positions)


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        on_execution: OnExecution | None = None,
        draft: SpeculativeConfig | None = None,
    ) -> None:
        positions = positions_limit(model, config, draft)
        if config.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps {config.num_scheduler_steps}: must be >= 1")
        facts = model.facts
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = {i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
        budget = min(config.kv_cache_tokens, config.max_num_seqs * config.max_model_len)
        row = facts.kv_heads * facts.head_dim
        itemsize = facts.cache_shape(1, 1).itemsize  # the graph's KV dtype
        max_len = page_aligned(config.max_model_len, row, itemsize=itemsize)
        # running slots, then the retained region's (worker/llm/kv_manager.py)
        slots = config.max_num_seqs + retained_slots(config.max_num_seqs, config.prefix_caching)
        self.cache = KVCache(facts.cache_shape(slots, max_len), model.cache_device)
        # the cache's room: slots, reservations, the prefixes its slots keep; it tells the
        # memory what to copy and discard
        self.kv = KVCacheManager(
            config.max_num_seqs, budget, enabled=config.prefix_caching, memory=self.cache
        )
        self.stats = EngineStats()
        self.vocab = Vocabulary(tokenizer, facts.vocab_size, self.eos)
        self.results = Results(self.eos, config.max_model_len, self.stats, self._leave, self.vocab)
        self.drafter = None
        if draft is not None:
            self.drafter = proposer(draft, config.max_num_seqs, self.cache.shape.max_len)
        self.scheduler: scheduler.Scheduler[Sequence] = scheduler.Scheduler(
            self.kv,
            scheduler.SchedulerConfig(
                max_step_tokens=config.max_step_tokens,
                step_tokens_per_row=config.step_tokens_per_row,
                prefill_chunk=config.prefill_chunk,
                max_waiting=config.max_waiting,
                reserved_slots=config.reserved_slots,
                fair_preemption=config.fair_preemption,
                num_speculative_tokens=draft.num_tokens if draft is not None else 0,
                # positions a run may write to (a draft writes up to k past a length)
                position_limit=min(self.cache.shape.max_len, positions),
            ),
            whole=self.results.can_sample,
        )
        self.runner = StepRunner(
            model, self.cache, self.scheduler, self.drafter, self.results, self.stats
        )
        self.runner.on_execution = on_execution
        self.runner.chain = config.num_scheduler_steps
        # (ns a request waited for admission): Triton's queue statistics, which perf_analyzer
        # and genai-perf read to find the model version that served them
        self.on_admit: Callable[[int], None] = lambda ns: None
        self._ids = itertools.count(1)
        # a request's further choices, queued once its first has prefilled the prompt
        self._siblings: list[tuple[Sequence, list[Sequence]]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None

    @property
    def on_execution(self) -> OnExecution | None:
        """Told (kind, rows, tokens, ns) of every model run, for Triton's statistics."""
        return self.runner.on_execution

    @on_execution.setter
    def on_execution(self, callback: OnExecution | None) -> None:
        self.runner.on_execution = callback

    # ---- the API the servicer uses -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids  # type: ignore[no-any-return]

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        root: bytes = b"",
        tenant: str = "",
        weight: float = 1.0,
        resume: list[int] | None = None,
    ) -> Sequence:
        """Queue a request of one choice (`add_choices` for n), or refuse it at once with the
        numbers that did not fit. `root`: its prefix cache key root (prefix.root_key: model,
        version, cache_salt); `tenant` and `weight`: its share in fair admission
        (worker/llm/fairness.py); `resume`: the ids it had generated elsewhere
        (llm_protocol.RESUME_TOKEN_IDS), continued from."""
        if params.n != 1:
            raise ValueError("Engine.add queues one choice: use add_choices for n > 1")
        return self.add_choices(prompt, params, root, tenant, weight, resume)[0]

    def add_choices(
        self,
        prompt: list[int],
        params: SamplingParams,
        root: bytes = b"",
        tenant: str = "",
        weight: float = 1.0,
        resume: list[int] | None = None,
    ) -> list[Sequence]:
        """Queue a request's n choices, one sequence each, sharing one output queue. The
        first prefills the prompt; the others are queued once it has (`_release_siblings`)
        and take its rows, and the row its first token came from, from the prefix cache:
        the prompt is prefilled once. Choice i of a seeded request draws with seed + i. A
        grammar (or logprobs) builds the vocabulary on first use: call `vocab.ready` off
        the event loop before."""
        if self._closed:
            raise Unavailable("the engine is shutting down")
        resume = resume or []
        if resume and params.n > 1:
            raise InvalidArgument("parameter 'resume_token_ids' continues one choice, not n > 1")
        reserve = self._check(prompt, params, resume)
        waiting = len(self.scheduler.waiting) + len(self._siblings)
        if waiting + params.n > self.config.max_waiting:
            self.stats.rejected += 1
            raise ResourceExhausted(
                f"{waiting} requests are already waiting for KV cache (max "
                f"{self.config.max_waiting}); {params.n} choices do not fit; retry later"
            )
        guides = None
        if params.guide is not None:
            guides = self.vocab.guides(params.guide, params.n)
        if params.logprobs is not None:
            self.vocab.ready()
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        seqs = []
        for i in range(params.n):
            own = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            seqs.append(
                Sequence(
                    id=next(self._ids),
                    prompt=prompt,
                    params=own,
                    sampler=Sampler(own, prompt, self.model.facts.vocab_size),
                    detok=Detokenizer(self.tokenizer, own.stop, own.skip_special_tokens),
                    reserve=reserve,
                    root=root,
                    tenant=tenant,
                    weight=weight,
                    forced=resume,
                    reported=len(resume),
                    outputs=outputs,
                    index=i,
                    guide=None if guides is None else guides[i],
                )
            )
        self.scheduler.add(seqs[0], queued=True)
        if len(seqs) > 1:
            self._siblings.append((seqs[0], seqs[1:]))
        self._notify()
        return seqs

    def _check(self, prompt: list[int], params: SamplingParams, resume: list[int]) -> int:
        """The request's KV reservation (prompt + max_tokens within max_model_len), or
        INVALID_ARGUMENT naming what cannot be served."""
        limit = self.config.max_model_len
        if not prompt:
            raise InvalidArgument("the prompt is empty: text_input must hold at least one token")
        if len(resume) >= params.max_tokens:
            raise InvalidArgument(
                f"parameter 'resume_token_ids' holds {len(resume)} ids, max_tokens is "
                f"{params.max_tokens}: nothing is left to generate"
            )
        full = prompt + resume
        if len(full) >= limit:  # a resumed sequence's ids were within it
            raise InvalidArgument(
                f"the prompt is {len(full)} tokens; max_model_len is {limit} (prompt + "
                "generated tokens), so a prompt may have at most "
                f"{limit - 1} tokens"
            )
        bad = next((t for t in full if not 0 <= t < self.model.facts.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary [0, {self.model.facts.vocab_size})"
            )
        reserve = min(len(prompt) + params.max_tokens, limit)
        if reserve > self.kv.budget_tokens:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt) + params.max_tokens} exceeds the KV cache budget of "
                f"{self.kv.budget_tokens} tokens; lower max_tokens"
            )
        return reserve

    def _release_siblings(self) -> None:
        """Queue the further choices of requests whose first choice has its first token (its
        prompt's rows and last row are in the prefix cache) or has ended."""
        waiting = []
        for first, rest in self._siblings:
            if first.tokens or first.finish_reason is not None:
                for seq in rest:
                    self.scheduler.add(seq, queued=True)
            else:
                waiting.append((first, rest))
        self._siblings = waiting

    async def stream(self, seqs: Sequence | list[Sequence]) -> AsyncIterator[Output]:
        """The outputs of a request's choices as they come (their shared queue); the one
        after which every choice has finished is `final`. Leaving early cancels them."""
        choices = seqs if isinstance(seqs, list) else [seqs]
        left = len(choices)
        try:
            while left:
                out = await choices[0].outputs.get()
                left -= out.finished
                out.final = not left
                yield out
        finally:
            for seq in choices:
                if seq.finish_reason is None:
                    self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._notify()

    def _notify(self) -> None:
        """The scheduler has something to decide: wake the loop, stop runs going on ahead."""
        self.runner.interrupt()
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
        return self.kv.reserved_tokens

    def schedule(self) -> scheduler.StepPlan[Sequence]:
        """The next step, decided (worker/llm/scheduler.py); nothing has run yet."""
        return self.scheduler.schedule()

    async def close(self) -> None:
        self._closed = True
        self._notify()
        if self._task is not None:
            await self._task
        pending = [s for _, rest in self._siblings for s in rest]
        for seq in [*self.waiting, *self.running, *pending]:
            self.results.finish(seq, CANCELLED)
        self.runner.close()
        self.vocab.close()
        self.cache.close()
        if self.drafter is not None:
            self.drafter.close()

    # ---- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self._closed:
            plan = self.schedule()
            self._cancelled(plan)
            if plan.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.runner.run(plan)
            except Exception as e:  # a failed run fails the sequences in it, not the worker
                log.exception("llm_step_failed")
                for seq in list(self.running):
                    self.results.fail(seq, e)
            self._release_siblings()
        prefix = {f"prefix_{k}": v for k, v in self.kv.stats.__dict__.items()}
        log.info("llm_engine_stopped", **self.stats.__dict__, **prefix)

    def _cancelled(self, plan: scheduler.StepPlan[Sequence]) -> None:
        now = time.perf_counter_ns()
        for seq in plan.admitted:
            if not seq.preemptions:  # a preempted one's first wait was counted
                self.on_admit(now - seq.arrived_ns)
        if plan.preempted:
            self.stats.preempted += len(plan.preempted)
            log.info(
                "llm_preempted",
                sequences=[s.id for s in plan.preempted],
                tenants=[s.tenant for s in plan.preempted],
                prefill_again=[s.context for s in plan.preempted],
            )
        for slot in plan.freed:
            if self.drafter is not None:
                self.drafter.release(slot)
        for seq in plan.cancelled:
            self.results.finish(seq, CANCELLED)

    def cached_tokens(self) -> int:
        """Tokens in the cache over the generating sequences (what a decode run reads)."""
        return sum(s.computed for s in self.running if not s.prefilling)

    def _leave(self, seq: Sequence) -> None:
        """A running sequence that ended gives back its slot and its KV budget."""
        slot = self.scheduler.finish(seq)
        if slot >= 0 and self.drafter is not None:
            self.drafter.release(slot)
