"""The step graph (quantize/llm_graph.py) in onnxruntime, bound to the KV cache.

`run` takes the new tokens of some rows, each row's length after them, and the cache slots
the rows live in (contiguous, lo..hi-1); it returns the last position's logits per row.
`run_positions` returns the logits of every new position (a speculative verify run): only a
graph built with the `num_logits` input (quantize/llm_graph.py's all_positions) has them.
The cache is bound as both the past and the present of every layer (IO binding), so
onnxruntime writes the new keys and values straight into it.

A run of SHRINK_TOKENS new tokens or more (a prefill chunk) hands its step buffers back to
the OS when it ends (onnxruntime's arena shrinkage). Its attention scores alone are rows x
heads x new x max_len floats (a 400-token chunk: 29 MB), which the arena would otherwise
keep for the process's life: the worker's RSS after one 400-word prompt is 366 instead of
401 MB. A decode run's buffers stay in the arena for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import numpy as np
import onnxruntime as ort
import structlog

from common.step_graph import (
    IDS,
    LOGITS,
    META,
    NUM_LOGITS,
    SEQLENS,
    TOP_IDS,
    TOP_VALUES,
    TOTAL,
    past_names,
    present_names,
)
from worker.llm.cache import HOST, CacheShape, CacheView, KVCache
from worker.llm.device import CUDA, DeviceView
from worker.runtime import CUDA as CUDA_PROVIDER
from worker.runtime import OnnxSession, RuntimeOptions

log = structlog.get_logger()

SHRINK_TOKENS = 128
_SHRINK = ort.RunOptions()
_SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


# On a session that may replay CUDA graphs, every run names its graph; -1: none
_NO_GRAPH = ort.RunOptions()
_NO_GRAPH.add_run_config_entry("gpu_graph_id", "-1")
_SHRINK_NO_GRAPH = ort.RunOptions()
_SHRINK_NO_GRAPH.add_run_config_entry("gpu_graph_id", "-1")
_SHRINK_NO_GRAPH.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
# CUDA graphs one model captures at most (one per row range a decode step runs over)
MAX_GRAPHS = 64


def run_options(new_tokens: int, cuda_graph: bool = False) -> ort.RunOptions | None:
    """A run's options: a long chunk's step buffers go back to the OS when it ends; on a
    session with CUDA graphs (`cuda_graph`), the run is launched kernel by kernel."""
    if cuda_graph:
        return _SHRINK_NO_GRAPH if new_tokens >= SHRINK_TOKENS else _NO_GRAPH
    return _SHRINK if new_tokens >= SHRINK_TOKENS else None


@dataclass(frozen=True)
class GraphFacts:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int  # the model's context length: its RoPE table
    kv_dtype: str = "float32"  # the KV cache's element type (worker/llm/cache.py)

    def cache_shape(self, slots: int, max_len: int) -> CacheShape:
        return CacheShape(self.layers, self.kv_heads, self.head_dim, slots, max_len, self.kv_dtype)


class Model(Protocol):
    """What the engine runs: StepModel here, or worker/tp/llm_step.py's TPStepModel (a shard
    group, whose `facts` are one rank's share of the heads). `cache_device`: where its KV
    cache lives ("cpu", or "cuda" for a graph whose attention runs on the GPU)."""

    facts: GraphFacts
    cache_device: str

    def run(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray: ...


@runtime_checkable
class TopModel(Model, Protocol):
    """A model whose step graph also returns its own top-k of the last logits: StepModel over
    a graph built by quantize/llm_graph.py (top_k 0: an older graph, without them)."""

    top_k: int

    def run_top(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray]: ...


class VerifyingModel(Model, Protocol):
    """A target model for speculative decoding: logits at every new position."""

    def run_positions(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray: ...


def is_step_graph(session: OnnxSession) -> bool:
    return any(a.name == SEQLENS for a in session.session.get_inputs())


class StepModel:
    def __init__(self, session: OnnxSession) -> None:
        self.session = session
        meta = session.session.get_modelmeta().custom_metadata_map
        ints = [f for f in GraphFacts.__dataclass_fields__ if f != "kv_dtype"]
        try:
            self.facts = GraphFacts(
                **{f: int(meta[META + f]) for f in ints},
                kv_dtype=meta.get(META + "kv_dtype", "float32"),
            )
        except KeyError as e:
            raise ValueError(
                f"{session.path}: not a meshserve LLM step graph (metadata {e} missing); "
                "build it with `python -m quantize build-repository`"
            ) from e
        self.position_logits = meta.get(META + "num_logits_input") == "1"
        self.top_k = 0  # the graph's own top-k width (0: it has none)
        for out in session.session.get_outputs():
            if out.name == TOP_IDS and isinstance(out.shape[-1], int):
                self.top_k = out.shape[-1]
        f = self.facts
        self._past = [past_names(i) for i in range(f.layers)]
        self._present = [present_names(i) for i in range(f.layers)]
        self.cache_device = cache_device(session.provider, f.kv_dtype, session.path)
        # A decode step replays a CUDA graph of its row range: every launch of the step is
        # recorded once and replayed as one (docs/llm.md "On a GPU"); the cache and the
        # step's inputs and outputs sit on the device at fixed addresses.
        self.graphs = session.cuda_graph and self.cache_device == CUDA and self.top_k > 0
        self._graphs_made = 0

    @classmethod
    def load(cls, path: Path, options: RuntimeOptions, providers: list[str]) -> StepModel:
        return cls(OnnxSession(path, options, providers))

    def run(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray:
        """ids [rows, new] int64 for slots lo..hi-1; lengths [rows]: each row's length
        including the new tokens. Returns logits [rows, vocab] float32."""
        logits = self._run(cache, ids, lengths, lo, hi, 1)
        return logits[:, -1] if self.position_logits else logits

    def run_top(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """As `run`, returning the graph's own top-k instead of the logits: (values [rows, k]
        float32, largest first; ids [rows, k] int64). The logits never leave onnxruntime:
        a greedy row takes ids[:, 0], a top-k row (k <= self.top_k) samples from these."""
        if not self.top_k:
            raise ValueError(f"{self.session.path}: the step graph has no top-k output")
        if self.graphs and ids.shape[1] == 1:
            graph = self._graph(cache, lo, hi)
            if graph is not None:
                return graph.run(self.session.session, ids, lengths)
        bound = self._binding(cache, lo, hi, 0)
        self._feed(bound.io, ids, lengths, 1)
        options = run_options(ids.shape[1], self.session.cuda_graph)
        self.session.session.run_with_iobinding(bound.io, options)
        assert bound.values is not None and bound.ids is not None
        # copies: the bound buffers are the next run's outputs
        return bound.values.copy(), bound.ids.copy()

    def run_positions(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray:
        """As `run`, with the logits of every new position: [rows, new, vocab]."""
        if not self.position_logits:
            raise ValueError(
                f"{self.session.path}: the step graph returns the last position's logits only; "
                "build it with all_positions (quantize/llm_graph.py) to verify drafts"
            )
        return self._run(cache, ids, lengths, lo, hi, ids.shape[1])

    def run_probes(
        self,
        cache: KVCache,
        ids: np.ndarray,
        lengths: np.ndarray,
        lo: int,
        hi: int,
        names: list[str],
    ) -> list[np.ndarray]:
        """As `run`, returning the graph outputs NAMES instead of the logits: activations a
        copy of the graph exposes as outputs, for a quantizer's calibration (quantize/w8a8)."""
        io = self.session.session.io_binding()
        self._bind_cache(io, cache, lo, hi)
        for name in names:
            io.bind_output(name)
        self._feed(io, ids, lengths, 1)
        self.session.session.run_with_iobinding(io)
        return [v.numpy() for v in io.get_outputs()[-len(names) :]]

    def _run(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int, n: int
    ) -> np.ndarray:
        io = self._binding(cache, lo, hi, n).io
        self._feed(io, ids, lengths, n)
        self.session.session.run_with_iobinding(
            io, run_options(ids.shape[1], self.session.cuda_graph)
        )
        # a copy: the binding's output buffer is reused by the next run
        return np.array(io.get_outputs()[0].numpy())

    def _feed(self, io: ort.IOBinding, ids: np.ndarray, lengths: np.ndarray, n: int) -> None:
        io.bind_cpu_input(IDS, np.ascontiguousarray(ids, dtype=np.int64))
        io.bind_cpu_input(SEQLENS, (lengths - 1).astype(np.int32))
        io.bind_cpu_input(TOTAL, np.array(int(lengths.max()), dtype=np.int32))
        if self.position_logits:
            io.bind_cpu_input(NUM_LOGITS, np.array(n, dtype=np.int64))

    def _binding(self, cache: KVCache, lo: int, hi: int, n: int) -> Binding:
        """One IO binding per row range (and count of positions with logits, whose output
        shape onnxruntime keeps), kept by the cache (whose memory it binds), with the cache
        bound once: a step then rebinds only its small inputs. n = 0: the top-k outputs
        instead of the logits, written into host buffers of their own, so that a step reads
        them without wrapping every output (the cache's included) in a new OrtValue."""
        key = (id(self), lo, hi, n)
        bound = cache.bindings.get(key)
        if bound is None:
            io = self.session.session.io_binding()
            values = best = None
            if n == 0:
                rows, k = hi - lo, self.top_k
                values, best = np.empty((rows, k), np.float32), np.empty((rows, k), np.int64)
                shape = self.top_shape(rows)
                for name, buffer in ((TOP_VALUES, values), (TOP_IDS, best)):
                    io.bind_output(name, HOST, 0, buffer.dtype, shape, buffer.ctypes.data)
            else:
                io.bind_output(LOGITS)  # first, so that get_outputs() starts with it
            self._bind_cache(io, cache, lo, hi)
            bound = cache.bindings[key] = Binding(io, values, best)
        return cast(Binding, bound)

    def _bind_cache(self, io: ort.IOBinding, cache: KVCache, lo: int, hi: int) -> None:
        """Every layer's keys and values of slots lo..hi-1 bound as both past and present:
        the run writes them in place."""
        for (pk, pv), (ok, ov), (k, v) in zip(
            self._past, self._present, cache.views(lo, hi), strict=True
        ):
            bind_in_place(io, pk, ok, k)
            bind_in_place(io, pv, ov, v)

    def top_shape(self, rows: int) -> list[int]:
        """The graph's top-k outputs' shape for `rows` rows, one position each."""
        return [rows, 1, self.top_k] if self.position_logits else [rows, self.top_k]

    def _graph(self, cache: KVCache, lo: int, hi: int) -> GraphStep | None:
        """The decode step over slots lo..hi-1 as a CUDA graph of its own (None: MAX_GRAPHS
        are made; the step then launches its kernels as any other run)."""
        key = ("graph", id(self), lo, hi)
        graph = cache.bindings.get(key)
        if graph is None:
            if self._graphs_made >= MAX_GRAPHS:
                return None
            self._graphs_made += 1  # ids never reused: a graph keeps the addresses it saw
            graph = cache.bindings[key] = GraphStep(self, cache, lo, hi, self._graphs_made)
        return cast(GraphStep, graph)


