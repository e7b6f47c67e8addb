"""quantize/checkpoint.py: the step graph's config from a checkpoint's own metadata, and
refusals, at build time, naming the architecture, tensor type, key or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_gguf
import torch
from gguf import GGMLQuantizationType as T
from onnx import helper
from safetensors.torch import save_file

from common import custom_ops
from quantize import __main__ as cli
from quantize import checkpoints, evaluate, llm, llm_graph
from quantize.checkpoint import CheckpointError
from quantize.models import DecoderConfig, LlamaDecoder, greedy
from worker import runtime

PROMPT = [5, 40, 41, 300, 7, 99]


def test_gguf_metadata_becomes_the_config(tmp_path: Path) -> None:
    qwen = checkpoints.load(tiny_gguf.write(tmp_path / "q.gguf", "qwen2", "Q8_0"))
    assert qwen.architecture == "qwen2" and qwen.config.qkv_bias
    assert not qwen.config.tie_embeddings and qwen.config.rope_theta == 1e6
    assert qwen.config.eps == pytest.approx(1e-6) and qwen.config.context_length == 512
    smol = checkpoints.load(tiny_gguf.write(tmp_path / "s.gguf", "smollm", "Q4_1"))
    assert smol.config.tie_embeddings and not smol.config.qkv_bias
    assert (smol.config.heads, smol.config.kv_heads, smol.config.vocab_size) == (4, 2, 320)
    assert smol.tensor_types["blk.0.ffn_up.weight"] == "Q4_1"


def test_the_step_graph_defaults_to_the_model_context(tmp_path: Path) -> None:
    ck = checkpoints.load(tiny_gguf.write(tmp_path / "l.gguf", "llama", "F16"))
    path = llm_graph.save(llm.checkpoint_graph(ck), tmp_path / "model.onnx")
    model = evaluate.step_model(path)
    assert model.facts.max_positions == 512 and model.facts.kv_dtype == "float32"


def test_a_served_checkpoint_keeps_its_weights_beside_its_graph(tmp_path: Path) -> None:
    """build_checkpoint writes model.onnx (nodes) and model.onnx.data (weights): the graph
    file alone tells the worker its index bounds, and the pair serves the very tokens the
    single-file graph does."""
    ck = checkpoints.load(tiny_gguf.write(tmp_path / "s.gguf", "smollm", "Q8_0"))
    single = llm_graph.save(llm.checkpoint_graph(ck), tmp_path / "single" / "model.onnx")
    folder = llm.build_checkpoint(tmp_path / "s.gguf", tmp_path / "repo", "tiny")
    graph, weights = llm_graph.served_files(folder / "1" / "model.onnx")
    assert graph.stat().st_size < 100_000 < weights.stat().st_size
    assert weights.stat().st_size > 0.9 * single.stat().st_size
    assert runtime.index_bounds(graph) == {"input_ids": 320}
    served = evaluate.greedy(evaluate.step_model(graph), ck.tokenizer, [PROMPT], 8)
    assert served == evaluate.greedy(evaluate.step_model(single), ck.tokenizer, [PROMPT], 8)


def test_build_llm_caches_float16_from_a_checkpoint_and_refuses_it_for_a_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`build-llm --kv-dtype float16` builds a checkpoint's graph with a float16 cache (what
    onnxruntime's CUDA attention takes); a recipe build, whose graph caches float32, refuses
    the flag by name instead of installing a float32 graph."""
    tiny_gguf.write(tmp_path / "l.gguf", "llama", "Q8_0")
    argv = ["build-llm", "--output", str(tmp_path / "repo"), "--kv-dtype", "float16"]
    assert cli.main([*argv, "--checkpoint", str(tmp_path / "l.gguf"), "--name", "tiny"]) == 0
    model = evaluate.step_model(tmp_path / "repo" / "tiny" / "1" / "model.onnx")
    assert model.facts.kv_dtype == "float16"
    capsys.readouterr()
    assert cli.main([*argv, "--name", "smol"]) == 2
    assert "--kv-dtype float16" in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "repo" / "smol").exists()


def test_a_served_graph_verifies_drafts_and_keeps_its_top_k(tmp_path: Path) -> None:
    """save_served gives the graph the num_logits input (speculative decoding's verify run)
    and keeps its own top-k: one run gives every new position's logits, whose argmax is what
    the top-k says for the last position. The LM head writes the logits output itself (no
    Identity copying them every step)."""
    import onnx

    from worker.llm.cache import KVCache

    ck = checkpoints.load(tiny_gguf.write(tmp_path / "s.gguf", "smollm", "Q8_0"))
    folder = llm.build_checkpoint(tmp_path / "s.gguf", tmp_path / "repo", "tiny")
    nodes = onnx.load(str(folder / "1" / "model.onnx"), load_external_data=False).graph.node
    head = custom_ops.MATMUL_Q if custom_ops.available() else "MatMulNBits"  # Q8_0's blocks
    assert [n.op_type for n in nodes if "logits" in n.output] == [head]
    model = evaluate.step_model(folder / "1" / "model.onnx")
    assert model.position_logits and model.top_k == 64
    f = model.facts
    cache = KVCache(f.cache_shape(1, 64))
    ids, lengths = np.asarray([PROMPT]), np.asarray([len(PROMPT)])
    positions = model.run_positions(cache, ids, lengths, 0, 1)
    assert positions.shape == (1, len(PROMPT), ck.config.vocab_size)
    values, top = model.run_top(cache, ids, lengths, 0, 1)
    assert top.shape == (1, 64) and top[0, 0] == positions[0, -1].argmax()
    np.testing.assert_allclose(values[0, 0], positions[0, -1].max(), rtol=1e-6)
    cache.close()


