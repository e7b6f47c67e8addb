"""Which GGUF tensor an ONNX initializer stands for (GGUF names or our torch names), and
the type, shape and place of every tensor in a GGUF file, read from its header alone."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_TORCH_TO_GGUF = {
    "q": ("attn_q",),
    "k": ("attn_k",),
    "v": ("attn_v",),
    "qkv": ("attn_q", "attn_k", "attn_v"),  # the step graph's packed projection
    "o": ("attn_output",),
    "gate": ("ffn_gate",),
    "up": ("ffn_up",),
    "gate_up": ("ffn_gate", "ffn_up"),  # the step graph's fused MLP input
    "down": ("ffn_down",),
}
_TORCH_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(q|k|v|qkv|o|gate|up|gate_up|down)\.weight$")


def gguf_names(initializer: str) -> tuple[str, ...]:
    """The GGUF tensors an initializer is named after (GGUF or our torch names; a fused
    weight stands for several, its rows in their order); () if none."""
    name = initializer.removesuffix("_transposed").removesuffix(".T")
    if re.fullmatch(r"blk\.\d+\.\w+\.weight|token_embd\.weight|output\.weight", name):
        return (name,)
    if name in ("embed.weight", "lm_head.weight"):
        return ("token_embd.weight" if name == "embed.weight" else "output.weight",)
    found = _TORCH_LAYER.search(name)
    if found:
        return tuple(f"blk.{found.group(1)}.{t}.weight" for t in _TORCH_TO_GGUF[found.group(2)])
    return ()


def gguf_name(initializer: str) -> str | None:
    """The GGUF tensor an initializer is named after, if any (the first of a fused one)."""
    names = gguf_names(initializer)
    return names[0] if names else None


@dataclass(frozen=True)
class GGUFTensor:
    kind: str  # Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # numpy order: [out, in] for a weight
    start: int  # byte offset in the file
    nbytes: int

    def raw(self, path: Path) -> np.ndarray:
        """The tensor's bytes, [rows, bytes per row], as gguf.quants.dequantize takes them."""
        data = np.fromfile(path, np.uint8, count=self.nbytes, offset=self.start)
        return data.reshape(self.shape[0], -1) if len(self.shape) > 1 else data


_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def gguf_index(gguf_path: Path) -> dict[str, GGUFTensor]:
    """Name -> type, shape and place of every tensor in a GGUF (v2/v3) file, read from its
    header alone (gguf.GGUFReader also parses every vocabulary string: ~30 s here)."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(gguf_path, "rb") as f:
        buf = f.read(64 << 20)  # header + metadata (the tensor data is not read)
    pos = 0

    def take(fmt: str) -> int | float:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def string() -> str:
        nonlocal pos
        n = int(take("Q"))
        pos += n
        return buf[pos - n : pos].decode()

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:
            item, count = int(take("I")), int(take("Q"))
            if item in _SCALAR:
                pos += struct.calcsize(_SCALAR[item]) * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            take(_SCALAR[kind])

    if buf[:4] != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file")
    pos = 8
    tensors, kvs = int(take("Q")), int(take("Q"))
    alignment = 32
    for _ in range(kvs):
        key, kind = string(), int(take("I"))
        if key == "general.alignment":
            alignment = int(take(_SCALAR[kind]))
        else:
            skip(kind)
    infos = []
    for _ in range(tensors):
        name = string()
        dims = [int(take("Q")) for _ in range(int(take("I")))]
        kind, offset = GGMLQuantizationType(int(take("I"))), int(take("Q"))
        infos.append((name, dims, kind, offset))
    data = -(-pos // alignment) * alignment
    out = {}
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(dims))
        shape = tuple(reversed(dims))
        out[name] = GGUFTensor(kind.name, shape, data + offset, count // block * size)
    return out


def gguf_types(gguf_path: Path) -> dict[str, str]:
    """GGUF tensor name -> its type name (Q4_1, Q8_0, F32, ...)."""
    return {name: t.kind for name, t in gguf_index(gguf_path).items()}
