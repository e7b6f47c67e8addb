"""Triton's LLM tensor interface (the one its vLLM backend serves) over the engine.

Inputs: `text_input` (BYTES [1]), `stream` (BOOL [1], optional), `sampling_parameters`
(BYTES [1], a JSON object, optional), `exclude_input_in_output` (BOOL [1], optional),
`messages` (BYTES [1], optional: a JSON chat instead of text_input, made a prompt by the
model's own chat template, worker/llm/chat.py, with `tools` if sent, and never echoed),
`input_ids` (INT64 / INT32 [k], optional: a token-id prompt instead); the
sampling keys are also read from the request's `parameters` map, where the JSON wins.
Output: `text_output` (BYTES). Streaming sends each new piece of text; otherwise one
response holds the prompt (unless excluded) and the whole completion; with n > 1 choices,
one string per choice (common/llm_protocol.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from tokenizers import Tokenizer

from common import bytes_codec, llm_protocol, model_keys
from common.errors import InvalidArgument
from worker import token_metrics
from worker.config import ConfigError, ModelSpec
from worker.llm import prefix, sampling
from worker.llm.chat import ChatTemplate
from worker.llm.device import CUDA
from worker.llm.engine import Engine, EngineConfig, Output
from worker.llm.model import Model
from worker.llm.service_time import ServiceTime
from worker.llm.speculative import DraftConfig, NgramConfig, SpeculativeConfig

log = structlog.get_logger()

TEXT_INPUT, STREAM, SAMPLING, EXCLUDE_INPUT = (
    llm_protocol.TEXT_INPUT,
    llm_protocol.STREAM,
    llm_protocol.SAMPLING_PARAMETERS,
    llm_protocol.EXCLUDE_INPUT_IN_OUTPUT,
)
TEXT_OUTPUT = llm_protocol.TEXT_OUTPUT

DEFAULT_SPECULATIVE_TOKENS = 4
METHODS = ("draft_model", "ngram")


def _int(spec: ModelSpec, key: str, default: int) -> int:
    """An integer parameter of the config that is not an engine setting (those are read by
    EngineConfig.from_parameters): its value, or `default` when unset."""
    raw = spec.parameters.get(key)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ConfigError(
            f"model {spec.name!r}: parameter {key} must be a positive integer, got {raw!r}"
        )
    return int(raw)


@dataclass(frozen=True)
class LLMRequest:
    prompt_text: str
    prompt: list[int]
    params: sampling.SamplingParams
    stream: bool
    exclude_input: bool
    cache_salt: str = ""  # the request's cache_salt parameter: its own prefix cache partition
    tenant: str = ""  # whose request, and its weight: fair admission (worker/llm/fairness.py)
    weight: float = 1.0
    resume: list[int] = field(default_factory=list)  # llm_protocol.RESUME_TOKEN_IDS


@dataclass
class Completion:
    """A unary answer: each choice's text, finish reason and logprobs (when asked for), and
    the usage over all choices."""

    texts: list[str]
    reasons: list[str]
    logprobs: list[list[dict]] | None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # over all choices
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def engine_config(spec: ModelSpec, model: Model) -> EngineConfig:
    """The engine settings of a model's config (worker/llm/engine_config.py declares them),
    with this model's defaults for what the config leaves out."""
    p = spec.parameters
    f = model.facts
    per_token = f.cache_shape(1, 1).bytes_per_token
    raw_bytes = p.get(model_keys.KV_CACHE_BYTES)
    if raw_bytes is not None and not raw_bytes.isdigit():
        raise ConfigError(
            f"model {spec.name!r}: parameter {model_keys.KV_CACHE_BYTES} must be a positive "
            f"integer, got {raw_bytes!r}"
        )
    budget = int(raw_bytes) // per_token if raw_bytes is not None else EngineConfig.kv_cache_tokens
    if budget < 2:
        raise ConfigError(
            f"model {spec.name!r}: {model_keys.KV_CACHE_BYTES} holds fewer than 2 tokens"
        )
    chunk = p.get(model_keys.PREFILL_CHUNK, str(EngineConfig.prefill_chunk))
    unset = {
        "max_model_len": min(f.max_positions, budget),
        "kv_cache_tokens": budget,
        "max_waiting": spec.max_queue_size or EngineConfig.max_waiting,
    }
    if chunk.isdigit():
        unset["max_step_tokens"] = default_step_tokens(model.cache_device, int(chunk))
    try:
        return EngineConfig.from_parameters(spec.name, p, **unset)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def default_step_tokens(cache_device: str, prefill_chunk: int) -> int:
    """meshserve.max_step_tokens when the config leaves it unset. On the CPU a step's cost
    grows with its tokens, so a prompt's chunk is held to about 1.5 decode steps (EngineConfig);
    on a GPU a whole chunk costs about one decode step, so a step takes a whole chunk
    (docs/decisions.md, "A whole prefill chunk per step on a GPU")."""
    if cache_device == CUDA:
        return prefill_chunk
    return EngineConfig.max_step_tokens


