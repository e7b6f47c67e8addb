"""The KV cache: allocated once, written in place by the step graph, freed per sequence.

One anonymous mapping holds keys and values for every layer as [2, layers, slots, kv_heads,
max_len, head_dim]. That layout is fixed; only the element type is a parameter,
`CacheShape.dtype`: "float32" or "float16" (llama.cpp's default), whichever the step graph
was built for (its metadata `meshserve.llm.kv_dtype`; older graphs are float32). A sequence
owns one slot for its lifetime; the attention op writes each new token's keys at the
sequence's own length, so nothing is ever copied or concatenated between steps. Slot rows
are contiguous per layer, so the rows of a decode batch (slots lo..hi) bind to onnxruntime
as views of this memory, without a copy.

This is the memory only. Its room (which slot a sequence gets, what stays cached, which
pages go back) is worker/llm/kv_manager.py's, which tells it what to copy and discard:
pages of the mapping become resident only when written and go back to the OS (madvise
DONTNEED) when discarded, so the memory held is at most the manager's token budget, rounded
up to pages (on a CUDA device the cache is one allocation of slots x max_len instead:
worker/llm/device.py).
"""

from __future__ import annotations

import contextlib
import gc
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

from worker.llm.device import CUDA, CudaCacheMemory, DeviceView, Layout

KV_DTYPES = ("float32", "float16")  # what the step graph's attention op reads and writes
HOST = "cpu"
DEVICES = (HOST, CUDA)  # where the memory lives: the step graph's provider (worker/llm/device.py)
DISCARD, COPY = 0, 1  # the cache's moves, as a shard group's ranks replay them
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 lacks it


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    slots: int
    max_len: int
    dtype: str = "float32"  # one of KV_DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r}: expected one of {KV_DTYPES}")

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


CacheView: TypeAlias = ort.OrtValue | DeviceView  # one layer's keys or values of some slots


