"""Any served checkpoint by its form: a GGUF file (quantize/checkpoint.py) or a Hugging Face
folder with config.json and safetensors (quantize/checkpoint_hf.py)."""

from __future__ import annotations

from pathlib import Path

from quantize import checkpoint_hf
from quantize.checkpoint import Checkpoint, CheckpointError, load_gguf


def load(path: Path) -> Checkpoint:
    """A .gguf file or a Hugging Face folder."""
    path = Path(path)
    if path.is_dir():
        return checkpoint_hf.load(path)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path)
    raise CheckpointError(f"{path}: neither a .gguf file nor a folder with config.json")
