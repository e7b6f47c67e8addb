"""torch -> ONNX with torch.onnx.export (dynamo), dynamic batch, sequence and past axes.

Tensor names are the contract with the worker (worker/text.py) and the evaluator:
encoder  input_ids, attention_mask [batch, seq] int64 -> sentence_embedding [batch, hidden]
decoder  input_ids [batch, seq], attention_mask [batch, past + seq] int64,
         past_keys, past_values [batch, layers, kv_heads, past, head_dim] float32
         -> logits [batch, seq, vocab], present_keys, present_values
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from quantize.models import BertEncoder, LlamaDecoder

OPSET = 18
ENCODER_INPUTS = ("input_ids", "attention_mask")
ENCODER_OUTPUTS = ("sentence_embedding",)
DECODER_INPUTS = ("input_ids", "attention_mask", "past_keys", "past_values")
DECODER_OUTPUTS = ("logits", "present_keys", "present_values")
TWO_GB = 2**31


class ExportError(Exception):
    """The model did not export; the message says which model and why."""


def export(model: torch.nn.Module, path: Path) -> Path:
    """Export an encoder or decoder to one .onnx file at `path` (written only on success)."""
    dyn = torch.export.Dim.DYNAMIC
    if isinstance(model, BertEncoder):
        args: tuple = (
            torch.randint(0, model.config.vocab_size, (2, 7)),
            torch.ones(2, 7, dtype=torch.int64),
        )
        names: tuple[tuple[str, ...], tuple[str, ...]] = (ENCODER_INPUTS, ENCODER_OUTPUTS)
        shapes: tuple = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    elif isinstance(model, LlamaDecoder):
        c = model.config
        past = torch.zeros(2, c.layers, c.kv_heads, 3, c.head_dim)
        args = (
            torch.randint(0, c.vocab_size, (2, 5)),
            torch.ones(2, 8, dtype=torch.int64),
            past,
            past.clone(),
        )
        names = (DECODER_INPUTS, DECODER_OUTPUTS)
        cache = {0: dyn, 3: dyn}
        shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, cache, cache)
    else:
        raise ExportError(f"cannot export {type(model).__name__}: not an encoder or decoder")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        staged = Path(tmp) / path.name
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                program = torch.onnx.export(
                    model.eval(),
                    args,
                    input_names=list(names[0]),
                    output_names=list(names[1]),
                    dynamic_shapes=shapes,
                    opset_version=OPSET,
                    dynamo=True,
                    optimize=True,
                    verbose=False,
                )
            assert program is not None
            program.save(str(staged), external_data=False)
        except Exception as e:
            raise ExportError(f"{type(model).__name__} did not export to ONNX: {e}") from e
        if staged.stat().st_size >= TWO_GB:
            raise ExportError(f"{path.name} is over 2 GB; one-file export cannot hold it")
        onnx.checker.check_model(str(staged))
        staged.replace(path)
    return path
