"""A GGUF's tokenizer as a Hugging Face `tokenizers.Tokenizer`, from its metadata.

Served: `tokenizer.ggml.model` "gpt2" (byte-level BPE from tokenizer.ggml.tokens and
merges), with the pre-tokenizer `tokenizer.ggml.pre` names: "smollm" (digits one by one,
then GPT-2's split), "qwen2" and "llama-bpe" (their own split patterns), or GPT-2's split for
any other name. A SentencePiece vocabulary ("llama") is refused: serve such a model from its
Hugging Face folder, whose tokenizer.json says exactly how it tokenizes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

MODELS = ("gpt2",)
CONTROL = 3  # tokenizer.ggml.token_type of a special token

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2, "llama-bpe": _LLAMA3}


class TokenizerError(Exception):
    """A GGUF tokenizer we cannot rebuild; the message names the key."""


def field(reader, key: str):  # type: ignore[no-untyped-def]
    """A GGUF metadata value (a GGUFReader's field's contents), or None when absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ]
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def tokenizer(reader, path: Path | str = "") -> Tokenizer:  # type: ignore[no-untyped-def]
    kind = field(reader, "tokenizer.ggml.model")
    if kind not in MODELS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model {kind!r} is not served from a GGUF (served: "
            f"{', '.join(MODELS)}); serve the model from its Hugging Face folder"
        )
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    if tokens is None or merges is None:
        missing = "tokenizer.ggml.tokens" if tokens is None else "tokenizer.ggml.merges"
        raise TokenizerError(f"{path}: GGUF metadata key {missing!r} is missing")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer(str(field(reader, "tokenizer.ggml.pre") or "default"))
    tok.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type")
    if types is not None:
        special = [t for t, kind in zip(tokens, types, strict=True) if int(kind) == CONTROL]
        tok.add_special_tokens(special)
    return tok


def tokenizer_config(reader) -> dict:  # type: ignore[no-untyped-def]
    """Hugging Face's tokenizer_config.json for the GGUF's tokenizer: its chat template
    (`tokenizer.chat_template`) and special tokens, which the worker renders chats with."""
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ):
        value = field(reader, key)
        if value is not None and 0 <= int(value) < len(tokens):
            config[name] = tokens[int(value)]
    template = field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config
