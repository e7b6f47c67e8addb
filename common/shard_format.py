"""The shard-set format: what quantize/ (shard.py, llm_shard.py) writes and worker/tp/
reads and verifies. A shard set lives at DIR/<model>/<version>/tp<N>/: one folder per rank
of ONNX segments and a manifest (format, model, kind, tp, config, segments, inputs,
outputs, and per rank its files with sha256 and bytes, and its weight bytes). The leader
and the ranks then speak in op codes, one per broadcast (worker/tp/leader.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FORMAT = 1
MANIFEST = "manifest.json"
ENCODER, LLM = "encoder", "llm"  # the manifest's kind
OP_NOOP, OP_STOP, OP_ENCODE, OP_STEP = 0, 1, 2, 4
# The segment tensors of a decoder cut (quantize/llm_shard.py -> worker/tp/llm_step.py).
HIDDEN, HIDDEN_OUT, REDUCED, PARTIAL, LOGITS_SHARD = (
    "hidden",
    "hidden_out",
    "reduced",
    "partial",
    "logits_shard",
)
ROPE_FILE = "rope.npz"  # per rank: the RoPE tables, rope.cos and rope.sin


def shard_dir(model_dir: Path, version: str, tp: int) -> Path:
    return model_dir / version / f"tp{tp}"


def sha256(path: Path) -> str:
    """The checksum the manifest records per file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