def draft_path(spec: ModelSpec, model_dir: Path) -> Path | None:
    """The draft model's step graph named by the config, checked to exist; None: no draft."""
    name = spec.parameters.get(model_keys.DRAFT_MODEL)
    if not name:
        return None
    path = model_dir / name
    if not path.is_file():
        raise ConfigError(f"model {spec.name!r}: {model_keys.DRAFT_MODEL} {path} does not exist")
    return path


def speculative_config(spec: ModelSpec, draft: Model | None) -> SpeculativeConfig | None:
    """The config's speculative decoding: a draft model (the one loaded from
    meshserve.draft_model), n-gram lookup, or none."""
    p = spec.parameters
    method_key, draft_key = model_keys.SPECULATIVE_METHOD, model_keys.DRAFT_MODEL
    method = p.get(method_key, "draft_model" if draft_key in p else "")
    if method and method not in METHODS:
        raise ConfigError(
            f"model {spec.name!r}: {method_key} {method!r}: expected one of {METHODS}"
        )
    if method == "ngram" and draft_key in p:
        raise ConfigError(f"model {spec.name!r}: {method_key} 'ngram' takes no {draft_key}")
    k = _int(spec, model_keys.NUM_SPECULATIVE_TOKENS, DEFAULT_SPECULATIVE_TOKENS)
    if method and k < 1:
        raise ConfigError(f"model {spec.name!r}: {model_keys.NUM_SPECULATIVE_TOKENS} must be >= 1")
    if method == "ngram":
        default = NgramConfig()
        lo = _int(spec, model_keys.PROMPT_LOOKUP_MIN, default.min_n)
        hi = _int(spec, model_keys.PROMPT_LOOKUP_MAX, max(default.max_n, lo))
        try:
            return NgramConfig(k, lo, hi)
        except ValueError as e:
            raise ConfigError(
                f"model {spec.name!r}: {model_keys.PROMPT_LOOKUP_MIN} / "
                f"{model_keys.PROMPT_LOOKUP_MAX}: {e}"
            ) from e
    if draft is None:
        return None
    return DraftConfig(draft, k)


