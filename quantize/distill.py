"""Distillation: a student with the teacher's architecture and fewer layers, trained here.

- The student keeps `K` of the teacher's layers, evenly spaced from the first to the last
  (MiniLM 6 -> 3 keeps 0, 2, 5; DistilBERT keeps every other one), and starts from their
  weights; the embeddings (and SmolLM2's tied LM head) are the teacher's and stay frozen,
  so the student learns only what the missing layers did.
- An encoder student matches the teacher's sentence embeddings (1 - cosine), and,
  with `intermediate_weight`, each kept layer's hidden state at every real token
  (1 - cosine: scale-free, so BERT's few large hidden dimensions do not dominate it);
  with `relation_weight`, the last layer's self-attention and value relations as MiniLM
  (Wang et al., 2020) distils them (`relations`).
- A decoder student matches the teacher's next-token distributions: KL(teacher || student)
  at temperature TEMPERATURE over every position, times T^2 (Hinton et al.).
- Training text, no download (`training_text`): sentences the SmolLM2 teacher writes
  about everyday topics, and with PROSE the prose sentences of Python's language reference
  and of the standard library's docstrings (`common.corpus`); any text that is, or holds,
  a sentence or prompt of quantize/evalset/ is dropped (held out). An encoder plan adds
  short word windows of each sentence (`word_windows`) and, with `augmented`, makes that
  share of every batch augmented sentences, drawn afresh each step (`augmented_at`:
  TinyBERT-style word replacement from the corpus, word dropout, splices of two
  sentences, shuffled spans); the teacher labels them on the fly, so the variety costs
  no generation time, and one that holds an evaluation sentence gives way to its source.
- The learning rate warms up over WARMUP steps, then falls (cosine) to LR_FLOOR of itself
  over `decay_steps`: the last steps average out the batch noise.
- Deterministic: a fixed seed, and step i's batch (augmented texts included) is drawn
  from (seed, i) alone, so a run resumed from its checkpoint (saved every SAVE_EVERY
  steps) continues the same sequence.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import structlog
import torch
from tokenizers import Tokenizer
from torch import nn

from common.corpus import python_reference, stdlib_docstrings
from quantize import evaluate
from quantize.models import (
    MASKED,
    BertEncoder,
    BertLayer,
    LlamaDecoder,
    bert_inputs,
    mean_pool,
)
from quantize.recipes import DECODER, ENCODER

log = structlog.get_logger(__name__)

SEED = 0
TEMPERATURE = 2.0
SAVE_EVERY = 25
WARMUP = 10
LR_FLOOR = 0.05  # of plan.lr, where the decay ends (and steps beyond decay_steps stay)
THREADS = 2

StepCallback = Callable[[int, int, float], None]  # (step done, total steps, loss)


@dataclass(frozen=True)
class Plan:
    """What a student is trained with; a checkpoint resumes only under the same plan."""

    kind: str
    layers: int
    steps: int
    batch: int
    lr: float
    max_tokens: int
    seed: int = SEED
    temperature: float = TEMPERATURE  # decoders
    intermediate_weight: float = 0.0  # encoders: weight of the per-token hidden-state loss
    windows: int = 0  # short word windows added per sentence (see word_windows)
    augmented: float = 0.0  # the share of each batch's rows that are augmented texts
    relation_weight: float = 0.0  # encoders: weight of the last layer's relation loss
    decay_steps: int = 0  # the learning rate falls (cosine) to LR_FLOOR over these; 0: never


# Measured (README, Distillation), the evaluation set's mean cosine to the teacher (torch,
# before int8), 1,200 steps with the cosine decay, 2 word windows of each sentence: on
# SmolLM2's 3,328 everyday sentences (held out) 4 layers reach 0.942 at lr 3e-4, 3 layers
# 0.895; with the prose sentences too (15,144 in all) 4 layers 0.924 and 3 layers 0.863
# (on the 2,498 sentences before, 400 constant-lr steps: 0.914 and 0.86). Half of each
# batch augmented (`augmented` 0.5): 0.943 at lr 3e-4, 0.9453 at 6e-4 (the default),
# 0.940 at 1.2e-3; with MiniLM's relations too (weight 1, lr 3e-4) 0.940 at step 900, as
# without them. All refused by the 0.95 bar. SmolLM2: 15 of 30 layers, 100 steps (~9 CPU
# minutes) reach top-1 0.19 and KL 3.7 (refused; far from converged).
DEFAULTS = {
    ENCODER: Plan(
        ENCODER,
        4,
        steps=1200,
        batch=32,
        lr=6e-4,
        max_tokens=32,
        intermediate_weight=1.0,
        windows=2,
        augmented=0.5,
        decay_steps=1200,
    ),
    DECODER: Plan(DECODER, 15, steps=100, batch=8, lr=1e-4, max_tokens=48),
}


def plan_for(kind: str, layers: int, steps: int | None = None) -> Plan:
    """The default plan with `layers` layers; `steps` steps, over which the learning rate
    decays (if the default plan decays)."""
    base = DEFAULTS[kind]
    if steps is None:
        return replace(base, layers=layers)
    return replace(base, layers=layers, steps=steps, decay_steps=steps if base.decay_steps else 0)


def learning_rate_scale(plan: Plan, step: int) -> float:
    """The learning rate of step `step` (from 0) over plan.lr: a linear warm-up over WARMUP
    steps, then a cosine fall to LR_FLOOR at plan.decay_steps (none when 0)."""
    warm = min(1.0, (step + 1) / WARMUP)
    if not plan.decay_steps:
        return warm
    done = min(1.0, step / plan.decay_steps)
    return warm * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * done)))


class DistillError(Exception):
    """A student that cannot be built as asked; the message says why and what would work."""


# ---- the student ---------------------------------------------------------------------


def kept_layers(teacher_layers: int, k: int) -> list[int]:
    """`k` of the teacher's layer indices, evenly spaced, first and last included."""
    if not 1 <= k < teacher_layers:
        raise DistillError(
            f"a student of {k} layers: expected 1..{teacher_layers - 1} layers, fewer than "
            f"the teacher's {teacher_layers}"
        )
    if k == 1:
        return [teacher_layers - 1]
    return sorted({round(i * (teacher_layers - 1) / (k - 1)) for i in range(k)})


