"""The engine's step over a shard group: the same Engine, one step at a time on every rank.

Rank 0 (the leader) runs the unchanged Engine with a `TPStepModel` as its model. Each
`run(cache, ids, lengths, lo, hi)` checks the token ids, then broadcasts the step as one
int64 array (the cache shape, lo/hi, the cache moves since the last step, lengths, ids) and
every rank runs its segments of the step graph (quantize/llm_shard.py): its query and KV
heads, its own KV cache — the same slots, only its KV heads — written in place by the
attention op, an all-reduce after each attention and each MLP, and a gather of the
vocab-parallel logits on the leader, which samples.

A rank whose segment raises does not leave the group: it keeps every collective of the
step (sending zeros) and marks its logits shard failed (one extra column, 1.0), so all ranks
stay in lockstep and the leader raises `StepFailed` for that step only — the engine then
fails the sequences in it, and the next step runs as usual. Only a failed collective (a rank
died or hung) fails the group (worker/tp/leader.py).

The leader's cache is the engine's own; every other rank allocates its cache from the first
step's shape and replays the leader's cache moves before the step runs (KVCache.on_change:
the prefix cache's copies of reused rows and its discards of freed or evicted ones), each
rank on its own KV heads: the same prefix cache works in a group.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Protocol

import numpy as np
import onnxruntime as ort
import structlog

from common.shard_format import HIDDEN, HIDDEN_OUT, OP_STEP, PARTIAL, REDUCED
from common.shard_format import LOGITS_SHARD as SHARD
from common.step_graph import IDS, SEQLENS, TOTAL
from worker.llm.cache import HOST, CacheShape, KVCache
from worker.llm.model import GraphFacts, run_options
from worker.runtime import OnnxSession, RuntimeOptions
from worker.tp.parallel import TpGroup
from worker.tp.runtime import ShardSet, Timing

log = structlog.get_logger()

ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"
_HEAD = 8  # slots, max_len, lo, hi, rows, new, cache moves, budget
_OP = 5  # a cache move: (op, a, b, start, stop), worker/llm/cache.py's on_change


class StepFailed(RuntimeError):
    """A rank could not compute this step; the group is fine."""


def pack(
    shape: CacheShape,
    lo: int,
    hi: int,
    ids: np.ndarray,
    lengths: np.ndarray,
    ops: list[tuple[int, int, int, int, int]],
) -> np.ndarray:
    rows, new = ids.shape
    head = [shape.slots, shape.max_len, lo, hi, rows, new, len(ops), 0]
    moves = [x for op in ops for x in op]
    return np.concatenate(
        [np.asarray(head + moves, np.int64), lengths.astype(np.int64), ids.reshape(-1)]
    )


@dataclasses.dataclass(frozen=True)
class Step:
    slots: int
    max_len: int
    lo: int
    hi: int
    ids: np.ndarray
    lengths: np.ndarray
    ops: list[tuple[int, int, int, int, int]]


def unpack(batch: np.ndarray) -> Step:
    slots, max_len, lo, hi, rows, new, n, _ = (int(x) for x in batch[:_HEAD])
    at = _HEAD + n * _OP
    flat = [int(x) for x in batch[_HEAD:at]]
    ops = [
        (flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4])
        for i in range(0, len(flat), _OP)
    ]
    lengths = batch[at : at + rows]
    ids = batch[at + rows : at + rows + rows * new].reshape(rows, new)
    if hi - lo != rows or ids.size != rows * new:
        raise ValueError(f"malformed step: slots {lo}..{hi} for {rows} rows, {ids.size} ids")
    return Step(slots, max_len, lo, hi, ids, lengths, ops)


class RankSteps:
    """One rank's segments of the step graph and (on ranks > 0) its KV cache."""

    def __init__(
        self, shards: ShardSet, rank: int, options: RuntimeOptions, providers: list[str]
    ) -> None:
        m = shards.manifest
        files = shards.verify(rank)
        options = dataclasses.replace(options, allow_spinning=False)
        self.shards = shards
        self.rank = rank
        self.tp = shards.tp
        self.segments = [(s["name"], s["inputs"], s["outputs"]) for s in m["segments"]]
        self.sessions = {
            name: OnnxSession(files[name], options, providers) for name, _, _ in self.segments
        }
        with np.load(files["rope"]) as rope:  # RoPE tables, bound to every attention segment
            self._bound = {
                ROPE_COS: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rope["cos"])),
                ROPE_SIN: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rope["sin"])),
            }
        self.provider = self.sessions["first"].provider
        self.weight_bytes = int(m["ranks"][rank]["weight_bytes"])
        c = m["config"]
        self.hidden = int(c["hidden"])
        self.facts = GraphFacts(  # this rank's share: its heads and KV heads
            layers=int(c["layers"]),
            heads=int(c["heads"]) // self.tp,
            kv_heads=int(c["kv_heads"]) // self.tp,
            head_dim=int(c["hidden"]) // int(c["heads"]),
            vocab_size=int(c["vocab_size"]),
            max_positions=int(m["max_positions"]),
        )
        self.shard_width = int(m["vocab_padded"]) // self.tp
        self.cache: KVCache | None = None
        self.owns_cache = True
        self.timing = Timing()
        self.steps = 0
        self.failures = 0

    def attach(self, cache: KVCache) -> None:
        """The leader: run steps over the engine's cache instead of one of its own."""
        if self.cache is not cache:
            self.cache = cache
            self.owns_cache = False

    def _cache_for(self, step: Step) -> KVCache:
        c = self.cache
        shape = c.shape if c is not None else None
        if shape is None or (shape.slots, shape.max_len) != (step.slots, step.max_len):
            if not self.owns_cache:
                raise ValueError(
                    f"the step's cache {step.slots}x{step.max_len} is not the leader's"
                )
            if c is not None:
                c.close()
            f = self.facts
            dims = CacheShape(f.layers, f.kv_heads, f.head_dim, step.slots, step.max_len)
            self.cache = c = KVCache(dims)
            log.info("tp_cache_allocated", rank=self.rank, slots=step.slots, max_len=step.max_len)
        assert c is not None
        if self.owns_cache:
            for op in step.ops:
                c.apply(op)
        return c

    def step(self, group: TpGroup, batch: np.ndarray) -> np.ndarray | None:
        """Run one step on this rank. On rank 0: the logits [rows, vocab]; StepFailed when a
        rank (this one or another) failed the step. Other ranks return None."""
        step = unpack(batch)  # a malformed batch is a bug in the leader: fail the group
        self.steps += 1
        shard, error = self._forward(group, step)
        flag = np.full((shard.shape[0], 1), 0.0 if error is None else 1.0, np.float32)
        t1 = time.perf_counter_ns()
        parts = group.gather(np.concatenate([shard, flag], axis=1))
        self.timing.comm_ns += time.perf_counter_ns() - t1
        if error is not None:
            self.failures += 1
        if parts is None:
            return None
        failed = [r for r, p in enumerate(parts) if p[0, -1] != 0.0]
        if failed:
            detail = f" ({error})" if error is not None else ""
            raise StepFailed(f"TP rank(s) {failed} failed this step{detail}")
        logits = np.concatenate([p[:, :-1] for p in parts], axis=1)
        return logits[:, : self.facts.vocab_size]

    def _forward(self, group: TpGroup, step: Step) -> tuple[np.ndarray, str | None]:
        """Every segment with its collectives: this rank's logits shard, and what went wrong
        here (then the shard is zeros, and every collective was still made)."""
        rows, new = step.ids.shape
        error: str | None = None
        env: dict[str, np.ndarray] = {
            IDS: step.ids,
            SEQLENS: (step.lengths - 1).astype(np.int32),
            TOTAL: np.array(int(step.lengths.max()), np.int32),
        }
        views: list = []
        shard = np.zeros((rows, self.shard_width), np.float32)
        for index, (name, inputs, outputs) in enumerate(self.segments):
            results: dict[str, np.ndarray] | None = None
            if error is None:
                t0 = time.perf_counter_ns()
                try:
                    if index == 0:
                        views = self._cache_for(step).views(step.lo, step.hi)
                    results = self.run_segment(name, inputs, outputs, env, views, new)
                except Exception as e:  # this step fails; the group keeps its lockstep
                    error = f"{type(e).__name__}: {e}"  # no traceback kept (it holds the cache)
                    log.exception("tp_step_failed", rank=self.rank, segment=name)
                self.timing.compute_ns += time.perf_counter_ns() - t0
            if results is None:
                zeros = np.zeros((rows, new, self.hidden), np.float32)
                results = {o: zeros for o in outputs if o in (HIDDEN, HIDDEN_OUT, PARTIAL)}
            t1 = time.perf_counter_ns()
            for out, array in results.items():
                if out == PARTIAL:
                    env[REDUCED] = group.all_reduce(array)
                elif out == HIDDEN_OUT:
                    env[HIDDEN] = array
                elif out == SHARD:
                    shard = array
                else:
                    env[out] = array
            self.timing.comm_ns += time.perf_counter_ns() - t1
        return shard, error

    def run_segment(
        self,
        name: str,
        inputs: list[str],
        outputs: list[str],
        env: dict[str, np.ndarray],
        views: list,
        new: int,
    ) -> dict[str, np.ndarray]:
        """One segment, its cache inputs and outputs bound to the cache (in place); a run of
        `new` >= SHRINK_TOKENS tokens hands its step buffers back when it ends, as on one
        process (worker/llm/model.py)."""
        sess = self.sessions[name].session
        io = sess.io_binding()
        for n in inputs:
            if n.startswith("past_"):
                kind, layer = n[len("past_") :].split(".")
                io.bind_ortvalue_input(n, views[int(layer)][kind == "value"])
            elif n in self._bound:
                io.bind_ortvalue_input(n, self._bound[n])
            else:
                io.bind_cpu_input(n, np.ascontiguousarray(env[n]))
        plain = [n for n in outputs if not n.startswith("present_")]
        for n in plain:
            io.bind_output(n)
        for n in outputs:
            if n.startswith("present_"):
                kind, layer = n[len("present_") :].split(".")
                io.bind_ortvalue_output(n, views[int(layer)][kind == "value"])
        sess.run_with_iobinding(io, run_options(new))
        values = io.get_outputs()
        return {n: values[i].numpy() for i, n in enumerate(plain)}

    def close(self) -> None:
        if self.cache is not None and self.owns_cache:
            self.cache.close()
        self.cache = None


