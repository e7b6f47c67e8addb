"""The tensor-parallel process group: its one owner.

`init_tp_group` creates it once per process, `get_tp_group` asserts it exists (vLLM's
parallel_state shape), `destroy_tp_group` ends it. World size 1 needs no backend: every
collective is the identity. gloo on CPU, NCCL when CUDA is active (`choose_backend`); NCCL
collectives run on a copy of the array on this rank's GPU.

Collectives carry numpy arrays (what onnxruntime gives and takes). Every collective has the
group's timeout: a rank that died or hangs makes it raise instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

HEADER_INTS = 64
_DTYPES: list[np.dtype] = [
    np.dtype(np.float32),
    np.dtype(np.int64),
    np.dtype(np.float16),
    np.dtype(np.int32),
]
_MAX_DIMS = 5


class CollectiveError(Exception):
    """A collective failed: a peer died, hung past the timeout, or the group is gone."""


def choose_backend(requested: str = "auto", world: int = 1, gpus: int | None = None) -> str:
    """gloo or nccl as asked; auto: NCCL when CUDA is active with a GPU per rank (NCCL
    refuses two ranks on one device), else gloo."""
    if requested in ("gloo", "nccl"):
        return requested
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= world and gpus > 0 and dist.is_nccl_available() else "gloo"


@dataclass
class TpGroup:
    rank: int
    world: int
    backend: str
    timeout_s: float
    _pg: Any = None  # the collectives' group: the world, with the collective timeout

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", self.rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(array, copy=True, order="C"))
        return t.to(self.device) if self.backend == "nccl" else t

    def all_reduce(self, array: np.ndarray) -> np.ndarray:
        """Sum over ranks."""
        if self.world == 1:
            return array
        t = self._tensor(array)
        try:
            dist.all_reduce(t, group=self._pg)
        except Exception as e:
            raise CollectiveError(f"all_reduce failed on rank {self.rank}: {e}") from e
        return t.cpu().numpy()

    def all_gather(self, array: np.ndarray, axis: int = -1) -> np.ndarray:
        """Concatenation along `axis` of every rank's array, in rank order."""
        if self.world == 1:
            return array
        t = self._tensor(array)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        try:
            dist.all_gather(parts, t, group=self._pg)
        except Exception as e:
            raise CollectiveError(f"all_gather failed on rank {self.rank}: {e}") from e
        return np.concatenate([p.cpu().numpy() for p in parts], axis=axis)

    def gather(self, array: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's array (same shape everywhere), in rank order, on rank 0; None on the
        others."""
        if self.world == 1:
            return [array]
        t = self._tensor(array)
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        try:
            dist.gather(t, parts, dst=0, group=self._pg)
        except Exception as e:
            raise CollectiveError(f"gather failed on rank {self.rank}: {e}") from e
        return None if parts is None else [p.cpu().numpy() for p in parts]

    def broadcast(
        self, head: tuple[int, int, int], arrays: list[np.ndarray] | None = None
    ) -> tuple[tuple[int, int, int], list[np.ndarray]]:
        """Rank 0 sends three ints and arrays; every other rank receives them. A fixed-size int64
        header says what follows (dtype and shape of each array), then one broadcast per
        array."""
        if self.world == 1:
            return head, list(arrays or [])
        header = np.zeros(HEADER_INTS, np.int64)
        if self.rank == 0:
            arrays = [np.ascontiguousarray(a) for a in arrays or []]
            header[:4] = (*head, len(arrays))
            at = 4
            for a in arrays:
                if a.ndim > _MAX_DIMS or at + 2 + a.ndim > HEADER_INTS:
                    raise ValueError("too many or too high-dimensional arrays to broadcast")
                header[at : at + 2] = (_DTYPES.index(a.dtype), a.ndim)
                header[at + 2 : at + 2 + a.ndim] = a.shape
                at += 2 + a.ndim
        t = self._tensor(header)
        try:
            dist.broadcast(t, src=0, group=self._pg)
            header = t.cpu().numpy()
            h0, h1, h2, n = (int(x) for x in header[:4].tolist())
            out, at = [], 4
            for i in range(n):
                dtype = _DTYPES[int(header[at])]
                ndim = int(header[at + 1])
                shape = tuple(int(d) for d in header[at + 2 : at + 2 + ndim])
                at += 2 + ndim
                if self.rank == 0:
                    assert arrays is not None
                    buf = self._tensor(arrays[i])
                else:
                    buf = torch.empty(shape, dtype=_torch_dtype(dtype), device=self.device)
                dist.broadcast(buf, src=0, group=self._pg)
                out.append(buf.cpu().numpy())
        except Exception as e:
            raise CollectiveError(f"broadcast failed on rank {self.rank}: {e}") from e
        return (h0, h1, h2), out

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's small list of ints (same length), on every rank."""
        row = np.asarray(values, np.int64)[None]
        return [list(map(int, r)) for r in self.all_gather(row, axis=0)]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


_GROUP: TpGroup | None = None


def init_tp_group(
    rank: int,
    world: int,
    backend: str = "auto",
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    timeout_s: float = 10.0,
    join_timeout_s: float = 300.0,
) -> TpGroup:
    """Join the group: blocks until all `world` ranks have joined (loading can be slow, so
    joining has its own, longer timeout); collectives then time out after `timeout_s`."""
    global _GROUP
    assert _GROUP is None, "the TP group is already initialised in this process"
    chosen = choose_backend(backend, world)
    if world > 1:
        if chosen == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            dist.init_process_group(
                chosen,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=join_timeout_s),
            )
            pg = dist.new_group(
                list(range(world)), timeout=datetime.timedelta(seconds=timeout_s), backend=chosen
            )
        except Exception as e:
            raise CollectiveError(f"rank {rank} could not join the TP group: {e}") from e
        _GROUP = TpGroup(rank, world, chosen, timeout_s, pg)
        return _GROUP
    _GROUP = TpGroup(rank, world, "none", timeout_s)
    return _GROUP


def get_tp_group() -> TpGroup:
    assert _GROUP is not None, "the TP group is not initialised (init_tp_group first)"
    return _GROUP


def destroy_tp_group() -> None:
    global _GROUP
    if _GROUP is not None and _GROUP.world > 1 and dist.is_initialized():
        # a broken group may not tear down cleanly; the process exits anyway
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _GROUP = None
