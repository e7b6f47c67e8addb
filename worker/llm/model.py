"""The step graph (quantize/llm_graph.py) in onnxruntime, bound to the KV cache.

`run` takes the new tokens of some rows, each row's length after them, and the cache slots
the rows live in (contiguous, lo..hi-1); it returns the last position's logits per row.
The cache is bound as both the past and the present of every layer (IO binding), so
onnxruntime writes the new keys and values straight into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from worker.llm.cache import KVCache
from worker.runtime import OnnxSession, RuntimeOptions

META = "meshserve.llm."
IDS, SEQLENS, TOTAL, LOGITS = "input_ids", "seqlens_k", "total_sequence_length", "logits"


@dataclass(frozen=True)
class GraphFacts:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int


def is_step_graph(session: OnnxSession) -> bool:
    return any(a.name == SEQLENS for a in session.session.get_inputs())


class StepModel:
    def __init__(self, session: OnnxSession) -> None:
        self.session = session
        meta = session.session.get_modelmeta().custom_metadata_map
        try:
            self.facts = GraphFacts(
                **{f: int(meta[META + f]) for f in GraphFacts.__dataclass_fields__}
            )
        except KeyError as e:
            raise ValueError(
                f"{session.path}: not a meshserve LLM step graph (metadata {e} missing); "
                "build it with `python -m quantize build-repository`"
            ) from e
        f = self.facts
        self._past = [(f"past_key.{i}", f"past_value.{i}") for i in range(f.layers)]
        self._present = [(f"present_key.{i}", f"present_value.{i}") for i in range(f.layers)]

    @classmethod
    def load(cls, path: Path, options: RuntimeOptions, providers: list[str]) -> StepModel:
        return cls(OnnxSession(path, options, providers))

    def run(
        self, cache: KVCache, ids: np.ndarray, lengths: np.ndarray, lo: int, hi: int
    ) -> np.ndarray:
        """ids [rows, new] int64 for slots lo..hi-1; lengths [rows]: each row's length
        including the new tokens. Returns logits [rows, vocab] float32."""
        io = self._binding(cache, lo, hi)
        io.bind_cpu_input(IDS, np.ascontiguousarray(ids, dtype=np.int64))
        io.bind_cpu_input(SEQLENS, (lengths - 1).astype(np.int32))
        io.bind_cpu_input(TOTAL, np.array(int(lengths.max()), dtype=np.int32))
        self.session.session.run_with_iobinding(io)
        # a copy: the binding's output buffer is reused by the next run
        return np.array(io.get_outputs()[0].numpy())

    def _binding(self, cache: KVCache, lo: int, hi: int) -> ort.IOBinding:
        """One IO binding per row range, kept by the cache (whose memory it binds), with the
        cache bound once: a step then rebinds only its three small inputs."""
        key = (id(self), lo, hi)
        io = cache.bindings.get(key)
        if io is None:
            io = self.session.session.io_binding()
            io.bind_output(LOGITS)  # first, so it is get_outputs()[0]
            for (pk, pv), (ok, ov), (k, v) in zip(
                self._past, self._present, cache.views(lo, hi), strict=True
            ):
                io.bind_ortvalue_input(pk, k)
                io.bind_ortvalue_input(pv, v)
                io.bind_ortvalue_output(ok, k)
                io.bind_ortvalue_output(ov, v)
            cache.bindings[key] = io
        return io