class LLMServing:
    def __init__(
        self, spec: ModelSpec, model: Model, model_dir: Path, draft: Model | None = None
    ) -> None:
        path = model_dir / spec.parameters.get(model_keys.TOKENIZER, "tokenizer.json")
        if not path.is_file():
            raise ConfigError(f"model {spec.name!r}: tokenizer {path} does not exist")
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.spec = spec
        self.chat = ChatTemplate.from_folder(model_dir, spec.name)
        self.config = engine_config(spec, model)
        try:
            self.engine = Engine(
                model, tokenizer, self.config, draft=speculative_config(spec, draft)
            )
        except ValueError as e:
            raise ConfigError(f"model {spec.name!r}: {e}") from e
        # Built here, before the worker serves: llguidance holds the GIL while it builds
        # (2.6 s for SmolLM2's vocabulary on a 2-core VM), which froze a serving worker's
        # loop past the router's stall probe when the first guided request built it.
        self.engine.vocab.ready()
        self.max_tokens_limit = _int(
            spec, model_keys.MAX_TOKENS_LIMIT, self.config.max_model_len - 1
        )
        self.prompt_tokens = 0  # of the requests admitted
        self.completion_tokens = 0  # generated and handed out
        self.service = ServiceTime()  # published for the routers' queue-wait prediction

    def parse(self, inputs: dict[str, np.ndarray], parameters: Mapping[str, Any]) -> LLMRequest:
        values = {k: v for k, v in parameters.items() if k in sampling.KEYS}
        if SAMPLING in inputs:
            values.update(sampling.parse_json(_text(inputs[SAMPLING], SAMPLING)))
        params = sampling.build(values, self.max_tokens_limit)
        text, prompt, chat = self._prompt(inputs)
        return LLMRequest(
            prompt_text=text,
            prompt=prompt,
            params=params,
            stream=_flag(inputs, STREAM),
            exclude_input=_flag(inputs, EXCLUDE_INPUT) or chat,
            cache_salt=_salt(parameters),
            tenant=_tenant(parameters),
            weight=_weight(parameters),
            resume=_resume(parameters),
        )

    def _prompt(self, inputs: dict[str, np.ndarray]) -> tuple[str, list[int], bool]:
        """The prompt's text and tokens, and whether it is a chat. text_input is the required
        input (a generic client such as perf_analyzer fills every input): when sent it is
        served, and its optional alternatives are read only in its absence, messages first."""
        if TEXT_INPUT not in inputs and llm_protocol.MESSAGES in inputs:
            text = self._chat(inputs)
            return text, self.engine.encode(text), True
        if TEXT_INPUT not in inputs and llm_protocol.INPUT_IDS in inputs:
            prompt = self._input_ids(inputs)
            return self.engine.tokenizer.decode(prompt, skip_special_tokens=False), prompt, False
        text = _text(inputs[TEXT_INPUT])
        return text, self.engine.encode(text), False

    def _input_ids(self, inputs: dict[str, np.ndarray]) -> list[int]:
        """A token-id prompt, checked: alone, [k] (or [1, k]), non-empty, ids in the
        vocabulary, shorter than max_model_len."""
        name = llm_protocol.INPUT_IDS
        ids = inputs[name]
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgument(
                f"input {name!r}: a non-empty list of token ids [k] expected, got shape "
                f"{list(inputs[name].shape)}"
            )
        vocab, limit = self.engine.model.facts.vocab_size, self.config.max_model_len
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise InvalidArgument(
                f"input {name!r}: token id {int(ids[bad[0]])} at position {int(bad[0])} is "
                f"outside the vocabulary 0..{vocab - 1}"
            )
        if ids.size >= limit:
            raise InvalidArgument(
                f"input {name!r}: {ids.size} tokens; max_model_len is {limit} (prompt + "
                f"generated tokens), so at most {limit - 1}"
            )
        return [int(t) for t in ids]

    def _chat(self, inputs: dict[str, np.ndarray]) -> str:
        """The prompt of a chat: its messages through the model's own template."""
        if self.chat is None:
            raise InvalidArgument(
                f"model {self.spec.name!r} has no chat template (no chat_template in its "
                "tokenizer_config.json): send text_input instead of messages"
            )
        messages = _json(inputs, llm_protocol.MESSAGES)
        tools = _json(inputs, llm_protocol.TOOLS) if llm_protocol.TOOLS in inputs else None
        return self.chat.render(messages, tools)

    async def generate(self, request: LLMRequest) -> AsyncIterator[Output]:
        """The request's outputs, every choice's, in the order they come; each carries the
        completion tokens over all choices so far (what is billed), and the last is `final`."""
        params = request.params
        root = prefix.root_key(self.spec.name, self.spec.version, "", request.cache_salt)
        seqs = self.engine.add_choices(
            request.prompt,
            params,
            root,
            tenant=request.tenant,
            weight=request.weight,
            resume=request.resume,
        )
        self.prompt_tokens += len(request.prompt)
        clock = token_metrics.TokenClock(self.spec.name)
        counts = [0] * len(seqs)
        async for out in self.engine.stream(seqs):
            counts[out.index] = out.completion_tokens
            out.completion_tokens = sum(counts)
            self.completion_tokens += clock.observe(out.completion_tokens)
            first = seqs[0]
            if out.final and first.admitted_ns and out.error is None:
                self.service.observe((time.perf_counter_ns() - first.admitted_ns) / 1e9)
            yield out

    def service_rate(self) -> tuple[int, float]:
        """(slots, requests finished per second): with requests waiting, the rate at the
        concurrency running now (the KV budget may hold it under the slots); else at every
        slot's."""
        slots = self.config.max_num_seqs
        engine = self.engine
        busy = max(1, len(engine.running)) if engine.waiting else slots
        return slots, self.service.rate(busy)

    async def complete(self, request: LLMRequest) -> Completion:
        """The whole answer: each choice's text, the prompt first, as Triton's vLLM backend
        answers, unless excluded or the client asked for a stream (a streamed text never
        repeats the prompt, also when it arrives as one piece through a unary hop)."""
        n = request.params.n
        echo = "" if request.exclude_input or request.stream else request.prompt_text
        pieces: list[list[str]] = [[echo] for _ in range(n)]
        reasons = [""] * n
        logprobs: list[list[dict]] | None = None
        if request.params.logprobs is not None:
            logprobs = [[] for _ in range(n)]
        done = Completion([], reasons, logprobs)
        async for out in self.generate(request):
            pieces[out.index].append(out.text)
            if logprobs is not None and out.logprobs:
                logprobs[out.index].extend(out.logprobs)
            if out.finished:
                reasons[out.index] = out.finish_reason or ""
            if out.error is not None:
                done.errors.append(out.error)
            done.prompt_tokens, done.cached_tokens = out.prompt_tokens, out.cached_tokens
            done.completion_tokens = out.completion_tokens
        done.texts = ["".join(p) for p in pieces]
        return done


