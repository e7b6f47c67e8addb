"""Sharding plans: what TP sizes are refused, and the segments' sums equal the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from quantize import llm_shard, shard
from quantize.models import BertEncoder, DecoderConfig, EncoderConfig, LlamaDecoder
from worker.tp.runtime import CapacityError, ShardSet, ShardSetError, check_budget


def test_refuses_a_tp_size_that_does_not_divide_the_heads() -> None:
    with pytest.raises(shard.ShardError, match=r"9 attention heads and 3 KV heads.*\[1, 3\]"):
        shard.check_tp("smollm2", 9, 3, 2)
    with pytest.raises(
        shard.ShardError, match=r"12 attention heads; valid TP sizes: \[1, 2, 3, 4, 6, 12\]"
    ):
        shard.check_tp("minilm", 12, 12, 5)
    for tp in (2, 3, 4):
        shard.check_tp("minilm", 12, 12, tp)
    shard.check_tp("smollm2", 9, 3, 3)


def _simulate(root: Path, env0: dict) -> dict:
    """Every rank's segments in this process, partials summed: what the group computes."""
    m = json.loads((root / shard.MANIFEST).read_text())
    sessions = [
        {f["segment"]: ort.InferenceSession(str(root / f["path"])) for f in r["files"]}
        for r in m["ranks"]
    ]
    envs = [dict(env0) for _ in sessions]
    for seg in m["segments"]:
        outs = [
            s[seg["name"]].run(seg["outputs"], {n: env[n] for n in seg["inputs"]})
            for s, env in zip(sessions, envs, strict=True)
        ]
        for j, name in enumerate(seg["outputs"]):
            for r, env in enumerate(envs):
                if name == "partial":
                    env["reduced"] = sum(o[j] for o in outs)
                elif name == "logits_shard":
                    env["logits"] = np.concatenate([o[j] for o in outs], -1)
                else:
                    env[name.removesuffix("_out")] = outs[r][j]
    return envs[0]


def test_encoder_segments_sum_to_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BertEncoder(
        EncoderConfig(vocab_size=50, hidden=24, layers=2, heads=6, intermediate=48)
    ).eval()
    path = shard.write_shards(model, "enc", tmp_path / "enc", 3)
    ids = torch.randint(0, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    env = _simulate(path.parent, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        expected = model(ids, mask).numpy()
    np.testing.assert_allclose(env["sentence_embedding"], expected, atol=1e-5)
    manifest = json.loads(path.read_text())
    assert [r["rank"] for r in manifest["ranks"]] == [0, 1, 2]
    assert all(len(f["sha256"]) == 64 for r in manifest["ranks"] for f in r["files"])


def test_a_decoder_is_sharded_as_the_engine_step_graph() -> None:
    model = LlamaDecoder(
        DecoderConfig(vocab_size=97, hidden=96, layers=1, heads=6, kv_heads=2, intermediate=48)
    )
    with pytest.raises(shard.ShardError, match="llm_shard"):
        shard.plan_for(model, 0, 2)
    segments = llm_shard.plan(model, 1, 2, 64)
    assert [s.name for s in segments] == ["first", "L0.mlp", "head"]
    # the vocabulary is padded to a multiple of the TP size, and each rank holds half
    (head,) = [t for t in segments[-1].proto.graph.initializer if t.name == "lm_head.weight"]
    assert list(head.dims) == [96, 49]
    attention = [n for n in segments[0].proto.graph.node if n.op_type == "GroupQueryAttention"]
    heads = {a.name: a.i for a in attention[0].attribute if a.name.endswith("num_heads")}
    assert heads == {"num_heads": 3, "kv_num_heads": 1}
    with pytest.raises(shard.ShardError, match="multiple of 16"):
        small = DecoderConfig(
            vocab_size=64, hidden=48, layers=1, heads=6, kv_heads=2, intermediate=8
        )
        llm_shard.plan(LlamaDecoder(small), 0, 2, 64)


def test_manifest_checksums_and_budget(tmp_path: Path) -> None:
    model = BertEncoder(EncoderConfig(vocab_size=50, hidden=24, layers=1, heads=6, intermediate=48))
    s1 = ShardSet(shard.write_shards(model, "enc", tmp_path / "enc", 1).parent, {})
    s1 = ShardSet(s1.root, json.loads((s1.root / shard.MANIFEST).read_text()))
    s2 = shard.write_shards(model, "enc", tmp_path / "enc", 2).parent
    s2 = ShardSet(s2, json.loads((s2 / shard.MANIFEST).read_text()))
    s2.verify(1)
    budget = (s1.rank_weight_bytes()[0] + max(s2.rank_weight_bytes())) // 2
    with pytest.raises(
        CapacityError,
        match=rf"unsharded needs \d+ bytes .* budget of {budget} bytes; shard it with TP 2",
    ):
        check_budget(s1, budget)
    check_budget(s2, budget)
    (s2.root / "rank1" / "head.onnx").write_bytes(b"not the exported graph")
    with pytest.raises(ShardSetError, match="rank 1 file rank1/head.onnx has sha256"):
        s2.verify(1)