class Caller(Protocol):
    """What runs one operation over the group (worker/tp/leader.py's Leader)."""

    def call(self, index: int, op: int, arg: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError


class TPStepModel:
    """The Engine's model on the leader: StepModel's `run` and `facts`, over a shard group.

    `facts` are this rank's: kv_heads is the KV heads each rank caches, so the engine's cache
    (and its KV budget in bytes) is per rank."""

    def __init__(self, rank: RankSteps, leader: Caller, index: int) -> None:
        assert rank.rank == 0, "the engine runs on rank 0"
        self.rank = rank
        self.leader = leader
        self.index = index
        self.facts = rank.facts
        self.cache_device = HOST  # the ranks' caches: host memory, one per rank
        self.session = rank.sessions["first"]
        self._ops: deque[tuple[int, int, int, int, int]] = deque()
        self._cache: KVCache | None = None
        self._lock = threading.Lock()

    def run(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        vocab = self.facts.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if ids.shape[0] != hi - lo or lengths.shape != (hi - lo,):
            raise ValueError(f"{ids.shape[0]} rows of ids for slots {lo}..{hi}")
        if lengths.min() < ids.shape[1] or lengths.max() > cache.shape.max_len:
            raise ValueError(f"lengths {lengths.tolist()} outside [new, {cache.shape.max_len}]")
        with self._lock:
            if self._cache is not cache:
                self._cache = cache
                cache.on_change = self._ops.append
                self.rank.attach(cache)
            ops = [self._ops.popleft() for _ in range(len(self._ops))]
        batch = pack(cache.shape, lo, hi, ids, lengths, ops)
        (logits,) = self.leader.call(self.index, OP_STEP, 0, [batch])
        return logits
