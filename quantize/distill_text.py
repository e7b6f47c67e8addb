"""Distillation's training text, no download (quantize/distill.py trains on it).

- Sentences the SmolLM2 teacher writes about everyday topics (`teacher_sentences`:
  statements, questions, captions, headlines, speech and stories, sampled at three
  temperatures), and with PROSE the prose sentences of Python's language reference and
  of the standard library's docstrings (`common.corpus`); built once into a JSON cache
  named by `text_recipe` (`training_text`).
- Held out: any text that is, or holds, a sentence or prompt of quantize/evalset/
  (`held_out`), here and for every augmented text.
- An encoder plan adds short word windows of each sentence (`word_windows`) and
  augmented texts drawn afresh each step (`augmented_at`: TinyBERT-style word replacement
  from the corpus, word dropout, splices of two sentences, shuffled spans); the teacher
  labels them on the fly, so the variety costs no generation time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from common.corpus import python_reference, stdlib_docstrings
from quantize import evaluate
from quantize.models import LlamaDecoder
from quantize.recipes import DECODER, ENCODER

SEED = 0  # generation here; quantize/distill.py's plans default to it too

TOPICS = (
    "food", "cooking", "sports", "music", "the weather", "animals", "pets", "travel",
    "the stock market", "banking", "computers", "passwords", "phones", "movies", "books",
    "a library", "school", "science", "space", "the ocean", "a city", "a village", "cars",
    "bicycles", "trains", "health", "running", "a hospital", "gardening", "a family",
    "friendship", "work", "shopping", "clothes", "art", "history", "a holiday", "rain",
    "winter", "a birthday", "coffee", "a restaurant", "the news", "politics", "a museum",
    "a river", "mountains", "a farm", "a dog", "a cat", "horses", "a guitar", "a kitchen",
    "the beach", "an airport", "a doctor", "a teacher", "a wedding", "a storm", "football",
    "an election", "the internet", "an app", "a job interview", "a hotel", "a concert",
    "a painting", "a forest", "a police officer", "a baby", "a video game", "an exam",
    "a factory", "electricity", "dancing", "children", "an old man", "a young woman",
    "a bus", "a park", "a street market", "a supermarket", "bread", "fruit", "vegetables",
    "tea", "breakfast", "dinner", "a picnic", "a bakery", "fishing", "swimming", "tennis",
    "basketball", "a marathon", "yoga", "a gym", "a camera", "photography", "a newspaper",
    "a letter", "an email", "a phone call", "a meeting", "an office", "a boss", "money",
    "taxes", "a loan", "a house", "an apartment", "furniture", "cleaning", "laundry",
    "a neighbour", "a road", "traffic", "a bridge", "a boat", "a plane", "a train station",
    "a map", "a camping trip", "a lake", "a desert", "snow", "summer", "autumn", "spring",
    "the sun", "the moon", "stars", "a bird", "a fish", "a monkey", "an elephant",
    "a lion", "insects", "flowers", "trees", "a garden", "a zoo", "a circus", "a theatre",
    "a film star", "a singer", "a band", "a piano", "drums", "a violin", "a poem",
    "a novel", "a university", "a student", "homework", "mathematics", "chemistry",
    "a laboratory", "medicine", "a dentist", "sleep", "a dream", "a party", "a gift",
    "a game of chess", "a toy", "a robot", "a smartphone", "a laptop", "social media",
    "a website", "a password reset", "a bank account", "a credit card", "a price",
    "a sale", "a company", "a startup", "a factory worker", "a farmer", "a chef",
    "a pilot", "a nurse", "a firefighter", "a soldier", "a judge", "a court", "a law",
    "a government", "a president", "a protest", "a church", "a festival", "a parade",
    "a pizza", "pasta", "a sandwich", "ice cream", "chocolate", "a cake", "wine",
    "a car accident", "an earthquake", "a flood", "a fire", "climate change", "pollution",
    "recycling", "energy", "oil prices", "a bicycle race", "a horse race", "the Olympics",
)  # fmt: skip
# What each prompt asks for, several sentences an answer: statements, questions, scenes,
# captions, headlines, speech and stories, so the student sees the sentence shapes a
# search index embeds, not one template's. SmolLM2 answers a few of these per second on
# two cores, so every sentence of an answer counts.
TEMPLATES = (
    "Write five short, simple sentences about {topic}, one per line.",
    "Write five questions someone might ask about {topic}, one per line.",
    "Write five one-sentence captions for photos of people or animals and {topic}, one per line.",
    "Write four one-sentence news headlines about {topic}, one per line.",
    "Write five things a friend might say about {topic}, one per line.",
    "Tell a short story about {topic} in five simple sentences.",
    "Write one long, detailed sentence about {topic}.",
)
SAMPLE_TEMPERATURES = (0.7, 1.0, 1.3)  # prompt i samples at the (i mod 3)-th (top-k 50)
PER_TOPIC = 1  # answers per topic and template: 1,491 prompts
NEW_TOKENS = 64
# Add the prose sentences of Python's reference and of the stdlib's docstrings? Measured
# (README, Distillation): with them (71% of the text) the 4-layer MiniLM student reached
# 0.924 in 1,200 steps, on SmolLM2's everyday sentences alone 0.94: technical prose pulls
# the student away from the sentences an index embeds. Used when nothing is generated.
PROSE = False
GENERATION_PROMPT = "<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n"
_LIST_MARK = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s*")


def text_recipe() -> str:
    """A digest of what `training_text` builds, naming its cache file: a change of prompts,
    topics or sources is a new file, never a stale one read as the new recipe."""
    parts = [*TOPICS, *TEMPLATES, str(SAMPLE_TEMPERATURES), str(NEW_TOKENS), f"prose={PROSE}"]
    return digest(parts)[:8]


def prose_sentences(text: str, min_words: int = 5, max_words: int = 40) -> list[str]:
    """The prose sentences of `text` (no code, no tables): mostly letters and spaces."""
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", re.sub(r"\s+", " ", text)):
        letters = sum(c.isalpha() or c == " " for c in s)
        if min_words <= len(s.split()) <= max_words and letters > 0.9 * len(s):
            out.append(s)
    return out


def reference_sentences() -> list[str]:
    """Prose sentences of Python's language reference."""
    return prose_sentences(python_reference())