class GraphStep:
    """A decode step over a fixed row range whose every input and output lives at a fixed
    address on the cache's device, as a CUDA graph needs: onnxruntime records the step's
    launches on its first runs with this `gpu_graph_id` and replays them after, and a step
    only copies its token ids and lengths in and its top-k out. `total_sequence_length` is
    the cache's length, since a replay keeps the launch parameters it recorded: attention
    reads each row's length from seqlens_k on the device (benchmarks/llm_gpu.py's
    cuda_graph part checks the tokens against launching kernel by kernel)."""

    def __init__(self, model: StepModel, cache: KVCache, lo: int, hi: int, graph_id: int) -> None:
        first = cache.views(lo, hi)[0][0]
        where, device_id = (CUDA, first.device_id) if isinstance(first, DeviceView) else (HOST, 0)

        def buffer(shape: list[int], dtype: type) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, where, device_id)

        self.rows = hi - lo
        self.ids, self.seqlens = buffer([self.rows, 1], np.int64), buffer([self.rows], np.int32)
        shape = model.top_shape(self.rows)
        self.values, self.best = buffer(shape, np.float32), buffer(shape, np.int64)
        self.total = np.array(cache.shape.max_len, np.int32)
        io = self.io = model.session.session.io_binding()
        io.bind_ortvalue_input(IDS, self.ids)
        io.bind_ortvalue_input(SEQLENS, self.seqlens)
        io.bind_cpu_input(TOTAL, self.total)
        if model.position_logits:
            self.num_logits = buffer([], np.int64)
            self.num_logits.update_inplace(np.array(1, np.int64))
            io.bind_ortvalue_input(NUM_LOGITS, self.num_logits)
        io.bind_ortvalue_output(TOP_VALUES, self.values)
        io.bind_ortvalue_output(TOP_IDS, self.best)
        model._bind_cache(io, cache, lo, hi)
        self.options = ort.RunOptions()
        self.options.add_run_config_entry("gpu_graph_id", str(graph_id))

    def run(
        self, session: ort.InferenceSession, ids: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        self.ids.update_inplace(np.ascontiguousarray(ids, np.int64))
        self.seqlens.update_inplace((lengths - 1).astype(np.int32))
        session.run_with_iobinding(self.io, self.options)
        # copies: on the host, numpy() is a view of the next step's output
        values, best = (
            np.array(v.numpy()).reshape(self.rows, -1) for v in (self.values, self.best)
        )
        return values, best


@dataclass(frozen=True)
class Binding:
    """A step's IO binding over a row range of the cache, and where its top-k lands."""

    io: ort.IOBinding
    values: np.ndarray | None  # [rows, k] float32, largest first (top-k bindings only)
    ids: np.ndarray | None  # [rows, k] int64


def bind_in_place(io: ort.IOBinding, past: str, present: str, view: CacheView) -> None:
    """One layer's keys (or values) as both the past and the present: written in place."""
    if isinstance(view, DeviceView):
        io.bind_input(past, CUDA, view.device_id, view.dtype, list(view.shape), view.ptr)
        io.bind_output(present, CUDA, view.device_id, view.dtype, list(view.shape), view.ptr)
    else:
        io.bind_ortvalue_input(past, view)
        io.bind_ortvalue_output(present, view)


def cache_device(provider: str, kv_dtype: str, path: Path) -> str:
    """Where a step graph's KV cache lives: on the GPU when onnxruntime runs the graph
    there and its attention op can (onnxruntime's CUDA GroupQueryAttention takes float16
    only), else in host memory."""
    if provider != CUDA_PROVIDER:
        return HOST
    if kv_dtype != "float16":
        log.warning(
            "llm_cache_on_host",
            model=str(path),
            kv_dtype=kv_dtype,
            hint="onnxruntime's CUDA attention takes a float16 KV cache: this graph's "
            "attention runs on the CPU; build it with `python -m quantize build-llm "
            "--checkpoint FILE --kv-dtype float16`",
        )
        return HOST
    return CUDA
