"""Accuracy of a quantized ONNX file against its fp32 parent, and latency of both.

Runs the exported graphs with onnxruntime (the runtime that serves them), on the held-out
sets in quantize/evalset/. Tokenizers are the ones the worker uses (tokenizer.json).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

EVALSET = Path(__file__).resolve().parent / "evalset"
PAD = 0


def session(path: Path, provider: str = "CPUExecutionProvider") -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=[provider])


def load_set(kind: str) -> dict:
    return json.loads((EVALSET / f"{kind}.json").read_text())  # type: ignore[no-any-return]


# ---- encoder -------------------------------------------------------------------------


def encode_batch(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encodings = tokenizer.encode_batch(texts)
    width = max(len(e.ids) for e in encodings)
    ids = np.full((len(texts), width), PAD, np.int64)
    mask = np.zeros((len(texts), width), np.int64)
    for i, e in enumerate(encodings):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
    return ids, mask


def embed(sess: ort.InferenceSession, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    ids, mask = encode_batch(tokenizer, texts)
    out = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    return np.asarray(out, dtype=np.float32)


def encoder_metrics(
    reference: np.ndarray, candidate: np.ndarray, triplets: list[list[int]]
) -> dict:
    """reference/candidate: unit embeddings of the same sentences; triplets: indices."""
    cos = np.sum(reference * candidate, axis=1) / (
        np.linalg.norm(reference, axis=1) * np.linalg.norm(candidate, axis=1)
    )

    def order(e: np.ndarray, a: int, p: int, n: int) -> bool:
        return bool(e[a] @ e[p] > e[a] @ e[n])

    kept = [order(reference, *t) == order(candidate, *t) for t in triplets]
    sim_r, sim_c = reference @ reference.T, candidate @ candidate.T
    np.fill_diagonal(sim_r, -np.inf)
    np.fill_diagonal(sim_c, -np.inf)
    neighbours = np.mean(sim_r.argmax(1) == sim_c.argmax(1))
    return {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "ranking_kept": float(np.mean(kept) * neighbours),
        "triplet_order_kept": float(np.mean(kept)),
        "nearest_neighbour_kept": float(neighbours),
    }


def evaluate_encoder(fp32: Path, candidate: Path, tokenizer: Tokenizer, provider: str) -> dict:
    data = load_set("encoder")
    sentences = data["sentences"]
    index = {s: i for i, s in enumerate(sentences)}
    triplets = [[index[s] for s in t] for t in data["triplets"]]
    reference = embed(session(fp32), tokenizer, sentences)
    quantized = embed(session(candidate, provider), tokenizer, sentences)
    return encoder_metrics(reference, quantized, triplets)


# ---- decoder -------------------------------------------------------------------------


def _empty_cache(sess: ort.InferenceSession, batch: int) -> np.ndarray:
    shape = sess.get_inputs()[2].shape  # [batch, layers, kv_heads, past, head_dim]
    return np.zeros((batch, shape[1], shape[2], 0, shape[4]), np.float32)


def forward(sess: ort.InferenceSession, ids: list[int]) -> np.ndarray:
    """Logits [seq, vocab] of one sequence, no cache."""
    x = np.array([ids], np.int64)
    cache = _empty_cache(sess, 1)
    feeds = {"input_ids": x, "attention_mask": np.ones_like(x), "past_keys": cache}
    feeds["past_values"] = cache
    return np.asarray(sess.run(["logits"], feeds)[0][0], dtype=np.float32)


def greedy(sess: ort.InferenceSession, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation with the KV cache."""
    keys = values = _empty_cache(sess, 1)
    ids = np.array([prompt], np.int64)
    mask = np.ones_like(ids)
    out: list[int] = []
    for _ in range(new_tokens):
        feeds = {"input_ids": ids, "attention_mask": mask, "past_keys": keys, "past_values": values}
        logits, keys, values = sess.run(None, feeds)
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        ids = np.array([[token]], np.int64)
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))  # type: ignore[no-any-return]


