"""Model analysis from the ONNX graph and config alone (no run): weight bytes per recipe,
FLOPs and bytes moved per item or per token for prefill and decode, KV bytes per token, and
arithmetic intensity by batch size.

What a run costs, from the graph:
- every projection (MatMul / Gemm / MatMulInteger / MatMulNBits with a constant weight,
  and the q/k/v projection inside an encoder's fused Attention / QAttention) costs 2 K N
  FLOPs per token and reads its weight bytes once per run, whatever the batch: that is why
  batching raises arithmetic intensity;
- an embedding table (a Gather or Slice of a constant) reads only the rows it gathers: row
  bytes per token;
- attention between activations costs 4 S d FLOPs per token per layer over S positions
  (QK^T and AV), d the attention width; a decoder's decode step also reads its whole KV
  cache: context x KV bytes per token, per sequence;
- the graph's outputs (logits, embeddings) are written once per row (item or sequence).
Activations between layers, normalisations, softmax and element-wise ops are left out: they
stay in the caches at these sizes, and the Roofline counts the bytes that must cross the
memory bus.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format

from common import model_keys, step_graph
from protos import model_config_pb2 as mc

PROJECTIONS = {"MatMul", "Gemm", "MatMulInteger", "MatMulNBits", "FusedMatMul"}
ATTENTION = ("Attention", "QAttention")  # com.microsoft: q/k/v weight [hidden, 3 x hidden]
INTEGER = ("MatMulInteger", "QAttention")
LLM_META = step_graph.META
ENGINE_KEY = model_keys.ENGINE
VERSION_LABEL = model_keys.VERSION_LABEL

ENCODER, DECODER, GENERIC = "encoder", "decoder", "generic"
ENCODER_TOKENS = 16  # an encoder item's tokens when none is given: TEXT's padding unit

# What each recipe stores per projection weight (bytes/parameter) and computes in, on a
# CPU and on a GPU. Block-wise weight-only formats carry an fp32 scale per block: 64
# weights for int8 (quantize/recipes.DECODER_INT8_BLOCK; 128 in the LM head, counted as
# 64 here), 32 for int4 (+ a 4-bit zero point per block).
RECIPES: dict[str, tuple[float, str, str]] = {
    "fp32": (4.0, "fp32", "fp32"),
    "encoder-fp16": (2.0, "fp32", "fp16"),
    "decoder-fp16": (2.0, "fp32", "fp16"),
    "encoder-int8-dynamic": (1.0, "int8", "int8"),
    "decoder-int8-dynamic": (1.0, "int8", "int8"),
    "decoder-int8-weight-only": (1.0 + 4 / 64, "int8", "fp16"),
    "decoder-int4-weight-only": (0.5 + 4 / 32 + 0.5 / 32, "int8", "fp16"),
    # int8 per output channel (one scale per column), int8 activations; the down
    # projections stay int8 weight-only blocks (quantize/w8a8.py), counted as int8 here
    "decoder-w8a8": (1.0, "int8", "int8"),
}


class AnalysisError(ValueError):
    """A model the analysis cannot read; names the file and what was expected."""


@dataclass(frozen=True)
class ModelAnalysis:
    name: str
    version: str
    recipe: str
    kind: str  # encoder, decoder or generic
    weight_bytes: int  # every initializer as stored: what must fit in memory
    projection_params: int  # K x N summed over the projections: MACs per token
    projection_bytes: int  # those weights as stored: read once per run
    head_params: int  # a decoder's LM head: only the last position of a prefill reaches it
    table_row_bytes: int  # embedding rows read per token
    other_bytes: int  # small constants read per run (norms, biases, scales)
    output_bytes_per_row: int  # graph outputs with static dims (logits, embeddings)
    layers: int
    heads: int  # attention heads (0: not in the graph's metadata); TP must divide them
    kv_heads: int
    attention_width: int  # d: query heads x head dim
    kv_bytes_per_token: int  # 0 for a model without a KV cache
    compute_dtype_cpu: str
    compute_dtype_gpu: str
    max_batch_size: int = 0
    default_tokens: int = 1  # an item's tokens when none is given (an encoder: 16, TEXT's unit)

    @property
    def streamed_bytes(self) -> int:
        """Bytes every run reads whatever its batch: the working set a cache may hold."""
        return self.projection_bytes + self.other_bytes

    def compute_dtype(self, kind: str) -> str:
        return self.compute_dtype_gpu if kind == "gpu" else self.compute_dtype_cpu

    # -- one run ------------------------------------------------------------------------

    def encoder_call(self, batch: int, tokens: int | None = None) -> tuple[float, float]:
        """(FLOPs, bytes) of one run over `batch` items of `tokens` tokens."""
        s = tokens or self.default_tokens
        n = batch * s
        flops = 2 * self.projection_params * n + 4 * n * s * self.attention_width * self.layers
        moved = (
            self.projection_bytes
            + self.other_bytes
            + n * self.table_row_bytes
            + batch * self.output_bytes_per_row
        )
        return float(flops), float(moved)

    def decode_step(self, batch: int, context: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step: `batch` sequences, one new token each, over
        `context` cached tokens."""
        flops = 2 * self.projection_params * batch
        flops += 4 * batch * context * self.attention_width * self.layers
        moved = self.projection_bytes + self.other_bytes
        moved += batch * (self.table_row_bytes + self.output_bytes_per_row)
        moved += batch * (context + 1) * self.kv_bytes_per_token
        return float(flops), float(moved)

    def prefill(self, tokens: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one prompt of `tokens` tokens in one run (causal attention;
        the LM head sees the last position only)."""
        body = self.projection_params - self.head_params
        flops = 2 * (body * tokens + self.head_params)
        flops += 2 * tokens * tokens * self.attention_width * self.layers
        moved = self.projection_bytes + self.other_bytes
        moved += tokens * self.table_row_bytes + self.output_bytes_per_row
        moved += tokens * self.kv_bytes_per_token
        return float(flops), float(moved)

    def run(self, batch: int, context: int = 0, tokens: int | None = None) -> tuple[float, float]:
        """A decoder's decode step, an encoder's (or any model's) call."""
        if self.kind == DECODER:
            return self.decode_step(batch, context)
        return self.encoder_call(batch, tokens)

    def intensity(self, batch: int, context: int = 0, tokens: int | None = None) -> float:
        flops, moved = self.run(batch, context, tokens)
        return flops / moved if moved else 0.0

    def kv_bytes(self, sequences: int, context: int) -> int:
        return sequences * context * self.kv_bytes_per_token

    def as_recipe(self, recipe: str) -> ModelAnalysis:
        """The same model stored as `recipe` (predicted from the parameter count, for a
        recipe the repository does not hold)."""
        if recipe not in RECIPES:
            raise AnalysisError(f"unknown recipe {recipe!r}; known recipes: {sorted(RECIPES)}")
        per_param, cpu, gpu = RECIPES[recipe]
        projection_bytes = int(self.projection_params * per_param)
        return replace(
            self,
            recipe=recipe,
            projection_bytes=projection_bytes,
            weight_bytes=self.weight_bytes - self.projection_bytes + projection_bytes,
            compute_dtype_cpu=cpu,
            compute_dtype_gpu=gpu,
        )

    def summary(self, context: int = 0) -> dict:
        """The figures `planner diagnose` prints, per token and per item."""
        f1, b1 = self.run(1, context)
        per = "token" if self.kind == DECODER else f"item ({self.default_tokens} tokens)"
        return {
            "model": self.name,
            "version": self.version,
            "recipe": self.recipe,
            "kind": self.kind,
            "weight_bytes": self.weight_bytes,
            "projection_params": self.projection_params,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            f"flops_per_{per.split()[0]}": f1,
            f"bytes_per_{per.split()[0]}_at_batch_1": b1,
            "intensity_by_batch": {b: round(self.intensity(b, context), 2) for b in (1, 8, 64)},
        }


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(onnx.helper.get_attribute_value(a))
    return default


def _nbytes(t: onnx.TensorProto) -> int:
    dims = int(np.prod(t.dims)) if t.dims else 1
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (dims + 1) // 2
    return dims * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def analyse_graph(
    model: onnx.ModelProto, name: str, version: str, recipe: str, max_batch_size: int = 0
) -> ModelAnalysis:
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    sizes = {n: _nbytes(t) for n, t in inits.items()}
    meta = {p.key: p.value for p in model.metadata_props}
    ops = Counter(n.op_type for n in graph.node)
    w = _weights(graph, inits, sizes)
    other = sum(s for n, s in sizes.items() if n not in w.used and not n.startswith("rope."))
    shape = _attention_shape(meta, ops, w.widths)
    cpu, gpu = ("int8", "int8") if w.integer else ("fp32", "fp16" if w.fp16 else "fp32")
    if w.integer and ops["MatMulNBits"]:
        gpu = "fp16"  # weight-only on CUDA dequantizes to half precision
    return ModelAnalysis(
        name=name,
        version=version,
        recipe=recipe,
        kind=shape.kind,
        weight_bytes=sum(sizes.values()),
        projection_params=w.params,
        projection_bytes=w.projection_bytes,
        head_params=w.head_params,
        table_row_bytes=w.table_row,
        other_bytes=other,
        output_bytes_per_row=_output_bytes(graph),
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        attention_width=shape.width,
        kv_bytes_per_token=shape.kv_per_token,
        compute_dtype_cpu=cpu,
        compute_dtype_gpu=gpu,
        max_batch_size=max_batch_size,
        default_tokens=ENCODER_TOKENS if shape.kind == ENCODER else 1,
    )


@dataclass
class _Weights:
    """What the graph's constant weights add up to (analyse_graph's first pass)."""

    params: int = 0  # projection parameters, K x N summed
    projection_bytes: int = 0
    head_params: int = 0  # the lm_head projection's
    table_row: int = 0  # bytes of one row of every embedding table
    widths: Counter[int] = field(default_factory=Counter)  # projections by input width K
    used: set[str] = field(default_factory=set)  # initializers counted above
    integer: bool = False  # an integer kernel computes
    fp16: bool = False  # a half-precision weight


def _weights(
    graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], sizes: dict[str, int]
) -> _Weights:
    w = _Weights()
    for node in graph.node:
        if node.op_type in PROJECTIONS or node.op_type in ATTENTION:
            weight = next((i for i in node.input[1:2] if i in inits), None)
            if weight is None:
                continue  # activation x activation: attention, counted from the shape facts
            if node.op_type == "MatMulNBits":
                k, n = _attr(node, "K"), _attr(node, "N")
                w.integer |= _attr(node, "accuracy_level") == 4
                names = [i for i in node.input[1:] if i in inits]
            else:
                dims = list(inits[weight].dims)
                if node.op_type == "Gemm" and _attr(node, "transB"):
                    dims = dims[::-1]
                k, n = int(np.prod(dims[:-1])), int(dims[-1])
                w.integer |= node.op_type in INTEGER
                w.fp16 |= inits[weight].data_type == onnx.TensorProto.FLOAT16
                names = [i for i in node.input[1:] if i in inits]
            w.params += k * n
            w.projection_bytes += sum(sizes[i] for i in names)
            w.used.update(names)
            w.widths[k] += 1
            if weight.startswith("lm_head"):
                w.head_params = k * n
        elif node.op_type in ("Gather", "Slice") and node.input[0] in inits:
            # an embedding table: a Gather of token ids, or positions 0..seq-1 sliced off
            table = inits[node.input[0]]
            if len(table.dims) >= 2:
                w.table_row += sizes[table.name] // int(table.dims[0])
                w.used.add(table.name)
    return w


@dataclass(frozen=True)
class _Shape:
    kind: str
    layers: int
    heads: int
    kv_heads: int
    width: int  # the attention width
    kv_per_token: int  # KV cache bytes per token


def _attention_shape(meta: dict[str, str], ops: Counter[str], widths: Counter[int]) -> _Shape:
    """A decoder's shape from the step graph's metadata; an encoder's (or a generic graph's)
    counted from its attention ops, its width the commonest projection input."""
    if f"{LLM_META}layers" in meta:
        layers = int(meta[f"{LLM_META}layers"])
        heads, head_dim = int(meta[f"{LLM_META}heads"]), int(meta[f"{LLM_META}head_dim"])
        kv_heads = int(meta[f"{LLM_META}kv_heads"])
        itemsize = 2 if meta.get(f"{LLM_META}kv_dtype") == "float16" else 4
        kv_per_token = 2 * layers * kv_heads * head_dim * itemsize
        return _Shape(DECODER, layers, heads, kv_heads, heads * head_dim, kv_per_token)
    layers = ops["Softmax"] + sum(ops[op] for op in ATTENTION)
    width = widths.most_common(1)[0][0] if widths else 0
    return _Shape(ENCODER if layers else GENERIC, layers, 0, 0, width, 0)


def _output_bytes(graph: onnx.GraphProto) -> int:
    """Bytes per row of the graph's outputs (past the batch dim; the KV cache's present_*
    outputs are the cache itself, counted apart)."""
    total = 0
    for out in graph.output:
        if out.name.startswith("present"):
            continue
        t = out.type.tensor_type
        # a step graph's num_logits positions: one in a decode step
        dims = [1 if d.dim_param == step_graph.POSITIONS else d.dim_value for d in t.shape.dim[1:]]
        if all(d > 0 for d in dims):
            size = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
            total += int(np.prod(dims)) * size if dims else size
    return total


def _guess_recipe(model: onnx.ModelProto) -> str:
    ops = {n.op_type for n in model.graph.node}
    if "MatMulIntegerToFloat" in ops:
        return "w8a8"
    if "MatMulNBits" in ops:
        bits = {_attr(n, "bits", 4) for n in model.graph.node if n.op_type == "MatMulNBits"}
        return "int4-weight-only" if 4 in bits else "int8-weight-only"
    if "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops:
        return "int8-dynamic"
    if any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer):
        return "fp16"
    return "fp32"


