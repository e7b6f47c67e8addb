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
- Training text (quantize/distill_text.py, no download): sentences the SmolLM2 teacher
  writes, held out from quantize/evalset/; an encoder plan adds short word windows of each
  sentence (`windows`) and makes `augmented` of every batch augmented sentences drawn
  afresh each step, which the teacher labels on the fly.
- The learning rate warms up over WARMUP steps, then falls (cosine) to LR_FLOOR of itself
  over `decay_steps`: the last steps average out the batch noise.
- Deterministic: a fixed seed, and step i's batch (augmented texts included) is drawn
  from (seed, i) alone, so a run resumed from its checkpoint (saved every SAVE_EVERY
  steps) continues the same sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import structlog
import torch
from tokenizers import Tokenizer
from torch import nn

from quantize.distill_loss import decoder_loss, encoder_loss
from quantize.distill_text import SEED, augmented_at, corpus_words, digest, word_windows
from quantize.models import BertEncoder, LlamaDecoder
from quantize.recipes import DECODER, ENCODER

log = structlog.get_logger(__name__)

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
# before int8), 1,200 steps with the cosine decay unless said, 2 word windows of each
# sentence: on SmolLM2's 3,328 everyday sentences (held out) 4 layers reach 0.942 at lr
# 3e-4, 3 layers 0.895; with the prose sentences too (15,144 in all) 4 layers 0.924 and 3
# layers 0.863 (on the 2,498 sentences before, 400 constant-lr steps: 0.914 and 0.86). Half
# of each batch augmented (`augmented` 0.5): 0.943 at lr 3e-4, 0.9453 at 6e-4, 0.940 at
# 1.2e-3; with MiniLM's relations too (weight 1, lr 3e-4) 0.940 at step 900, as without
# them. All refused by the 0.95 bar. Longer, augmented at lr 6e-4: 2,400 steps 0.9527
# (int8 0.9479, refused), 4,800 steps 0.9572 (int8 0.9515, both accepted): the default.
# SmolLM2: 15 of 30 layers, 100 steps (~9 CPU minutes) reach top-1 0.19 and KL 3.7
# (refused; far from converged).
DEFAULTS = {
    ENCODER: Plan(
        ENCODER,
        4,
        steps=4800,
        batch=32,
        lr=6e-4,
        max_tokens=32,
        intermediate_weight=1.0,
        windows=2,
        augmented=0.5,
        decay_steps=4800,
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


# ---- the loss a plan trains with (the losses: quantize/distill_loss.py) --------------


def plan_loss(
    teacher: nn.Module,
    student: nn.Module,
    kept: list[int],
    ids: torch.Tensor,
    mask: torch.Tensor,
    plan: Plan,
) -> torch.Tensor:
    """The loss `plan` trains with on one batch: encoder_loss or decoder_loss by its kind."""
    if plan.kind == ENCODER:
        return encoder_loss(
            teacher,  # type: ignore[arg-type]
            student,  # type: ignore[arg-type]
            kept,
            ids,
            mask,
            plan.intermediate_weight,
            plan.relation_weight,
        )
    return decoder_loss(teacher, student, ids, mask, plan.temperature)  # type: ignore[arg-type]


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
    augmented = round(plan.batch * plan.augmented)  # rows per batch
    words, plain = (corpus_words(texts) if augmented else []), unpadded(tokenizer)
    for step in range(start, plan.steps):
        extra = augmented_at(texts, words, augmented, plan.seed, step) if augmented else []
        ids, mask = batch_at(rows, plan, step, encode(plain, extra, plan.max_tokens))
        loss = plan_loss(teacher, student, kept, ids, mask, plan)
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
        return float(plan_loss(teacher, student, kept, ids, mask, plan))
