"""Prometheus metrics of the worker (served on --metrics-port, 127.0.0.1 by default).

Most series are read at scrape time from what the worker counts anyway (Triton's statistics,
the batchers' queues, the LLM engines and their KV caches), so serving pays nothing for them.
Time to first token and inter-token latency are histograms observed as an LLM's pieces leave
the engine. Every label is a served model (and its version), so the series are bounded by the
repository.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.token_metrics import REGISTRY

if TYPE_CHECKING:
    from worker.repository import LoadedModel, Repository

    Roofline = Callable[[LoadedModel], dict[str, float]]

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
_LABELS = ("model", "version")


class RepositoryCollector(Collector):
    """Reads the repository at each scrape."""

    def __init__(self, repository: Repository, roofline: Roofline | None = None) -> None:
        self.repository = repository
        self.roofline = roofline

    def collect(self) -> Iterator[Metric]:
        models = self.repository.all()
        provider = ",".join(sorted(self.repository.providers))
        yield from _serving(models, provider)
        yield from _llm_engine(models)
        yield _roofline(models, self.roofline)
        yield from _prefix_cache(models)


def _serving(models: list[LoadedModel], provider: str) -> tuple[Metric, ...]:
    """Every model: loaded, its queue, its finished requests and Triton's batch statistics."""
    loaded = GaugeMetricFamily(
        "meshserve_worker_model_loaded",
        "1 for each model version loaded and serving, with the execution provider",
        labels=[*_LABELS, "provider"],
    )
    depth = GaugeMetricFamily(
        "meshserve_worker_queue_depth",
        "Requests waiting or running (an LLM engine: its sequences)",
        labels=_LABELS,
    )
    capacity = GaugeMetricFamily(
        "meshserve_worker_queue_capacity",
        "Requests the model accepts before answering RESOURCE_EXHAUSTED",
        labels=_LABELS,
    )
    requests = CounterMetricFamily(
        "meshserve_worker_requests",
        "Requests finished, by outcome",
        labels=[*_LABELS, "outcome"],
    )
    request_seconds = CounterMetricFamily(
        "meshserve_worker_request_seconds",
        "End-to-end time of finished requests in the worker, by outcome",
        labels=[*_LABELS, "outcome"],
    )
    phase_seconds = CounterMetricFamily(
        "meshserve_worker_phase_seconds",
        "Time requests spent queued and computing (Triton's statistics durations)",
        labels=[*_LABELS, "phase"],
    )
    inferences = CounterMetricFamily(
        "meshserve_worker_inferences",
        "Batch rows served (Triton's inference_count)",
        labels=_LABELS,
    )
    executions = CounterMetricFamily(
        "meshserve_worker_executions",
        "Model runs by the number of rows they served",
        labels=[*_LABELS, "batch_size"],
    )
    for model in models:
        key = _key(model)
        stats = model.stats
        loaded.add_metric([*key, provider], 1)
        depth.add_metric(key, model.depth)
        capacity.add_metric(key, model.max_queue_size)
        for outcome, d in (("success", stats.success), ("fail", stats.fail)):
            requests.add_metric([*key, outcome], d.count)
            request_seconds.add_metric([*key, outcome], d.ns / 1e9)
        for phase in PHASES:
            phase_seconds.add_metric([*key, phase], getattr(stats, phase).ns / 1e9)
        inferences.add_metric(key, stats.inference_count)
        for rows, b in sorted(stats.batches.items()):
            executions.add_metric([*key, str(rows)], b.compute_infer.count)
    return (
        loaded,
        depth,
        capacity,
        requests,
        request_seconds,
        phase_seconds,
        inferences,
        executions,
    )


