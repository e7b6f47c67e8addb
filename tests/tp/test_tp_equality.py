"""TP 2 and 3 with real gloo process groups equal the unsharded torch model (fp32, 1e-4).

MiniLM: all 6 layers of the real weights, TP 2 and 3. SmolLM2: the real weights cut to its
first 4 of 30 layers (every layer has the same shape, so 4 exercise every cut; exporting all
30 for 3 ranks takes about a minute on 2 cores), TP 3 (9 heads, 3 KV heads): the prompt's
logits and 3 decode steps with each rank's own KV cache, against one cache-free forward over
the prompt and the generated tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantize import shard, weights
from worker.tp_local import run_group

pytestmark = pytest.mark.slow

SENTENCES = ["tensor parallel serving", "a much longer sentence that needs more tokens", "hi"]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, dict]:
    try:
        loaded = weights.load_minilm()
    except weights.MissingWeights as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("minilm-tp")
    for tp in (2, 3):
        shard.write_shards(loaded.model, "minilm", root / "minilm", tp)
    loaded.tokenizer.enable_padding()
    enc = loaded.tokenizer.encode_batch(SENTENCES)
    feeds = {
        "input_ids": np.array([e.ids for e in enc], np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
    }
    return root, loaded.model, feeds


@pytest.mark.parametrize("tp", [2, 3])
def test_minilm_tp_equals_unsharded(minilm, tp: int, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, model, feeds = minilm
    with torch.no_grad():
        expected = model(
            torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])
        )
    out = run_group(root, "minilm", tp, feeds, tmp_path)
    assert str(out["backend"]) == "gloo"
    assert out["sentence_embedding"].shape == (3, 384)
    np.testing.assert_allclose(out["sentence_embedding"], expected.numpy(), atol=1e-4, rtol=0)


def test_smollm2_tp3_prompt_and_decode_steps(tmp_path: Path) -> None:
    try:
        loaded = weights.load_smollm2()
    except weights.MissingWeights as e:
        pytest.skip(str(e))
    model = shard.truncate(loaded.model, 4)
    shard.write_shards(model, "smollm2", tmp_path / "repo" / "smollm2", 3)
    prompt = np.array([loaded.tokenizer.encode("The capital of France is").ids] * 2, np.int64)
    prompt[1, 0] = 42  # two different rows in one batch
    steps = 3
    out = run_group(
        tmp_path / "repo", "smollm2", 3, {"input_ids": prompt}, tmp_path, "--new-tokens", str(steps)
    )
    tokens = out["output_ids"]
    assert tokens.shape == (2, steps)
    full = np.concatenate([prompt, tokens[:, :-1]], axis=1)
    with torch.no_grad():
        keys, values = model.empty_cache(2)
        ids = torch.from_numpy(full)
        expected, _, _ = model(ids, torch.ones_like(ids), keys, values)
    expected = expected.numpy()
    s = prompt.shape[1]
    np.testing.assert_allclose(out["logits_0"], expected[:, :s], atol=1e-4, rtol=0)
    for j in range(1, steps):
        np.testing.assert_allclose(
            out[f"logits_{j}"][:, 0], expected[:, s + j - 1], atol=1e-4, rtol=0
        )
    assert (tokens == expected[:, s - 1 :].argmax(-1)).all()
