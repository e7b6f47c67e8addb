"""The LLM mode's conversation and shared-prefix load: N conversations x K turns on one
system prompt, each turn resending the whole history (the system prompt, every earlier
question and answer, the new question), with think time between a turn's answer and the
next question. Turns of different conversations overlap; one conversation's turns are in
order. K = 1 is the shared-prefix load: N requests on one system prompt, `concurrency` at
a time.

Over ModelStreamInfer (meshserve, with `session_id` = the conversation when asked, for the
router's affinity) or an OpenAI completions server's SSE (`api="openai"`, llama-server).
Reported: wall time, TTFT p50/p90 per turn and overall, the hit rate (the server's
cached_tokens over its prompt_tokens, where it reports them), output tokens/s, errors.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from loadtest.llm import openai
from loadtest.llm.stream import Outcome, Streams, build_request

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "from",
    "at",
    "which",
    "an",
    "but",
    "not",
    "have",
    "they",
    "one",
    "you",
    "all",
    "were",
    "can",
    "there",
    "has",
    "more",
    "their",
    "if",
    "will",
    "about",
    "would",
    "been",
    "so",
]


@dataclass
class ConversationLoad:
    address: str
    model: str
    conversations: int = 4
    turns: int = 4
    system_words: int = 600  # ~800 tokens
    question_words: int = 40
    max_tokens: int = 32
    concurrency: int = 4  # conversations at once
    think_time: float = 0.0  # seconds between an answer and the next question
    timeout: float = 300.0
    api: str = "triton"  # triton: ModelStreamInfer; openai: POST /v1/completions, SSE
    sessions: bool = False  # send session_id = the conversation (the router's affinity)
    distinct_systems: int = 1  # system prompts, spread over the conversations
    seed: int = 0
    sampling: dict = field(default_factory=dict)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Turn:
    conversation: int
    turn: int
    out: Outcome

    @property
    def ttft(self) -> float | None:
        return self.out.pieces[0] - self.out.start if self.out.pieces else None


async def run(load: ConversationLoad) -> dict:
    rng = random.Random(load.seed)
    systems = [f"System {i}: " + text(rng, load.system_words) for i in range(load.distinct_systems)]
    questions = [
        [text(rng, load.question_words) for _ in range(load.turns)]
        for _ in range(load.conversations)
    ]
    streams: Streams | openai.OpenAIStreams = (
        openai.OpenAIStreams(load.address) if load.api == "openai" else Streams(load.address)
    )
    loop = asyncio.get_running_loop()
    turns: list[Turn] = []
    gate = asyncio.Semaphore(load.concurrency)
    sampling = {"max_tokens": load.max_tokens, "temperature": 0.0, "ignore_eos": True}
    sampling.update(load.sampling)

    async def conversation(c: int) -> None:
        history = systems[c % len(systems)]
        async with gate:
            for k in range(load.turns):
                history += f"\nUser: {questions[c][k]}\nAssistant:"
                request: object
                if load.api == "openai":
                    request = openai.build_request(load.model, history, sampling)
                else:
                    r = build_request(load.model, history, sampling, request_id=f"{c}.{k}")
                    if load.sessions:
                        r.parameters["session_id"].string_param = f"conversation-{c}"
                    request = r
                out = await streams.generate(request, loop.time(), load.timeout, loop.time)  # type: ignore[arg-type]
                turns.append(Turn(c, k, out))
                history += out.text
                if load.think_time and k + 1 < load.turns:
                    await asyncio.sleep(load.think_time)

    start = loop.time()
    try:
        await asyncio.gather(*(conversation(c) for c in range(load.conversations)))
    finally:
        await streams.close()
    wall = loop.time() - start
    return summary(turns, wall, load)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(turns: list[Turn], wall: float, load: ConversationLoad) -> dict:
    ok = [t for t in turns if t.out.error is None]
    per_turn = {}
    for k in range(load.turns):
        ttfts = [x for t in ok if t.turn == k and (x := t.ttft) is not None]
        per_turn[str(k + 1)] = {"ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9)}
    ttfts = [x for t in ok if (x := t.ttft) is not None]
    prompt = sum(t.out.prompt_tokens or 0 for t in ok if t.out.cached_tokens is not None)
    cached = sum(t.out.cached_tokens or 0 for t in ok)
    out_tokens = sum(t.out.completion_tokens or 0 for t in ok)
    errors: dict[str, int] = {}
    for t in turns:
        if t.out.error is not None:
            errors[t.out.error] = errors.get(t.out.error, 0) + 1
    return {
        "conversations": load.conversations,
        "turns": load.turns,
        "requests": len(turns),
        "wall_s": round(wall, 3),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "per_turn": per_turn,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "cached_tokens": cached,
        "output_tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else 0.0,
        "errors": errors,
    }


def main(argv: list[str]) -> int:
    """python -m loadtest --llm --conversations N --turns K --model M [...]"""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="python -m loadtest --llm --conversations N", description=__doc__
    )
    p.add_argument("--llm", action="store_true", required=True)
    p.add_argument("--address", default="127.0.0.1:8001")
    p.add_argument("--model", required=True)
    p.add_argument("--conversations", type=int, required=True)
    p.add_argument("--turns", type=int, default=4, help="1: the shared-prefix load")
    p.add_argument("--system-words", type=int, default=600, help="~1.3 tokens a word")
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--distinct-systems", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--think-time", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--api", choices=("triton", "openai"), default="triton")
    p.add_argument("--sessions", action="store_true", help="send session_id per conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path)
    a = p.parse_args(argv)
    if min(a.conversations, a.turns, a.max_tokens, a.concurrency, a.distinct_systems) < 1:
        p.error("--conversations, --turns, --max-tokens, --concurrency must be >= 1")
    load = ConversationLoad(
        a.address,
        a.model,
        a.conversations,
        a.turns,
        a.system_words,
        a.question_words,
        a.max_tokens,
        a.concurrency,
        a.think_time,
        a.timeout,
        a.api,
        a.sessions,
        a.distinct_systems,
        a.seed,
    )
    result = asyncio.run(run(load))
    print(json.dumps(result, indent=2))
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["errors"] else 1
