"""The requests a load test sends: random tensors shaped from the model's metadata, arrays
from a file, or text for a text model. Each becomes serialized ModelInferRequest bytes, made
once before the run so the load loop does no encoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from client import codec
from client.codec import ModelMetadata, TensorMetadata
from common import dtypes


def parse_shapes(items: list[str]) -> dict[str, list[int]]:
    """["INPUT0=1,16", ...] -> {"INPUT0": [1, 16]}."""
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        if not dims:
            raise ValueError(f"--shape {item!r}: expected NAME=D1,D2,...")
        shapes[name] = [int(d) for d in dims.split(",")]
    return shapes


def concrete_shape(spec: TensorMetadata, batch: int, dynamic: int) -> list[int]:
    """-1 in the first position is the batch; any other -1 takes `dynamic`."""
    return [(batch if i == 0 else dynamic) if d < 0 else d for i, d in enumerate(spec.shape)]


def random_tensor(spec: TensorMetadata, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if spec.datatype == "BYTES":
        words = rng.integers(97, 123, size=(int(np.prod(shape)), 8), dtype=np.uint8)
        array = np.empty(len(words), dtype=object)
        array[:] = [bytes(w) for w in words]
        return array.reshape(shape)
    dtype = dtypes.NUMPY[spec.datatype]
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, dtype=dtype)


def from_metadata(
    meta: ModelMetadata,
    batch: int = 1,
    shapes: dict[str, list[int]] | None = None,
    dynamic: int = 1,
    variants: int = 8,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """`variants` different random requests (cycled through during the run)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    return [
        {
            t.name: random_tensor(t, shapes.get(t.name) or concrete_shape(t, batch, dynamic), rng)
            for t in meta.inputs
        }
        for _ in range(variants)
    ]


def from_file(path: Path, meta: ModelMetadata) -> list[dict[str, np.ndarray]]:
    """`.npz`: one request, an array per input name. `.json`: {"INPUT0": [[...]]} or a list of
    those; values are cast to the datatype the model's metadata gives."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            return [{name: data[name] for name in data.files}]
    loaded = json.loads(path.read_text())
    kinds = {t.name: t.datatype for t in meta.inputs}
    requests = []
    for item in loaded if isinstance(loaded, list) else [loaded]:
        request = {}
        for name, value in item.items():
            if name not in kinds:
                raise ValueError(f"{path}: input {name!r} is not one of the model's {list(kinds)}")
            if kinds[name] == "BYTES":
                request[name] = codec.to_array(np.array(value).reshape(-1).tolist()).reshape(
                    np.shape(value)
                )
            else:
                request[name] = np.array(value, dtype=dtypes.NUMPY[kinds[name]])
        requests.append(request)
    return requests


def from_text(meta: ModelMetadata, texts: list[str]) -> list[dict[str, np.ndarray]]:
    """One request per text, shaped for the model's BYTES input."""
    return [codec.text_inputs(meta, t)[0] for t in texts]


def serialize(model: str, requests: list[dict[str, np.ndarray]], version: str = "") -> list[bytes]:
    return [
        codec.infer_request(model, inputs, version=version).SerializeToString()
        for inputs in requests
    ]