def docstring_sentences() -> list[str]:
    """Prose sentences of the standard library's docstrings (`common.corpus`)."""
    return prose_sentences(stdlib_docstrings())


def answer_sentences(text: str) -> list[str]:
    """Every whole sentence of a generated answer: list marks and quotes stripped; an
    unfinished last sentence (the token budget ran out) dropped."""
    out = []
    for line in text.split("\n"):
        line = _LIST_MARK.sub("", line).strip()
        for sentence in re.split(r"(?<=[.!?])\s+", line):
            sentence = sentence.replace("*", "").replace('"', "").strip()
            if len(sentence.split()) >= 3 and sentence[-1:] in ".!?":
                out.append(sentence)
    return out


@torch.no_grad()
def teacher_sentences(
    generator: LlamaDecoder,
    tokenizer: Tokenizer,
    per_topic: int,
    new_tokens: int = NEW_TOKENS,
    seed: int = SEED,
    progress: Callable[[], None] | None = None,
) -> list[str]:
    """`per_topic` answers for each (template, topic), sampled with top-k 50 at the
    SAMPLE_TEMPERATURES in turn; every whole sentence of each answer. All prompts go in
    batches of 64 rows, left-padded (the decoder takes positions from the mask)."""
    g = torch.Generator().manual_seed(seed)
    requests = [
        GENERATION_PROMPT.format(request=t.format(topic=topic))
        for t in TEMPLATES
        for topic in TOPICS
        for _ in range(per_topic)
    ]
    temperatures = [SAMPLE_TEMPERATURES[i % len(SAMPLE_TEMPERATURES)] for i in range(len(requests))]
    out = []
    for first in range(0, len(requests), 64):
        chunk = [tokenizer.encode(r).ids for r in requests[first : first + 64]]
        temps = torch.tensor(temperatures[first : first + 64])[:, None]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        keys, values = generator.empty_cache(len(chunk))
        rows: list[list[int]] = [[] for _ in chunk]
        for _ in range(new_tokens):
            logits, keys, values = generator(ids, mask, keys, values)
            top, index = (logits[:, -1] / temps).topk(50, dim=-1)
            ids = index.gather(-1, torch.multinomial(top.softmax(-1), 1, generator=g))
            mask = torch.cat((mask, torch.ones_like(ids)), dim=1)
            for row, token in zip(rows, ids[:, 0].tolist(), strict=True):
                row.append(token)
        for row in rows:
            out += answer_sentences(tokenizer.decode(row, skip_special_tokens=True))
        if progress:
            progress()
    return out


