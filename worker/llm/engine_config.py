"""The engine's settings, declared once: each field's default, what it trades, and the
config.pbtxt key that sets it (common/model_keys.py spells the keys). A model's config is
read by `EngineConfig.from_parameters`; nothing else lists the keys or the defaults."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common import model_keys


def _setting(default: Any, key: str | None = None, minimum: int = 1) -> Any:
    return field(default=default, metadata={"key": key, "minimum": minimum})


@dataclass(frozen=True)
class EngineConfig:
    # prompt + generated tokens of one sequence; unset in a config: the model's own context
    # (its graph's RoPE table), bounded by the KV budget
    max_model_len: int = _setting(2048, model_keys.MAX_MODEL_LEN)
    # sequences generating at once (cache slots): more rows per decode run, more KV memory
    max_num_seqs: int = _setting(32, model_keys.MAX_NUM_SEQS)
    # the KV budget in tokens, shared by running sequences (a config sets it in bytes,
    # meshserve.kv_cache_bytes, since a token's bytes depend on the model)
    kv_cache_tokens: int = _setting(16384)
    # prompt tokens of one sequence per step, at most
    prefill_chunk: int = _setting(512, model_keys.PREFILL_CHUNK)
    # decode rows + prefill tokens per step while streams decode: max(max_step_tokens,
    # step_tokens_per_row x decoding rows), so that a step with a prompt's chunk costs about
    # 1.5 decode steps of those rows (docs/decisions.md, "The step token budget")
    max_step_tokens: int = _setting(24, model_keys.MAX_STEP_TOKENS)
    step_tokens_per_row: int = _setting(4, model_keys.STEP_TOKENS_PER_ROW)
    # requests queued for admission; beyond: RESOURCE_EXHAUSTED (config: max_queue_size)
    max_waiting: int = _setting(256)
    # keep finished sequences' KV to reuse (worker/llm/kv_manager.py)
    prefix_caching: bool = _setting(True, model_keys.PREFIX_CACHING)
    # decode runs the step thread chains while no request arrives, ends or is cancelled
    # (vLLM's num_scheduler_steps); 1: the scheduler decides every step
    num_scheduler_steps: int = _setting(64, model_keys.NUM_SCHEDULER_STEPS)
    # free slots held back for a tenant that sent a request in the last RECENT_SECONDS and
    # runs nothing, so its next request starts without waiting for another tenant's to end
    # (worker/llm/fairness.py); 0: a backlogged tenant may take every slot
    reserved_slots: int = _setting(1, model_keys.RESERVED_SLOTS, minimum=0)
    # when a tenant running nothing finds no slot free (it was not seen lately, or no slot is
    # held), the newest sequence of a tenant running several is preempted: it recomputes its
    # prompt and tokens later, its stream paused, not cut (worker/llm/scheduler.py)
    fair_preemption: bool = _setting(True, model_keys.FAIR_PREEMPTION)

    @classmethod
    def keys(cls) -> dict[str, str]:
        """field name -> its config.pbtxt key, for the fields a config sets directly."""
        return {f.name: f.metadata["key"] for f in dataclasses.fields(cls) if f.metadata["key"]}

    @classmethod
    def from_parameters(
        cls, model: str, parameters: Mapping[str, str], **unset: Any
    ) -> EngineConfig:
        """The settings a model's config parameters give; `unset` are the defaults of this
        model for keys the config leaves out (e.g. max_model_len from its graph). A bad
        value raises ValueError naming the model, the key and what was expected."""
        values = dict(unset)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, key in cls.keys().items():
            if key not in parameters:
                continue
            raw = parameters[key]
            if fields[name].type in (bool, "bool"):
                if raw.lower() not in ("true", "false"):
                    raise ValueError(
                        f"model {model!r}: parameter {key} must be true or false, got {raw!r}"
                    )
                values[name] = raw.lower() == "true"
                continue
            least = fields[name].metadata["minimum"]
            if not raw.isdigit() or int(raw) < least:
                expected = "a positive integer" if least == 1 else f"an integer >= {least}"
                raise ValueError(
                    f"model {model!r}: parameter {key} must be {expected}, got {raw!r}"
                )
            values[name] = int(raw)
        return cls(**values)
