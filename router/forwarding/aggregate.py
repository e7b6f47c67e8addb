"""Merging the replicas' answers into one: statistics summed, repository index united."""

from __future__ import annotations

from protos import grpc_service_pb2 as pb


def _add(total: pb.StatisticDuration, part: pb.StatisticDuration) -> None:
    total.count += part.count
    total.ns += part.ns


DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")


def sum_statistics(replies: list[pb.ModelStatisticsResponse]) -> pb.ModelStatisticsResponse:
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    for reply in replies:
        for s in reply.model_stats:
            key = (s.name, s.version)
            if key not in merged:
                merged[key] = pb.ModelStatistics(name=s.name, version=s.version)
            m = merged[key]
            m.last_inference = max(m.last_inference, s.last_inference)
            m.inference_count += s.inference_count
            m.execution_count += s.execution_count
            for name in DURATIONS:
                _add(getattr(m.inference_stats, name), getattr(s.inference_stats, name))
            batches = {b.batch_size: b for b in m.batch_stats}
            for b in s.batch_stats:
                if b.batch_size not in batches:
                    batches[b.batch_size] = m.batch_stats.add(batch_size=b.batch_size)
                for name in BATCH_DURATIONS:
                    _add(getattr(batches[b.batch_size], name), getattr(b, name))
    return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])