def _normal(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


@functools.cache
def _evaluation_texts() -> tuple[str, ...]:
    evalset = [_normal(s) for s in evaluate.load_set(ENCODER)["sentences"]]
    evalset += [_normal(p) for p in evaluate.load_set(DECODER)["prompts"]]
    return tuple(e for e in evalset if e)


def held_out(texts: Sequence[str]) -> list[str]:
    """`texts` less any that is, or contains, an evaluation sentence or prompt."""
    evalset = _evaluation_texts()
    normal = [_normal(t) for t in texts]
    return [t for t, n in zip(texts, normal, strict=True) if not any(e in n for e in evalset)]


def training_text(
    path: Path,
    generator: Callable[[], tuple[LlamaDecoder, Tokenizer]],
    per_topic: int | None = None,
    progress: Callable[[], None] | None = None,
    threads: int = 2,
) -> list[str]:
    """The training sentences, built once into `path` (JSON) and reused: every sentence of
    `per_topic` answers per topic and template (default PER_TOPIC), and with PROSE (or
    when none is generated) Python's language reference and the standard library's
    docstrings; deduplicated, held out."""
    if path.exists():
        return list(json.loads(path.read_text())["texts"])
    torch.set_num_threads(threads)
    count = PER_TOPIC if per_topic is None else per_topic
    generated: list[str] = []
    if count:
        model, tokenizer = generator()
        generated = teacher_sentences(model, tokenizer, count, progress=progress)
    prose = PROSE or not generated
    reference = reference_sentences() if prose else []
    docstrings = docstring_sentences() if prose else []
    texts = held_out(list(dict.fromkeys(generated + reference + docstrings)))
    body = {
        "about": "Distillation training text: sentences SmolLM2 wrote about everyday topics "
        "(statements, questions, captions, headlines, speech, stories), and (PROSE) prose "
        "sentences of Python's language reference (pydoc_data) and of the standard "
        "library's docstrings. Held out: anything that is or contains a sentence or prompt "
        "of quantize/evalset/.",
        "recipe": text_recipe(),
        "generated": len(generated),
        "reference": len(reference),
        "docstrings": len(docstrings),
        "texts": texts,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
    return texts


def word_windows(texts: Sequence[str], per_text: int, seed: int) -> list[str]:
    """`per_text` random runs of 3 to 8 consecutive words of each text of 6 words or more:
    short inputs like the sentences an index embeds ("A man is eating food."), drawn
    from the same text at no cost. Any input is a training example, since the target is
    the teacher's own output on it."""
    rng = np.random.default_rng([seed, len(texts)])
    out = []
    for text in texts:
        words = text.split()
        if len(words) < 6:
            continue
        for _ in range(per_text):
            n = int(rng.integers(3, min(8, len(words) - 1) + 1))
            first = int(rng.integers(0, len(words) - n + 1))
            out.append(" ".join(words[first : first + n]))
    return out


AUGMENT_RATE = 0.2  # of the words a replacement or a dropout touches
AUGMENTATIONS = ("replace", "drop", "splice", "shuffle")


def corpus_words(texts: Sequence[str]) -> list[str]:
    """Every word of `texts`, in order, repeats kept: a uniform pick is a pick by frequency."""
    return [w for t in texts for w in t.split()]


def augment(text: str, other: str, words: Sequence[str], how: str, rng: np.random.Generator) -> str:
    """One augmented copy of `text` (TinyBERT-style, with corpus words instead of BERT's
    guesses): `replace` swaps about AUGMENT_RATE of its words, at least one, for words
    drawn from `words`; `drop` leaves out about AUGMENT_RATE of them, at least one, keeping
    two or more; `splice` joins its start to the end of `other`; `shuffle` reorders a run
    of 2 to 5 of its words (never back into their order). The teacher labels whatever comes out."""
    w = text.split()
    if how == "replace":
        hit = rng.random(len(w)) < AUGMENT_RATE
        hit[rng.integers(len(w))] = True
        return " ".join(
            words[int(rng.integers(len(words)))] if h else x for x, h in zip(w, hit, strict=True)
        )
    if how == "drop":
        if len(w) <= 2:
            return text
        keep = rng.random(len(w)) >= AUGMENT_RATE
        keep[rng.integers(len(w))] = False
        if keep.sum() < 2:
            keep[rng.choice(len(w), size=2, replace=False)] = True
        return " ".join(x for x, k in zip(w, keep, strict=True) if k)
    if how == "splice":
        o = other.split()
        if len(w) < 2 or len(o) < 2:
            return f"{text} {other}"
        return " ".join(w[: int(rng.integers(1, len(w)))] + o[int(rng.integers(1, len(o))) :])
    if how == "shuffle":
        if len(w) < 2:
            return text
        n = int(rng.integers(2, min(5, len(w)) + 1))
        first = int(rng.integers(0, len(w) - n + 1))
        span = w[first : first + n]
        order = rng.permutation(n)
        if (order == np.arange(n)).all():
            order = order[::-1]  # never the span as it was
        return " ".join(w[:first] + [span[i] for i in order] + w[first + n :])
    raise ValueError(f"augmentation {how!r}: expected one of {AUGMENTATIONS}")


def augmented_at(
    texts: Sequence[str], words: Sequence[str], count: int, seed: int, step: int
) -> list[str]:
    """Step `step`'s `count` augmented texts, a function of (seed, step) alone: each a
    random one of AUGMENTATIONS applied to a random text of `texts`; one that is, or holds,
    an evaluation sentence or prompt gives way to its source text (held out already)."""
    rng = np.random.default_rng([seed, step, 1])
    out, sources = [], []
    for _ in range(count):
        a, b = (int(i) for i in rng.integers(len(texts), size=2))
        how = AUGMENTATIONS[int(rng.integers(len(AUGMENTATIONS)))]
        out.append(augment(texts[a], texts[b], words, how, rng))
        sources.append(texts[a])
    kept = set(held_out(out))
    return [t if t in kept else s for t, s in zip(out, sources, strict=True)]


def digest(texts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