def make_student(teacher: nn.Module, k: int) -> nn.Module:
    """The teacher's class with `k` layers, initialised from the kept layers' weights."""
    assert isinstance(teacher, BertEncoder | LlamaDecoder)
    kept = kept_layers(teacher.config.layers, k)
    student = type(teacher)(replace(teacher.config, layers=k))  # type: ignore[arg-type]
    state = {}
    for name, value in teacher.state_dict().items():
        if name.startswith("layers."):
            index, _, rest = name.removeprefix("layers.").partition(".")
            if int(index) in kept:
                state[f"layers.{kept.index(int(index))}.{rest}"] = value.clone()
        else:
            state[name] = value.clone()
    student.load_state_dict(state, strict=True)
    return student


def trainable(student: nn.Module) -> list[nn.Parameter]:
    """Everything but the embeddings (and the LM head tied to them), which stay the
    teacher's: 12M of MiniLM's 22M parameters, 28M of SmolLM2's 135M."""
    frozen = {"word.weight", "position.weight", "token_type.weight", "embed.weight"}
    frozen |= {"lm_head.weight"}
    return [p for n, p in student.named_parameters() if n not in frozen]


# ---- losses --------------------------------------------------------------------------


def encoder_states(
    model: BertEncoder, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The sentence embedding, every layer's hidden states (BertEncoder.forward's steps)
    and the last layer's input."""
    x, bias = bert_inputs(model, ids, mask)
    hidden = []
    last_input = x
    for layer in model.layers:
        last_input = x
        x = layer(x, bias)
        hidden.append(x)
    return mean_pool(x, mask), hidden, last_input


