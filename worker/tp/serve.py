"""The model repository of a shard group's rank 0: `python -m worker --tp N`.

Every model with a tp<N> shard set is served. An encoder looks like any model (token ids in,
an embedding out) and its requests go through the same dynamic batcher as a single-process
worker, whose run function is one group-wide forward. An LLM (kind "llm",
quantize/llm_shard.py) is served exactly as a single-process worker serves one: Triton's
vLLM-backend tensors through LLMServing and the same Engine, whose model is a TPStepModel
(worker/tp/llm_step.py) running each step over the group — so the router sees one replica. The
config's parameters report the group: meshserve.tp, meshserve.tp.backend, and per rank
meshserve.tp.rank<r>.weight_bytes / .rss_bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable

import numpy as np
import structlog

from common import model_keys
from common.dtypes import NUMPY
from common.net import free_port
from common.shard_format import LLM, OP_ENCODE
from protos import model_config_pb2 as mc
from worker import config as cfg
from worker.batcher import Batcher
from worker.repository import LoadedModel, Repository, serve_llm
from worker.runtime import RuntimeOptions, requested_providers
from worker.settings import WorkerSettings
from worker.stats import ModelStats
from worker.tp.leader import Leader, spawn_ranks
from worker.tp.llm_step import RankSteps, TPStepModel
from worker.tp.load import load_rank
from worker.tp.parallel import init_tp_group
from worker.tp.runtime import (
    RankModel,
    ShardSet,
    check_budget,
    find_shard_sets,
    rss_bytes,
)

log = structlog.get_logger()

TP = model_keys.TP
TP_BACKEND = model_keys.TP_BACKEND
# Text serving of an encoder is the single-process worker's (worker/text.py); a shard group
# serves its token ids.
_TEXT_PARAMETERS = (cfg.TOKENIZER, cfg.TEXT_TASK)


class TpRepository(Repository):
    def __init__(self, settings: WorkerSettings, options: RuntimeOptions) -> None:
        super().__init__(
            settings.model_repository,
            options,
            default_max_batch_size=settings.default_max_batch_size,
            default_max_queue_size=settings.default_max_queue_size,
        )
        self.settings = settings
        self.leader: Leader | None = None
        self.rank_stats: list[list[int]] = []

    def load(self) -> None:
        s = self.settings
        shard_sets = find_shard_sets(self.root, s.tp)
        for shards in shard_sets:
            check_budget(shards, s.memory_budget_bytes)
        # With a fixed master port the other ranks run on their own hosts (one pod each).
        port = s.tp_master_port or free_port()
        children = [] if s.tp_master_port else spawn_ranks(s, self.root, port)
        joined = threading.Event()
        threading.Thread(target=_exit_if_a_rank_dies, args=(children, joined), daemon=True).start()
        try:
            providers = requested_providers(s.providers)
            models = [load_rank(x, 0, self.options, providers) for x in shard_sets]
            group = init_tp_group(
                0, s.tp, s.tp_backend, s.tp_master_addr, port, s.tp_timeout_seconds
            )
            weights = sum(m.weight_bytes for m in models)
            self.rank_stats = group.gather_ints([weights, rss_bytes()])
        except Exception:
            for child in children:
                child.kill()
            raise
        finally:
            joined.set()
        self.leader = Leader(models, group, children, heartbeat_s=s.tp_timeout_seconds / 4)
        log.info(
            "tp_group_ready",
            world=s.tp,
            backend=group.backend,
            weight_bytes=[r[0] for r in self.rank_stats],
            rss=[r[1] for r in self.rank_stats],
        )
        for index, (shards, model) in enumerate(zip(shard_sets, models, strict=True)):
            version = shards.root.parent.name
            if shards.kind == LLM:
                loaded = self._load_llm_sharded(index, shards, model, group.backend)
            else:
                loaded = self._load_sharded(index, shards, model, group.backend)
            self.models.setdefault(shards.model, {})[version] = loaded

    def start(self, on_failure: Callable[[str], None]) -> None:
        assert self.leader is not None
        self.leader.start(on_failure)

    def _load_sharded(
        self, index: int, shards: ShardSet, model: RankModel, backend: str
    ) -> LoadedModel:
        m = shards.manifest
        config = cfg.read(shards.root.parent.parent)
        for key in _TEXT_PARAMETERS:
            if key in config.parameters:
                del config.parameters[key]

        def graph(tensors: list[dict]) -> list[cfg.GraphTensor]:
            return [
                cfg.GraphTensor(
                    t["name"], t["datatype"], (None, *(None if d < 0 else d for d in t["dims"]))
                )
                for t in tensors
            ]

        completed = cfg.complete(
            config,
            graph(m["inputs"]),
            graph(m["outputs"]),
            self.default_max_batch_size,
            self.default_max_queue_size,
        )
        # Token ids are checked against the embedding before they reach the group.
        cfg.add_index_bounds(
            completed, {n: b for x in model.sessions.values() for n, b in x.index_bounds.items()}
        )
        self._report_group(completed, model.provider, shards.tp, backend)
        spec = cfg.spec(completed, shards.root.parent.name)
        run = self._run_fn(index)
        run(list(spec.outputs), _zeros(spec))  # warm-up through every rank
        stats = ModelStats()
        batcher = Batcher(spec, run, stats, spec.max_queue_size or self.default_max_queue_size)
        log.info("model_loaded", model=spec.name, version=spec.version, tp=shards.tp)
        return LoadedModel(spec, completed, model.sessions["first"], stats, batcher=batcher)

    def _report_group(self, config: mc.ModelConfig, provider: str, tp: int, backend: str) -> None:
        params = config.parameters
        params[cfg.EXECUTION_PROVIDER].string_value = provider
        params[TP].string_value = str(tp)
        params[TP_BACKEND].string_value = backend
        for rank, (weights, rss) in enumerate(self.rank_stats):
            params[f"meshserve.tp.rank{rank}.weight_bytes"].string_value = str(weights)
            params[f"meshserve.tp.rank{rank}.rss_bytes"].string_value = str(rss)

    def _load_llm_sharded(
        self, index: int, shards: ShardSet, model: RankSteps, backend: str
    ) -> LoadedModel:
        """The engine on this rank, each step over the group (the single-process worker's
        Repository._load_llm, with a TPStepModel)."""
        assert self.leader is not None
        model_dir = shards.root.parent.parent
        config = cfg.read(model_dir)
        if not cfg.is_llm(config):
            raise cfg.ConfigError(
                f"model {config.name!r}: its shard set is an LLM's, but config.pbtxt does not "
                f"set {cfg.ENGINE} to {cfg.LLM_ENGINE!r}"
            )
        completed = cfg.complete_llm(config, self.default_max_queue_size)
        self._report_group(completed, model.provider, shards.tp, backend)
        version = shards.root.parent.name
        spec = cfg.spec(completed, version)
        llm, stats = serve_llm(
            spec, TPStepModel(model, self.leader, index), model_dir, tp=shards.tp
        )
        return LoadedModel(spec, completed, model.sessions["first"], stats, llm=llm)

    def _run_fn(self, index: int):  # type: ignore[no-untyped-def]
        leader = self.leader
        assert leader is not None

        def run(names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            ids = feeds["input_ids"]
            mask = feeds.get("attention_mask")
            if mask is None:
                mask = np.ones_like(ids)
            (out,) = leader.call(index, OP_ENCODE, 0, [ids, mask])
            return [out for _ in names]

        return run

    def abort(self) -> None:
        """After a failure: the other ranks are killed, nothing waits on the group."""
        if self.leader is not None:
            self.leader.stop()

    async def close(self) -> None:
        await super().close()
        if self.leader is not None:
            self.leader.stop()


def _zeros(spec: cfg.ModelSpec) -> dict[str, np.ndarray]:
    return {
        t.name: np.ones((1, *(1 if d < 0 else d for d in t.dims)), NUMPY[t.datatype])
        for t in spec.inputs.values()
    }


def _exit_if_a_rank_dies(children: list[subprocess.Popen], joined: threading.Event) -> None:
    """While rank 0 waits for the others to join: a rank that exits (bad shard files, no
    memory) would leave it waiting for the join timeout; exit now with that rank's code."""
    while not joined.wait(0.2):
        for rank, child in enumerate(children, start=1):
            code = child.poll()
            if code is not None:
                print(
                    f"meshserve worker: TP rank {rank} exited with {code} while starting; "
                    "see its message above",
                    file=sys.stderr,
                    flush=True,
                )
                for other in children:
                    other.kill()
                os._exit(2)
