"""worker/text.py with a word-level tokenizer and a fake batcher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from common import model_keys
from common.errors import InvalidArgument
from worker import config as cfg
from worker.text import BUCKET, TextModel, bucket

WORDS = ["[PAD]", "[UNK]", "hello", "world", "a", "b", "<|im_end|>"]


def model_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def spec(task: str) -> cfg.ModelSpec:
    t = cfg.TensorSpec
    inputs = {
        "input_ids": t("input_ids", "INT64", (-1,), True),
        "attention_mask": t("attention_mask", "INT64", (-1,), True),
        cfg.TEXT_INPUT: t(cfg.TEXT_INPUT, "BYTES", (1,), True),
    }
    outputs = {"sentence_embedding": t("sentence_embedding", "FP32", (4,))}
    return cfg.ModelSpec(
        "m",
        "1",
        inputs,
        outputs,
        8,
        True,
        0,
        (),
        8,
        1,
        {cfg.TOKENIZER: "tokenizer.json", cfg.TEXT_TASK: task},
    )


def texts(*items: str) -> np.ndarray:
    return np.array([[s.encode()] for s in items], dtype=object)


def test_bucket_rounds_up_to_multiples_of_16() -> None:
    assert [bucket(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]


def test_embed_tokenizes_and_right_pads_to_the_bucket(tmp_path: Path) -> None:
    seen = []

    async def submit(inputs, outputs):  # type: ignore[no-untyped-def]
        seen.append(inputs)
        return {"sentence_embedding": np.zeros((len(inputs["input_ids"]), 4), np.float32)}

    text = TextModel(spec("embed"), model_dir(tmp_path), submit)
    out = asyncio.run(
        text.infer({cfg.TEXT_INPUT: texts("hello world", "a")}, ["sentence_embedding"])
    )
    assert out["sentence_embedding"].shape == (2, 4)
    ids, mask = seen[0]["input_ids"], seen[0]["attention_mask"]
    assert ids.shape == (2, BUCKET)
    assert ids[0, :2].tolist() == [2, 3] and ids[1, :1].tolist() == [4]
    assert mask.sum(1).tolist() == [2, 1]
    # the tokens read, for OpenAI's embeddings usage: padding is not counted
    _, tokens = asyncio.run(
        text.infer_counted({cfg.TEXT_INPUT: texts("hello world", "a")}, ["sentence_embedding"])
    )
    assert tokens == 3


def test_token_ids_still_pass_straight_through(tmp_path: Path) -> None:
    async def submit(inputs, outputs):  # type: ignore[no-untyped-def]
        return {"sentence_embedding": inputs["input_ids"].astype(np.float32)}

    text = TextModel(spec("embed"), model_dir(tmp_path), submit)
    ids = np.ones((1, 4), np.int64)
    out = asyncio.run(text.infer({"input_ids": ids, "attention_mask": ids}, ["sentence_embedding"]))
    assert out["sentence_embedding"].shape == (1, 4)
    mask = np.array([[1, 1, 1, 0]], np.int64)
    _, tokens = asyncio.run(
        text.infer_counted({"input_ids": ids, "attention_mask": mask}, ["sentence_embedding"])
    )
    assert tokens == 3
    with pytest.raises(InvalidArgument, match="missing \\['attention_mask'\\]"):
        asyncio.run(text.infer({"input_ids": ids}, ["sentence_embedding"]))
    # A generic client fills every input: TEXT is served, token inputs beside it are not read.
    both = {cfg.TEXT_INPUT: texts("a"), "input_ids": ids * 7, "attention_mask": ids}
    out = asyncio.run(text.infer(both, ["sentence_embedding"]))
    np.testing.assert_array_equal(
        out["sentence_embedding"],
        asyncio.run(text.infer({cfg.TEXT_INPUT: texts("a")}, ["sentence_embedding"]))[
            "sentence_embedding"
        ],
    )


def test_text_generate_is_refused_with_a_pointer_to_the_llm_engine() -> None:
    from protos import model_config_pb2 as mc

    config = mc.ModelConfig(name="old")
    config.parameters[cfg.TOKENIZER].string_value = "tokenizer.json"
    config.parameters[cfg.TEXT_TASK].string_value = "generate"
    with pytest.raises(cfg.ConfigError, match="served by the LLM engine"):
        cfg.add_text_tensors(config)


def test_missing_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    async def submit(inputs, outputs):  # type: ignore[no-untyped-def]
        return {}

    with pytest.raises(cfg.ConfigError, match="does not exist"):
        TextModel(spec("embed"), tmp_path, submit)


def test_a_text_past_max_input_tokens_is_refused_by_name(tmp_path: Path) -> None:
    """Within meshserve.max_input_tokens the tokenizer's own truncation applies; past it the
    text is refused, naming the row and both numbers."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.enable_truncation(2)
    tok.save(str(tmp_path / "tokenizer.json"))

    async def submit(inputs, outputs):  # type: ignore[no-untyped-def]
        return {}

    s = spec("embed")
    s.parameters[model_keys.MAX_INPUT_TOKENS] = "4"
    text = TextModel(s, tmp_path, submit)
    ids, mask = text.encode(["a b a b"], left=False)
    assert mask.sum() == 2  # within the limit: truncated to the tokenizer's window
    with pytest.raises(InvalidArgument, match="row 1 is too large: 5 tokens; model 'm' takes"):
        text.encode(["a", "a b a b a"], left=False)