def relations(layer: BertLayer, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MiniLM's (Wang et al., 2020) self-attention relations of `layer` on its input `x`:
    log softmax(QK^T / sqrt d) and log softmax(VV^T / sqrt d) over the real keys, per head,
    stacked [2, batch, heads, seq, seq]."""
    b, s, _ = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, s, -1, layer.head_dim).transpose(1, 2)

    q, k, v = split(layer.q(x)), split(layer.k(x)), split(layer.v(x))
    bias = ((1.0 - mask.to(x.dtype)) * MASKED)[:, None, None, :]
    scale = layer.head_dim**0.5
    return torch.stack(
        [
            (q @ k.transpose(-1, -2) / scale + bias).log_softmax(-1),
            (v @ v.transpose(-1, -2) / scale + bias).log_softmax(-1),
        ]
    )


def encoder_loss(
    teacher: BertEncoder,
    student: BertEncoder,
    kept: list[int],
    ids: torch.Tensor,
    mask: torch.Tensor,
    intermediate_weight: float,
    relation_weight: float = 0.0,
) -> torch.Tensor:
    """1 - cosine of the sentence embeddings; with `intermediate_weight`, of each kept
    layer's hidden state at every real token; with `relation_weight`, KL(teacher ||
    student) of the last layer's `relations`, over the real query tokens."""
    with torch.no_grad():
        target, target_hidden, target_last = encoder_states(teacher, ids, mask)
    embedding, hidden, last = encoder_states(student, ids, mask)
    loss = (1.0 - (embedding * target).sum(-1)).mean()  # both unit length
    if relation_weight:
        with torch.no_grad():
            t = relations(teacher.layers[-1], target_last, mask)  # type: ignore[arg-type]
        r = relations(student.layers[-1], last, mask)  # type: ignore[arg-type]
        kl = (t.exp() * (t - r)).sum(-1)  # [2, batch, heads, seq]
        m = mask.to(kl.dtype)[None, :, None, :]
        loss = loss + relation_weight * (kl * m).sum() / (m.sum() * kl.shape[0] * kl.shape[2])
    if intermediate_weight:
        m = mask.to(embedding.dtype)
        per_layer = [
            ((1.0 - nn.functional.cosine_similarity(h, target_hidden[t], dim=-1)) * m).sum()
            / m.sum()
            for h, t in zip(hidden, kept, strict=True)
        ]
        loss = loss + intermediate_weight * torch.stack(per_layer).mean()
    return loss