def test_the_embedding_keeps_the_files_codes_and_a_gpu_build_keeps_it_fp32(
    tmp_path: Path,
) -> None:
    """Q8_0's table as 8-bit GatherBlockQuantized on the file's codes (quantize/embedding.py);
    custom_op=False (a GPU's build: CUDA graphs need every node on CUDA) keeps the Gather."""
    ck = checkpoints.load(tiny_gguf.write(tmp_path / "s.gguf", "smollm", "Q8_0"))

    def embedding(custom_op: bool | None) -> list[str]:
        graph = llm.checkpoint_graph(ck, custom_op=custom_op).graph
        return [n.op_type for n in graph.node if "Gather" in n.op_type and "embed" in n.input[0]]

    assert embedding(None) == ["GatherBlockQuantized"]
    assert embedding(False) == ["Gather"]


@torch.no_grad()
def test_attention_runs_at_scale_one_and_the_logits_stay_the_models(tmp_path: Path) -> None:
    """The step graph's attention op runs with scale 1 (onnxruntime's one-row q.k routine
    is taken only then), its RoPE tables carrying the 1 / sqrt(head_dim): decoding one token
    a step, its logits at every position equal the torch model's, which scales q.k itself."""
    ck = checkpoints.load(tiny_gguf.write(tmp_path / "l.gguf", "llama", "F32"))
    proto = llm.checkpoint_graph(ck)
    attention = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert attention
    assert {helper.get_node_attr_value(n, "scale") for n in attention} == {1.0}
    served = evaluate.teacher_forced(
        evaluate.step_model(llm_graph.save(proto, tmp_path / "model.onnx")), [PROMPT]
    )[0]
    model = ck.model()
    ids = torch.tensor([PROMPT])
    logits, _, _ = model(ids, torch.ones_like(ids), *model.empty_cache(1))
    np.testing.assert_allclose(served, logits[0].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"arch": "gemma"}, "architecture 'gemma' is not served"),
        ({"kinds": {"blk.1.ffn_down.weight": T.BF16}}, "'blk.1.ffn_down.weight' is BF16"),
        ({"omit": ("feed_forward_length",)}, "'llama.feed_forward_length' is missing"),
        ({"extra": {"rope.scaling.type": "yarn"}}, "rope.scaling.type 'yarn' is not served"),
    ],
)
def test_what_we_do_not_serve_is_refused_by_name(tmp_path: Path, kwargs: dict, named: str) -> None:
    path = tiny_gguf.write(tmp_path / "x.gguf", "llama", "Q4_0", **kwargs)
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(")):
        checkpoints.load(path)


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tiny_gguf.write(tmp_path / "t.gguf", "llama", "Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="t.gguf"):
        checkpoints.load(path)


HF_NAMES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_folder(folder: Path, model_type: str) -> tuple[Path, LlamaDecoder]:
    """A random model saved as Hugging Face saves it (bf16 weights)."""
    torch.manual_seed(0)
    c = DecoderConfig(
        vocab_size=320, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
        rope_theta=1e4, tie_embeddings=False, qkv_bias=model_type == "qwen2", context_length=256,
    )  # fmt: skip
    model = LlamaDecoder(c).eval()
    for p in model.parameters():
        p.data = p.data.bfloat16().float()  # what bf16 storage keeps
    tensors = {}
    for name, w in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            hf = f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.{parts[3]}"
        else:
            hf = {"embed": "model.embed_tokens", "norm": "model.norm"}.get(parts[0], parts[0])
            hf += "." + parts[-1]
        tensors[hf] = w.bfloat16().contiguous()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "vocab_size": 320,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    tiny = checkpoints.load(tiny_gguf.write(folder / "tok.gguf", "smollm", "F32"))
    tiny.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tok.gguf").unlink()
    return folder, model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_hugging_face_folder_builds_the_same_model(tmp_path: Path, model_type: str) -> None:
    folder, model = hf_folder(tmp_path / "hf", model_type)
    ck = checkpoints.load(folder)
    assert ck.config.qkv_bias == (model_type == "qwen2") and ck.config.context_length == 256
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(ck.state[name].numpy(), w.numpy(), err_msg=name)
    graph = llm_graph.save(llm.checkpoint_graph(ck), tmp_path / "model.onnx")
    ours = evaluate.greedy(evaluate.step_model(graph), ck.tokenizer, [PROMPT], 16)
    assert ours[0] == greedy(model, torch.tensor([PROMPT]), 16)


def test_a_hugging_face_config_we_do_not_serve_is_refused(tmp_path: Path) -> None:
    folder, _ = hf_folder(tmp_path / "hf", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral3"}))
    with pytest.raises(CheckpointError, match="model_type 'mistral3' is not served"):
        checkpoints.load(folder)
    del config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'intermediate_size' is missing"):
        checkpoints.load(folder)
