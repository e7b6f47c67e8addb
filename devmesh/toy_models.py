"""Small ONNX models built from code (no downloads), in a Triton-layout repository.

    python -m devmesh.toy_models DIR

- `mlp`: a tiny fp32 MLP, 16 -> 64 -> 4, seeded weights (the benchmark model).
- `add_sub`: INT32 INPUT0, INPUT1 [-1, 16] -> OUTPUT0 = sum, OUTPUT1 = difference.
- `identity_<type>`: one per v2 datatype, INPUT0 -> OUTPUT0, any [batch, n] shape.
- `fixed`: no batch dimension, FP32 [2, 3] -> doubled.
- `zeros`: no batch dimension, INT64 [2] -> FP32 zeros of that shape: memory the input
  chooses (an allocation that fails, a negative size), as a generative model's can be.
- `embedding`: INT64 input_ids [batch, n] -> FP32 [batch, n, 8] rows of a 100-row table
  (a Gather, as a text model's first layer): token ids outside 0..99 are out of range.
- `write_text_embedder(DIR)` (not in the default repository): a text model as the worker
  serves them, a word-level tokenizer.json and an embedding bag over input_ids and
  attention_mask, so clients send TEXT or token ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from common import paths

OPSET = 17
IR_VERSION = 9

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def mlp(hidden: int = 64, features: int = 16, classes: int = 4, seed: int = 0) -> onnx.GraphProto:
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32)
    return helper.make_graph(
        [
            helper.make_node("MatMul", ["INPUT0", "W1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "W2"], ["OUTPUT0"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", classes])],
        initializer=[numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")],
    )


def add_sub() -> onnx.GraphProto:
    io = [
        helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 16])
        for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")
    ]
    return helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        io[:2],
        io[2:],
    )


def identity(datatype: str) -> onnx.GraphProto:
    t = ONNX_TYPES[datatype]
    return helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        f"identity_{datatype.lower()}",
        [helper.make_tensor_value_info("INPUT0", t, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", t, ["batch", "n"])],
    )


def fixed() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT0"], ["OUTPUT0"])],
        "fixed",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [2, 3])],
    )


def zeros() -> onnx.GraphProto:
    value = helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0])
    return helper.make_graph(
        [helper.make_node("ConstantOfShape", ["INPUT0"], ["OUTPUT0"], value=value)],
        "zeros",
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["rows", "columns"])],
    )


EMBEDDING_VOCAB = 100


def embedding(dim: int = 8, seed: int = 0) -> onnx.GraphProto:
    table = np.random.default_rng(seed).standard_normal((EMBEDDING_VOCAB, dim)).astype(np.float32)
    return helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["OUTPUT0"], axis=0)],
        "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", "n", dim])],
        initializer=[numpy_helper.from_array(table, "table")],
    )


TEXT_WORDS = ["[PAD]", "[UNK]", "hello", "world", "a", "b", "mesh", "serve"]


def text_embedder(dim: int = 4, seed: int = 0) -> onnx.GraphProto:
    """sentence_embedding = sum over unmasked tokens of their embedding rows."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((len(TEXT_WORDS), dim)).astype(np.float32)
    ids = ["batch", "seq"]
    return helper.make_graph(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["rows"], axis=0),
            helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
            helper.make_node("Mul", ["rows", "m3"], ["kept"]),
            helper.make_node("ReduceSum", ["kept", "seq_axis"], ["sentence_embedding"], keepdims=0),
        ],
        "text_embedder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ids),
        ],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", dim])],
        initializer=[
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([1], np.int64), "seq_axis"),
        ],
    )


def write_text_embedder(model_dir: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(TEXT_WORDS)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    write(
        model_dir,
        text_embedder(),
        "max_batch_size: 8\n"
        'parameters { key: "meshserve.tokenizer" value { string_value: "tokenizer.json" } }\n'
        'parameters { key: "meshserve.text_task" value { string_value: "embed" } }\n',
    )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


MLP_CONFIG = """\
max_batch_size: 64
dynamic_batching {
  max_queue_delay_microseconds: 500
}
parameters {
  key: "meshserve.price_per_call_micro_usd"
  value { string_value: "100" }
}
parameters {
  key: "meshserve.training_cost_micro_usd"
  value { string_value: "5000000000" }
}
"""


def write(model_dir: Path, graph: onnx.GraphProto, config: str | None = None) -> None:
    """One model in Triton's layout: model_dir/1/model.onnx and optional config.pbtxt."""
    _save(graph, model_dir / "1" / "model.onnx")
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)


def build(root: Path) -> Path:
    """Write the repository under root (idempotent) and return root."""
    write(root / "mlp", mlp(), MLP_CONFIG)
    _save(add_sub(), root / "add_sub" / "1" / "model.onnx")
    for datatype in ONNX_TYPES:
        _save(identity(datatype), root / f"identity_{datatype.lower()}" / "1" / "model.onnx")
    _save(fixed(), root / "fixed" / "1" / "model.onnx")
    _save(zeros(), root / "zeros" / "1" / "model.onnx")
    _save(embedding(), root / "embedding" / "1" / "model.onnx")
    return root


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else paths.build("models"))
    print(build(target))
