"""One rank's share of a tensor-parallel model: verified shard files, onnxruntime segments,
and the forward pass that joins them with collectives (see quantize/shard.py for the cut).

Every rank runs the same code on the same inputs: `execute(op, ...)` is called by rank 0 on
a request and by every other rank on what rank 0 broadcast (worker/tp/leader.py). An encoder
(kind "encoder") runs one forward per call (`RankModel`); a decoder (kind "llm",
quantize/llm_shard.py) runs one step of the LLM engine per call (worker/tp/llm_step.py), each
rank keeping the KV cache of its own KV heads between steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.shard_format import MANIFEST, OP_ENCODE, OP_STEP, PARTIAL, REDUCED, sha256
from worker.config import ConfigError
from worker.runtime import OnnxSession, RuntimeOptions
from worker.tp.parallel import TpGroup


class ShardSetError(ConfigError):
    """A shard set that is missing, incomplete, or fails its checksums."""


class CapacityError(ConfigError):
    """A model whose per-rank weights exceed the per-rank memory budget."""


@dataclass(frozen=True)
class ShardSet:
    root: Path  # DIR/<model>/<version>/tp<N>
    manifest: dict

    @property
    def model(self) -> str:
        return str(self.manifest["model"])

    @property
    def tp(self) -> int:
        return int(self.manifest["tp"])

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    def rank_weight_bytes(self) -> list[int]:
        return [int(r["weight_bytes"]) for r in self.manifest["ranks"]]

    def verify(self, rank: int) -> dict[str, Path]:
        """This rank's files exist and match the manifest's sha256; segment -> path."""
        files = {}
        for f in self.manifest["ranks"][rank]["files"]:
            path = self.root / f["path"]
            if not path.exists():
                raise ShardSetError(f"{self.root}: rank {rank} file {f['path']} is missing")
            digest = sha256(path)
            if digest != f["sha256"]:
                raise ShardSetError(
                    f"{self.root}: rank {rank} file {f['path']} has sha256 {digest[:16]}..., "
                    f"the manifest says {f['sha256'][:16]}...; re-run `python -m quantize shard`"
                )
            files[f["segment"]] = path
        return files


def find_shard_sets(repository: Path, tp: int) -> list[ShardSet]:
    """Every model in the repository with a tp<N> shard set (its latest version that has one)."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a directory")
    found = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir()):
        versions = sorted(
            (int(v.name) for v in model_dir.iterdir() if v.name.isdigit()), reverse=True
        )
        for v in versions:
            manifest = model_dir / str(v) / f"tp{tp}" / MANIFEST
            if manifest.exists():
                data = json.loads(manifest.read_text())
                if data.get("model") != model_dir.name or int(data.get("tp", 0)) != tp:
                    raise ShardSetError(
                        f"{manifest}: says model {data.get('model')!r} tp {data.get('tp')}, "
                        f"but sits in {model_dir.name}/{v}/tp{tp}"
                    )
                found.append(ShardSet(manifest.parent, data))
                break
    if not found:
        raise ShardSetError(
            f"no model in {repository} has a TP {tp} shard set (<model>/<version>/tp{tp}/"
            f"{MANIFEST}); make one with `python -m quantize shard --model M --tp {tp}`"
        )
    return found


def check_budget(shards: ShardSet, budget_bytes: int) -> None:
    """Refuse a shard set whose largest rank holds more weight bytes than the budget, and
    say which TP size would fit (per-rank bytes ~ replicated + sharded / tp)."""
    if budget_bytes <= 0:
        return
    need = max(shards.rank_weight_bytes())
    if need <= budget_bytes:
        return
    m = shards.manifest
    c = m["config"]
    heads, kv = int(c["heads"]), int(c.get("kv_heads", c["heads"]))
    replicated, sharded = int(m["replicated_bytes"]), int(m["sharded_bytes"])
    fits = [
        t
        for t in range(1, heads + 1)
        if heads % t == 0 and kv % t == 0 and replicated + sharded // t <= budget_bytes
    ]
    what = "unsharded" if shards.tp == 1 else f"at TP {shards.tp}"
    hint = (
        f"shard it with TP {fits[0]} (`python -m quantize shard --model {shards.model} "
        f"--tp {fits[0]}`, then the worker with --tp {fits[0]}), about "
        f"{replicated + sharded // fits[0]} bytes per rank"
        if fits
        else f"no TP size fits: {replicated} bytes are replicated on every rank"
    )
    raise CapacityError(
        f"model {shards.model!r} {what} needs {need} bytes of weights per rank, over the "
        f"per-rank memory budget of {budget_bytes} bytes; {hint}"
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Timing:
    compute_ns: int = 0
    comm_ns: int = 0

    def reset(self) -> None:
        self.compute_ns = self.comm_ns = 0


class RankModel:
    """One model's segments on this rank."""

    def __init__(
        self, shards: ShardSet, rank: int, options: RuntimeOptions, providers: list[str]
    ) -> None:
        self.shards = shards
        self.rank = rank
        files = shards.verify(rank)
        self.segments = [
            (s["name"], s["inputs"], s["outputs"]) for s in shards.manifest["segments"]
        ]
        options = dataclasses.replace(options, allow_spinning=False)
        self.sessions = {name: OnnxSession(files[name], options, providers) for name in files}
        self.provider = next(iter(self.sessions.values())).provider
        self.config = shards.manifest["config"]
        self.weight_bytes = int(shards.manifest["ranks"][rank]["weight_bytes"])
        self.timing = Timing()

    def forward(self, group: TpGroup, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, inputs, outputs in self.segments:
            t0 = time.perf_counter_ns()
            arrays = self.sessions[name].session.run(outputs, {n: env[n] for n in inputs})
            t1 = time.perf_counter_ns()
            self.timing.compute_ns += t1 - t0
            for out, array in zip(outputs, arrays, strict=True):
                if out == PARTIAL:
                    env[REDUCED] = group.all_reduce(array)
                elif out.endswith("_out"):
                    env[out[:-4]] = array
                else:
                    env[out] = array
            self.timing.comm_ns += time.perf_counter_ns() - t1
        return env

    def encode(self, group: TpGroup, input_ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        env = self.forward(group, {"input_ids": input_ids, "attention_mask": mask})
        return env["sentence_embedding"]


def execute(model, group: TpGroup, op: int, arg: int, arrays: list[np.ndarray]) -> list:  # type: ignore[no-untyped-def]
    """What every rank runs for one broadcast operation (`model` is a RankModel, or a
    worker.tp.llm_step.RankSteps for OP_STEP)."""
    if op == OP_ENCODE:
        return [model.encode(group, arrays[0], arrays[1])]
    if op == OP_STEP:
        return [model.step(group, arrays[0])]
    raise ValueError(f"unknown TP operation {op}")
