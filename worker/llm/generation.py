"""What a sequence generates, and how a run's results become text: sample, detokenize, finish.

The engine's Sequence is the scheduler's (worker/llm/scheduler.py) with what generating needs:
its sampler, its detokenizer and the queue its outputs go to. `Results` accepts one row of
a run for a sequence (worker/llm/step.py calls it after each run; the row is the logits, or
the step graph's own top-k of them when the sampler needs no more): it samples the next
token, hands the new text to the sequence's queue with the running counts, and ends
the sequence on EOS, a stop string, max_tokens or max_model_len; an ended sequence leaves
at once (`leave`: its slot and KV budget go back within the step), or, while the step thread
runs decode steps ahead of the event loop (worker/llm/step.py), once they stop.

A decode row is accepted in two halves: `sample` (the token, on the step thread) and `emit`
(its text and its end, on the event loop); `ends` is what the step thread can tell of an end
without the text: EOS, max_tokens, max_model_len.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from worker.llm import logprobs, scheduler
from worker.llm.detokenize import Detokenizer
from worker.llm.guided import Guide, Vocabulary
from worker.llm.sampling import Sampler, SamplingParams

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"
# one row of a run: the logits [vocab], or the step graph's top-k of them (values, ids)
Row = np.ndarray | tuple[np.ndarray, np.ndarray]
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>")


@dataclass
class Output:
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # the run failed: the sequence ends without more text
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # the ids generated since the previous output (llm_protocol.TOKEN_IDS): a piece's text
    # may lag its tokens (a split character, a held-back stop-string prefix)
    token_ids: list[int] = field(default_factory=list)
    index: int = 0  # the choice (n > 1)
    logprobs: list[dict] | None = None  # one entry per token of this piece, when asked for
    final: bool = False  # the request's last output (every choice finished; Engine.stream)


@dataclass(eq=False, kw_only=True)
class Sequence(scheduler.Sequence):
    """A scheduled sequence with what generating needs: its sampler, its detokenizer and
    the queue its outputs go to."""

    params: SamplingParams
    sampler: Sampler
    detok: Detokenizer
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)  # shared by choices
    # A resumed generation (llm_protocol.RESUME_TOKEN_IDS): the ids it had produced
    # elsewhere, taken in place of its first samples. Decoded one a step as they first were,
    # not prefilled with the prompt: a one-token run rounds differently from a longer one
    # (scheduler.MIN_CHUNK), so only this gives their keys and values, and every later
    # token, bit for bit as in the uninterrupted run.
    forced: list[int] = field(default_factory=list)
    reported: int = 0  # of `tokens`, those already on an output (or sent before a resume)
    index: int = 0  # the choice of its request
    guide: Guide | None = None  # a grammar's matcher (worker/llm/guided.py)
    # logprobs entries: sampled on the step thread, not yet emitted; emitted, not yet sent
    sampled_logprobs: deque[dict] = field(default_factory=deque)
    pending_logprobs: list[dict] = field(default_factory=list)

    @property
    def speculates(self) -> bool:
        # a constrained row's mask exists one token ahead, not k: it never verifies drafts
        return self.guide is None

    def output(self, text: str, reason: str | None = None, error: str | None = None) -> Output:
        """The next output: its text, its end, the running counts, its new ids and the
        logprobs emitted since the last one."""
        ids, self.reported = self.tokens[self.reported :], len(self.tokens)
        counts = len(self.prompt), len(self.tokens)
        taken = None
        if self.params.logprobs is not None:
            taken, self.pending_logprobs = self.pending_logprobs, []
        return Output(
            text,
            reason is not None,
            reason,
            *counts,
            error,
            self.cached,
            ids,
            index=self.index,
            logprobs=taken,
        )


@dataclass
class EngineStats:
    steps: int = 0  # plans the scheduler made and the engine ran (a chain of decode runs: one)
    prefill_runs: int = 0
    prefill_tokens: int = 0
    decode_runs: int = 0
    decode_tokens: int = 0
    decode_batches: Counter[int] = field(default_factory=Counter)  # rows -> decode runs
    # rows of decode runs that decoded nothing (slots between the decoding ones), and the
    # cache positions those rows attended to: compute spent on no token
    padding_rows: int = 0
    padding_tokens: int = 0
    joined_running: int = 0  # sequences that began decoding while others were decoding
    preempted: int = 0  # sequences put back in the queue for a tenant running nothing
    finished: Counter[str] = field(default_factory=Counter)  # finish reason -> count
    rejected: int = 0
    draft_tokens: int = 0  # proposed (by the draft model or n-gram lookup), up to k a step
    accepted_tokens: int = 0  # drafts the target kept
    draft_ns: int = 0  # time proposing: the draft model's runs (not in on_execution's)
    top_runs: int = 0  # runs that read the graph's top-k instead of the logits
    # whole prompts whose first token came from the row the prefix cache kept (no run)
    first_from_cache: int = 0
    # where a step's time goes: its model runs by kind, its copies (reused prefixes and
    # moved sequences, page faults included), and the whole step (the rest of step_ns is
    # sampling, detokenizing and the event loop's other work)
    prefill_ns: int = 0
    decode_ns: int = 0
    copy_ns: int = 0
    copied_rows: int = 0
    step_ns: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class Results:
    """Turns a run's rows into each sequence's tokens, text and end."""

    def __init__(
        self,
        eos: set[int],
        max_model_len: int,
        stats: EngineStats,
        leave: Callable[[Sequence], None],
        vocab: Vocabulary,
    ) -> None:
        self.eos = eos
        self.vocab = vocab  # token bytes, for logprobs
        self.max_model_len = max_model_len
        self.stats = stats
        self._leave = leave  # a running sequence that ended gives back its slot and budget
        self._held: list[Sequence] | None = None  # leaves held back (`hold_leaves`)

    def hold_leaves(self) -> None:
        """Sequences that end from now on leave at `release_leaves`: their slots stay theirs
        while the step thread may still be running a step over them."""
        self._held = []

    def release_leaves(self) -> None:
        held, self._held = self._held or [], None
        for seq in held:
            self._leave(seq)

    def banned(self, seq: Sequence, generated: int | None = None) -> list[int]:
        """The ids the sequence may not sample next, with `generated` tokens generated (None:
        its tokens so far): EOS while under min_tokens (a grammar decides alone where EOS
        may come)."""
        p = seq.params
        if seq.guide is not None:
            return []
        n = len(seq.tokens) if generated is None else generated
        return sorted(self.eos) if n < p.min_tokens and not p.ignore_eos else []

    def can_sample(self, seq: Sequence, row: object) -> bool:
        """Whether the sequence's next token can be sampled from `row`: the logits always,
        the graph's top-k when it holds as many as the sampler needs."""
        if not isinstance(row, tuple):
            return True
        needed = self.top_needed(seq)
        return needed is not None and needed <= len(row[0])

    def top_needed(self, seq: Sequence, generated: int | None = None) -> int | None:
        """How many of its row's largest logits the sequence's next token needs, with
        `generated` tokens generated (None: its tokens so far; the result None: the whole
        row): a run whose rows all need at most the graph's k reads only its top-k."""
        return seq.sampler.top_needed(len(self.banned(seq, generated)))

    def accept(self, seq: Sequence, row: Row) -> int:
        """Sample the sequence's next token from its row of a run (the logits, or the
        graph's top-k of them as (values, ids)) and hand it its new text; the token."""
        token = self.sample(seq, row, len(seq.tokens))
        self.emit(seq, token)
        return token

    def sample(self, seq: Sequence, row: Row, generated: int) -> int:
        """The sequence's next token from its row, its `generated` tokens so far counted (its
        sampler's state is this call's alone: the step thread samples while the event loop
        emits the tokens before). A resumed sequence's earlier ids come first: sampled all the
        same, so that its sampler's random draws go on as they first did, then replaced."""
        banned = self.banned(seq, generated)
        raw = None
        if isinstance(row, tuple):  # never for logprobs or a grammar (Sampler.top_needed)
            token = seq.sampler.sample_top(row[0], row[1], banned)
        else:  # a row of this step's own logits
            top = seq.params.logprobs
            raw = row.copy() if top is not None else None  # before the sampler alters it
            allowed = seq.guide.allowed() if seq.guide is not None else None
            token = seq.sampler.sample(row, banned, allowed)
        if generated < len(seq.forced):
            token = seq.forced[generated]
        if raw is not None and seq.params.logprobs is not None:
            seq.sampled_logprobs.append(logprobs.entry(raw, token, seq.params.logprobs, self.vocab))
        if seq.guide is not None:
            seq.guide.advance(token)
        seq.sampler.observe(token)
        return token

    def ends(self, seq: Sequence, token: int, generated: int) -> bool:
        """Whether `token`, the sequence's `generated`-th, ends it whatever its text says:
        EOS, the grammar's end, max_tokens or max_model_len (a stop string only the
        detokenizer sees)."""
        guide = seq.guide
        return (
            self._eos(seq, token)
            or (guide is not None and guide.ends(generated))
            or self._at_length(seq, generated)
        )

    def _eos(self, seq: Sequence, token: int) -> bool:
        return token in self.eos and not seq.params.ignore_eos

    def _at_length(self, seq: Sequence, generated: int) -> bool:
        return (
            generated >= seq.params.max_tokens or len(seq.prompt) + generated >= self.max_model_len
        )

    def emit(self, seq: Sequence, token: int) -> None:
        """The sampled token joins the sequence: its new text goes out, or its end."""
        seq.tokens.append(token)
        entry = seq.sampled_logprobs.popleft() if seq.sampled_logprobs else None
        reason = None
        if len(seq.tokens) <= len(seq.forced):  # its text was sent before the resume
            seq.detok.add(token)
            return
        if entry is not None:
            seq.pending_logprobs.append(entry)
        if self._eos(seq, token):
            reason = STOP
            piece = ""
        else:
            piece = seq.detok.add(token)
            if seq.detok.stopped or (seq.guide is not None and seq.guide.ends(len(seq.tokens))):
                reason = STOP
        if reason is None and self._at_length(seq, len(seq.tokens)):
            reason = LENGTH
        if reason is None:
            if piece:
                # Running counts on every piece: what a stream cut here has sent.
                seq.outputs.put_nowait(seq.output(piece))
            return
        self.finish(seq, reason, piece)

    def finish(self, seq: Sequence, reason: str, piece: str = "") -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if reason != CANCELLED:
            piece += seq.detok.finish()
        seq.outputs.put_nowait(seq.output(piece, reason))
        self.stats.finished[reason] += 1
        self._ended(seq)

    def fail(self, seq: Sequence, error: Exception) -> None:
        """A run that raised: the sequence ends with the error instead of text."""
        seq.finish_reason = "error"
        self.stats.finished["error"] += 1
        seq.outputs.put_nowait(seq.output("", "error", f"{error}"))
        self._ended(seq)

    def _ended(self, seq: Sequence) -> None:
        if self._held is not None:
            self._held.append(seq)
        else:
            self._leave(seq)