def read_config(model_dir: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    path = model_dir / "config.pbtxt"
    if path.exists():
        try:
            text_format.Parse(path.read_text(), config)
        except text_format.ParseError as e:
            raise AnalysisError(f"{path}: not a ModelConfig in text format ({e})") from e
    config.name = config.name or model_dir.name
    return config


def analyse_file(
    path: Path, name: str, version: str, config: mc.ModelConfig | None = None
) -> ModelAnalysis:
    try:  # shapes and types are all it reads: weights kept beside the graph stay on disk
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError, OSError, ...
        raise AnalysisError(f"{path}: not a readable ONNX model ({e})") from e
    config = config or mc.ModelConfig(name=name)
    label = config.parameters.get(VERSION_LABEL + version)
    recipe = label.string_value if label is not None else _guess_recipe(model)
    return analyse_graph(model, name, version, recipe, config.max_batch_size)


def analyse_repository(root: Path) -> list[ModelAnalysis]:
    """Every model version in a Triton-layout repository (DIR/<model>/<version>/model.onnx)."""
    if not root.is_dir():
        raise AnalysisError(f"{root}: no such model repository (expected DIR/<model>/<version>/)")
    found = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        config = read_config(model_dir)
        for version_dir in sorted(
            (p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
            key=lambda p: int(p.name),
        ):
            onnx_path = version_dir / "model.onnx"
            if onnx_path.exists():
                found.append(analyse_file(onnx_path, model_dir.name, version_dir.name, config))
    if not found:
        raise AnalysisError(f"{root}: no DIR/<model>/<version>/model.onnx found")
    return found