def decoder_loss(
    teacher: LlamaDecoder,
    student: LlamaDecoder,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at `temperature`, times T^2,
    averaged over the real (unpadded) positions."""
    with torch.no_grad():
        target = teacher(ids, mask, *teacher.empty_cache(ids.shape[0]))[0]
    logits = student(ids, mask, *student.empty_cache(ids.shape[0]))[0]
    t = nn.functional.log_softmax(target / temperature, dim=-1)
    s = nn.functional.log_softmax(logits / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum() * temperature**2


# ---- training text -------------------------------------------------------------------

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
) -> list[str]:
    """The training sentences, built once into `path` (JSON) and reused: every sentence of
    `per_topic` answers per topic and template (default PER_TOPIC), and with PROSE (or
    when none is generated) Python's language reference and the standard library's
    docstrings; deduplicated, held out."""
    if path.exists():
        return list(json.loads(path.read_text())["texts"])
    torch.set_num_threads(THREADS)
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


# ---- training ------------------------------------------------------------------------


@dataclass
class Trained:
    student: nn.Module
    losses: list[float]  # per step, from step 1
    resumed_from: int  # 0 when trained from the start
    seconds: float  # the training time of all its steps, across resumes
    threads: int  # the torch threads its steps ran on (the last run that trained any)


def tokenize(tokenizer: Tokenizer, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Each text's own tokens (at most `max_tokens`), never padded: MiniLM's tokenizer.json
    pads every text to 128 tokens, and a student trained on [PAD] tokens counted as words
    (batch_at's mask covers every id it is given) learns sentences unlike the ones it
    serves (mean cosine 0.70 on the evaluation set, training loss 0.024)."""
    return encode(unpadded(tokenizer), texts, max_tokens)


def unpadded(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that neither pads nor truncates (the caller's is left as is)."""
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


def encode(plain: Tokenizer, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Each text's tokens by an `unpadded` tokenizer, at most `max_tokens`."""
    return [e.ids[:max_tokens] for e in plain.encode_batch(list(texts))]


def batch_at(
    rows: list[list[int]], plan: Plan, step: int, extra: Sequence[list[int]] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch (right-padded ids and mask), a function of (seed, step) alone:
    plan.batch rows, the `extra` rows (step `step`'s augmented texts) among them."""
    rng = np.random.default_rng([plan.seed, step])
    size = min(plan.batch - len(extra), len(rows))
    picks = rng.choice(len(rows), size=size, replace=False)
    chosen = [rows[i] for i in picks] + [r for r in extra if r]
    width = max(len(r) for r in chosen)
    ids = torch.zeros((len(chosen), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(chosen):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


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


def augmented_at(texts: Sequence[str], words: Sequence[str], plan: Plan, step: int) -> list[str]:
    """Step `step`'s augmented texts (plan.augmented of plan.batch rows), a function of
    (seed, step) alone: each a random one of AUGMENTATIONS applied to a random text of
    `texts`; one that is, or holds, an evaluation sentence or prompt gives way to its
    source text (held out already)."""
    rng = np.random.default_rng([plan.seed, step, 1])
    out, sources = [], []
    for _ in range(round(plan.batch * plan.augmented)):
        a, b = (int(i) for i in rng.integers(len(texts), size=2))
        how = AUGMENTATIONS[int(rng.integers(len(AUGMENTATIONS)))]
        out.append(augment(texts[a], texts[b], words, how, rng))
        sources.append(texts[a])
    kept = set(held_out(out))
    return [t if t in kept else s for t, s in zip(out, sources, strict=True)]


def digest(texts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def _save(path: Path, body: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(body, tmp)
    tmp.replace(path)


def train(
    teacher: nn.Module,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    plan: Plan,
    checkpoint: Path | None = None,
    on_step: StepCallback | None = None,
) -> Trained:
    """Train a `plan.layers`-layer student of `teacher` for `plan.steps` steps; with
    `checkpoint`, save there every SAVE_EVERY steps and resume from it (same plan and
    text; more steps than it holds continue it)."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(plan.seed)
    teacher.eval()
    student = make_student(teacher, plan.layers)
    kept = kept_layers(teacher.config.layers, plan.layers)  # type: ignore[union-attr, arg-type]
    optimizer = torch.optim.AdamW(trainable(student), lr=plan.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_scale(plan, step)
    )
    inputs = [*texts, *word_windows(texts, plan.windows, plan.seed)]
    rows = [r for r in tokenize(tokenizer, inputs, plan.max_tokens) if r]
    if not rows:
        raise DistillError("no training text: every sentence was empty after tokenizing")
    identity = {**asdict(plan), "steps": None, "text": digest(texts)}
    losses: list[float] = []
    start = 0
    seconds, threads = 0.0, THREADS
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["identity"] == identity and saved["step"] <= plan.steps:
            student.load_state_dict(saved["student"])
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            losses, start = list(saved["losses"]), int(saved["step"])
            seconds, threads = float(saved["seconds"]), int(saved["threads"])
            log.info("distill_resumed", checkpoint=str(checkpoint), step=start)
        else:
            log.info("distill_checkpoint_ignored", checkpoint=str(checkpoint), reason="other plan")
    student.train()
    began = time.perf_counter()
    if start < plan.steps:
        threads = THREADS
    words, plain = corpus_words(texts), unpadded(tokenizer)
    for step in range(start, plan.steps):
        extra = augmented_at(texts, words, plan, step) if plan.augmented else []
        ids, mask = batch_at(rows, plan, step, encode(plain, extra, plan.max_tokens))
        if plan.kind == ENCODER:
            loss = encoder_loss(
                teacher,  # type: ignore[arg-type]
                student,  # type: ignore[arg-type]
                kept,
                ids,
                mask,
                plan.intermediate_weight,
                plan.relation_weight,
            )
        else:
            loss = decoder_loss(teacher, student, ids, mask, plan.temperature)  # type: ignore[arg-type]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(trainable(student), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if checkpoint is not None and (done % SAVE_EVERY == 0 or done == plan.steps):
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            _save(
                checkpoint,
                {
                    "identity": identity,
                    "step": done,
                    "student": student.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(),
                    "losses": losses,
                    "seconds": seconds + time.perf_counter() - began,
                    "threads": threads,
                },
            )
        if on_step:
            on_step(done, plan.steps, losses[-1])
    return Trained(student.eval(), losses, start, seconds + time.perf_counter() - began, threads)


def evaluation_loss(
    teacher: nn.Module, student: nn.Module, tokenizer: Tokenizer, texts: Sequence[str], plan: Plan
) -> float:
    """The training loss over `texts` in one batch, without gradients (to compare students)."""
    kept = kept_layers(teacher.config.layers, plan.layers)  # type: ignore[union-attr, arg-type]
    rows = [r for r in tokenize(tokenizer, texts, plan.max_tokens) if r]
    whole = replace(plan, batch=len(rows))
    ids, mask = batch_at(rows, whole, 0)
    with torch.no_grad():
        if plan.kind == ENCODER:
            return float(
                encoder_loss(
                    teacher,  # type: ignore[arg-type]
                    student,  # type: ignore[arg-type]
                    kept,
                    ids,
                    mask,
                    plan.intermediate_weight,
                    plan.relation_weight,
                )
            )
        return float(decoder_loss(teacher, student, ids, mask, plan.temperature))  # type: ignore[arg-type]