def _json(inputs: dict[str, np.ndarray], name: str) -> Any:
    try:
        return json.loads(_text(inputs[name], name))
    except ValueError as e:
        raise InvalidArgument(f"input {name!r} is not JSON: {e}") from None


def _text(array: np.ndarray, name: str = TEXT_INPUT) -> str:
    if array.size != 1:
        raise InvalidArgument(f"input {name!r}: one string expected, got {array.size} elements")
    return bytes_codec.text(array.reshape(-1)[0], name)


def _salt(parameters: Mapping[str, Any]) -> str:
    """The request's cache_salt (a string of at most MAX_CACHE_SALT characters), "" none."""
    salt = parameters.get(llm_protocol.CACHE_SALT)
    if salt is None:
        return ""
    if not isinstance(salt, str) or len(salt) > llm_protocol.MAX_CACHE_SALT:
        raise InvalidArgument(
            f"parameter {llm_protocol.CACHE_SALT!r}: a string of at most "
            f"{llm_protocol.MAX_CACHE_SALT} characters expected"
        )
    return salt


def _resume(parameters: Mapping[str, Any]) -> list[int]:
    """The ids a resumed generation had produced (llm_protocol.RESUME_TOKEN_IDS), [] none."""
    name = llm_protocol.RESUME_TOKEN_IDS
    value = parameters.get(name)
    if value is None:
        return []
    top = llm_protocol.MAX_RESUME_TOKEN_IDS
    expected = f"parameter {name!r}: a JSON list of at most {top} token ids expected"
    if not isinstance(value, str) or len(value) > top * llm_protocol.RESUME_ID_CHARS:
        raise InvalidArgument(expected)
    try:
        ids = json.loads(value)
    except ValueError:
        raise InvalidArgument(f"{expected}, got {value[:64]!r}") from None
    if not isinstance(ids, list) or len(ids) > top or not all(type(i) is int for i in ids):
        raise InvalidArgument(f"{expected}, got {value[:64]!r}")
    return ids


def _tenant(parameters: Mapping[str, Any]) -> str:
    tenant = parameters.get(llm_protocol.TENANT, "")
    if not isinstance(tenant, str) or len(tenant) > llm_protocol.MAX_TENANT:
        raise InvalidArgument(
            f"parameter {llm_protocol.TENANT!r}: a string of at most "
            f"{llm_protocol.MAX_TENANT} characters expected"
        )
    return tenant


def _weight(parameters: Mapping[str, Any]) -> float:
    weight = parameters.get(llm_protocol.TENANT_WEIGHT, 1.0)
    top = llm_protocol.MAX_TENANT_WEIGHT
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= top:
        raise InvalidArgument(
            f"parameter {llm_protocol.TENANT_WEIGHT!r}: a number in (0, {top:g}] expected"
        )
    return float(weight)


def _flag(inputs: dict[str, np.ndarray], name: str) -> bool:
    array = inputs.get(name)
    if array is None:
        return False
    if array.size != 1:
        raise InvalidArgument(f"input {name!r}: one BOOL expected, got {array.size} elements")
    return bool(array.reshape(-1)[0])