class HostCacheMemory:
    """The cache in host memory: one private anonymous mapping, whose pages become resident as
    they are written and go back to the OS (madvise DONTNEED) when discarded."""

    def __init__(self, layout: Layout, dtype: str) -> None:
        self.layout = layout
        # Private: MADV_DONTNEED on a shared anonymous mapping keeps its pages (and data).
        # No swap reserved for slots x max_len: only the budget's pages are ever resident.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        self._map = mmap.mmap(-1, int(np.prod(layout.dims)) * layout.itemsize, flags=flags)
        self.data = np.frombuffer(self._map, dtype=dtype).reshape(layout.dims)

    def discard(self, slot: int) -> None:
        """The slot's pages back to the OS (it reads as zeros afterwards)."""
        size = self.layout.slot_bytes
        for kv in range(2):
            for layer in range(self.layout.dims[1]):
                # page-aligned when max_len * head_dim * itemsize is a page multiple
                self._map.madvise(mmap.MADV_DONTNEED, self.layout.offset(kv, layer, slot), size)

    def discard_from(self, slot: int, start: int) -> None:
        """The pages of the slot's rows start.. back to the OS, whole pages only: a page that
        also holds a row before `start` is kept."""
        row, head, page = self.layout.row_bytes, self.layout.head_bytes, mmap.PAGESIZE
        for kv in range(2):
            for layer in range(self.layout.dims[1]):
                base = self.layout.offset(kv, layer, slot)
                for h in range(self.layout.dims[3]):
                    lo = -(-(base + h * head + start * row) // page) * page
                    hi = (base + (h + 1) * head) // page * page
                    if hi > lo:
                        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        d = self.data
        for kv in range(2):  # one contiguous block per layer and head: 4x numpy's 5-D copy
            for layer in range(self.layout.dims[1]):
                np.copyto(d[kv, layer, dst, :, start:stop], d[kv, layer, src, :, start:stop])

    def views(self, lo: int, hi: int) -> list[tuple[CacheView, CacheView]]:
        """Per layer, keys and values of slots lo..hi-1 as OrtValues over this memory."""
        return [
            (
                ort.OrtValue.ortvalue_from_numpy(self.data[0, layer, lo:hi]),
                ort.OrtValue.ortvalue_from_numpy(self.data[1, layer, lo:hi]),
            )
            for layer in range(self.layout.dims[1])
        ]

    def close(self) -> None:
        del self.data
        try:
            self._map.close()
        except BufferError:  # a view still lives (e.g. in a logged traceback's frame)
            gc.collect()
            with contextlib.suppress(BufferError):  # then the last view's owner frees it
                self._map.close()


class KVCache:
    """The memory: on the host (device "cpu": HostCacheMemory), or on a CUDA device ("cuda":
    worker/llm/device.py) for a step graph that runs there."""

    def __init__(self, shape: CacheShape, device: str = HOST) -> None:
        if device not in DEVICES:
            raise ValueError(f"KV cache device {device!r}: expected one of {DEVICES}")
        self.shape = shape
        s = shape
        self.layout = Layout((2, s.layers, s.slots, s.kv_heads, s.max_len, s.head_dim), s.itemsize)
        self.memory: HostCacheMemory | CudaCacheMemory = (
            CudaCacheMemory(self.layout, s.dtype)
            if device == CUDA
            else HostCacheMemory(self.layout, s.dtype)
        )
        self._views: dict[tuple[int, int], list[tuple[CacheView, CacheView]]] = {}
        self.bindings: dict[tuple, object] = {}  # the step model's IO bindings over this memory
        # told of every move (discard_from, copy_rows) as (op, a, b, start, stop)
        self.on_change: Callable[[tuple[int, int, int, int, int]], None] | None = None

    @property
    def data(self) -> np.ndarray:
        """The host cache as [2, layers, slots, kv_heads, max_len, head_dim] (tests, ranks)."""
        if not isinstance(self.memory, HostCacheMemory):
            raise TypeError("the KV cache is on a CUDA device: no host array")
        return self.memory.data

    def discard(self, slot: int) -> None:
        """Return the slot's written pages to the OS (on a device: bookkeeping only)."""
        self.memory.discard(slot)

    def discard_from(self, slot: int, start: int) -> None:
        """Return the pages of the slot's rows start.. (every head of every layer) to the OS,
        whole pages only. Tells `on_change` (a shard group's other ranks drop theirs too)."""
        if start <= 0:
            self.memory.discard(slot)
        else:
            self.memory.discard_from(slot, start)
        if self.on_change is not None:
            self.on_change((DISCARD, slot, -1, start, 0))

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        """Copy rows start..stop-1 of slot `src` into slot `dst`, keys and values of every
        layer (a reused prefix: a memcpy per layer and head, far cheaper than its
        prefill). Tells `on_change`."""
        if stop > start:
            self.memory.copy_rows(src, dst, start, stop)
        if self.on_change is not None:
            self.on_change((COPY, src, dst, start, stop))

    def apply(self, op: tuple[int, int, int, int, int]) -> None:
        """Replay an `on_change` record (another rank's cache, its own heads)."""
        kind, a, b, start, stop = op
        if kind == DISCARD:
            self.discard_from(a, start)
        elif kind == COPY:
            self.copy_rows(a, b, start, stop)
        else:
            raise ValueError(f"unknown cache op {kind}")

    def views(self, lo: int, hi: int) -> list[tuple[CacheView, CacheView]]:
        """Per layer, (keys, values) of slots lo..hi-1 over this memory: OrtValues on the
        host, DeviceViews (bound by address) on a device; made once per range."""
        views = self._views.get((lo, hi))
        if views is None:
            views = self._views[(lo, hi)] = self.memory.views(lo, hi)
        return views

    def close(self) -> None:
        self.bindings.clear()
        self._views.clear()
        self.memory.close()


def page_aligned(max_len: int, row_floats: int, page: int = 4096, itemsize: int = 4) -> int:
    """The smallest length >= max_len whose per-slot bytes are whole pages (for madvise);
    row_floats elements of itemsize bytes per position."""
    unit = 1
    while (unit * row_floats * itemsize) % page:
        unit += 1
    return -(-max_len // unit) * unit