def _llm_engine(models: list[LoadedModel]) -> tuple[Metric, ...]:
    """LLM models: KV cache, sequences, tokens and speculative decoding."""
    kv = GaugeMetricFamily(
        "meshserve_worker_kv_cache_tokens",
        "KV cache tokens: state=used (held by running sequences) or total (the budget)",
        labels=[*_LABELS, "state"],
    )
    sequences = GaugeMetricFamily(
        "meshserve_worker_sequences",
        "LLM sequences: state=running (hold a KV slot) or waiting (for KV room)",
        labels=[*_LABELS, "state"],
    )
    tokens = CounterMetricFamily(
        "meshserve_worker_tokens",
        "LLM tokens: kind=in (prompts admitted) or out (generated and sent)",
        labels=[*_LABELS, "kind"],
    )
    drafts = CounterMetricFamily(
        "meshserve_worker_speculative_tokens",
        "LLM speculative decoding: kind=proposed (by the draft model) or accepted (by the "
        "target); the acceptance rate is accepted / proposed",
        labels=[*_LABELS, "kind"],
    )
    acceptance = GaugeMetricFamily(
        "meshserve_worker_speculative_acceptance_rate",
        "Draft tokens the target accepted, as a fraction of those proposed since start",
        labels=_LABELS,
    )
    for model in models:
        if model.llm is None:
            continue
        key = _key(model)
        used, total = model.kv_tokens
        kv.add_metric([*key, "used"], used)
        kv.add_metric([*key, "total"], total)
        engine = model.llm.engine
        sequences.add_metric([*key, "running"], len(engine.running))
        sequences.add_metric([*key, "waiting"], len(engine.waiting))
        tokens.add_metric([*key, "in"], model.llm.prompt_tokens)
        tokens.add_metric([*key, "out"], model.llm.completion_tokens)
        if engine.drafter is not None:
            drafts.add_metric([*key, "proposed"], engine.stats.draft_tokens)
            drafts.add_metric([*key, "accepted"], engine.stats.accepted_tokens)
            acceptance.add_metric(key, engine.stats.acceptance_rate)
    return (kv, sequences, tokens, drafts, acceptance)


def _roofline(models: list[LoadedModel], roofline: Roofline | None) -> Metric:
    """Every model, when the worker was given a roofline: its figures against the roof."""
    roof = GaugeMetricFamily(
        "meshserve_worker_roofline",
        "Where the model runs against the roofline (worker/roofline.py): figure="
        "achieved_flops_per_s, achieved_bytes_per_s, compute_roof_fraction, "
        "bandwidth_roof_fraction, weight_bytes",
        labels=[*_LABELS, "figure"],
    )
    if roofline is not None:
        for model in models:
            for figure, value in roofline(model).items():
                roof.add_metric([*_key(model), figure], value)
    return roof


def _prefix_cache(models: list[LoadedModel]) -> tuple[Metric, ...]:
    """LLM models: the prefix cache's hits and misses, and the tokens it keeps."""
    prefix = CounterMetricFamily(
        "meshserve_worker_prefix_cache",
        "LLM prefix cache since start: kind=hits, misses (admitted sequences that reused a "
        "cached prefix, or not), cached_tokens (prompt tokens not prefilled), "
        "evicted_blocks",
        labels=[*_LABELS, "kind"],
    )
    prefix_held = GaugeMetricFamily(
        "meshserve_worker_prefix_cache_tokens",
        "LLM prefix cache: tokens of finished sequences kept for reuse (never reserved: "
        "admission evicts them before it waits)",
        labels=_LABELS,
    )
    for model in models:
        if model.llm is None:
            continue
        key = _key(model)
        p = model.llm.engine.kv.stats
        for kind in ("hits", "misses", "cached_tokens", "evicted_blocks"):
            prefix.add_metric([*key, kind], getattr(p, kind))
        prefix_held.add_metric(key, model.llm.engine.kv.retained_tokens)
    return (prefix, prefix_held)


def _key(model: LoadedModel) -> list[str]:
    return [model.spec.name, model.spec.version]


def serve(repository: Repository, port: int, host: str, roofline: Roofline | None = None) -> int:
    """Start the endpoint on a daemon thread; the port it bound (port 0: a free one)."""
    REGISTRY.register(RepositoryCollector(repository, roofline))
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)