def decoder_metrics(
    reference: list[np.ndarray],
    candidate: list[np.ndarray],
    greedy_ref: list[list[int]],
    greedy_cand: list[list[int]],
) -> dict:
    """Per prompt: teacher-forced logits of both models, and both greedy continuations."""
    agree, kl = [], []
    for r, c in zip(reference, candidate, strict=True):
        lr, lc = log_softmax(r.astype(np.float64)), log_softmax(c.astype(np.float64))
        agree.append(r.argmax(-1) == c.argmax(-1))
        kl.append((np.exp(lr) * (lr - lc)).sum(-1))
    match = []
    for a, b in zip(greedy_ref, greedy_cand, strict=True):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        match.append(prefix / len(a))
    return {
        "top1_agreement": float(np.concatenate(agree).mean()),
        "kl_divergence": float(np.concatenate(kl).mean()),
        "greedy_match": float(np.mean(match)),
        "greedy_exact": float(np.mean([m == 1.0 for m in match])),
    }


def evaluate_decoder(
    fp32: Path,
    candidate: Path,
    tokenizer: Tokenizer,
    provider: str,
    progress: Callable[[], None] | None = None,
) -> dict:
    data = load_set("decoder")
    ref, cand = session(fp32), session(candidate, provider)
    logits_r, logits_c, greedy_r, greedy_c = [], [], [], []
    for prompt in data["prompts"]:
        ids = tokenizer.encode(prompt).ids
        cont = greedy(ref, ids, data["new_tokens"])
        greedy_r.append(cont)
        greedy_c.append(greedy(cand, ids, data["new_tokens"]))
        logits_r.append(forward(ref, ids + cont))
        logits_c.append(forward(cand, ids + cont))
        if progress:
            progress()
    return decoder_metrics(logits_r, logits_c, greedy_r, greedy_c)


# ---- latency -------------------------------------------------------------------------


def paired_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each callable, measured in alternation so that load from
    other processes on the machine falls on all of them alike."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: round(float(np.median(v)) * 1000, 3) for k, v in times.items()}


def encoder_feeds(batch: int, vocab: int, seq: int = 16) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(1, vocab, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def encoder_latency(
    paths: dict[str, Path], batch: int, vocab: int, repeats: int = 30
) -> dict[str, float]:
    """Median ms of one forward pass of `batch` 16-token sentences, per file."""
    feeds = encoder_feeds(batch, vocab)
    sessions = {k: session(p) for k, p in paths.items()}
    return paired_ms({k: _runner(s, feeds) for k, s in sessions.items()}, repeats)


def _runner(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    outputs = [sess.get_outputs()[0].name]
    return lambda: sess.run(outputs, feeds)


def decoder_feeds(sess: ort.InferenceSession, batch: int, vocab: int, seq: int, past: int) -> dict:
    shape = sess.get_inputs()[2].shape
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((batch, shape[1], shape[2], past, shape[4])).astype(np.float32)
    return {
        "input_ids": rng.integers(1, vocab, (batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "past_keys": cache,
        "past_values": cache,
    }


def decoder_latency(
    paths: dict[str, Path], batch: int, vocab: int, repeats: int = 10
) -> dict[str, dict]:
    """Per file: median ms of one decode step (one new token per row after 32 cached ones)
    and of a 32-token prefill."""
    sessions = {k: session(p) for k, p in paths.items()}
    step = paired_ms(
        {k: _runner(s, decoder_feeds(s, batch, vocab, 1, 32)) for k, s in sessions.items()}, repeats
    )
    prefill = paired_ms(
        {k: _runner(s, decoder_feeds(s, batch, vocab, 32, 0)) for k, s in sessions.items()},
        max(3, repeats // 3),
    )
    return {k: {"decode_step_ms": step[k], "prefill_32_ms": prefill[k]} for k in sessions}
