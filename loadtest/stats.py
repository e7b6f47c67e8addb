"""One run's outcome: an HDR histogram of latencies and the errors by gRPC status code."""

from __future__ import annotations

from collections import Counter

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour; anything slower is clamped
SIGNIFICANT_FIGURES = 3
PERCENTILES = {"p50_ms": 50.0, "p90_ms": 90.0, "p99_ms": 99.0, "p999_ms": 99.9}


class Recorder:
    def __init__(self) -> None:
        self.histogram = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_FIGURES)
        self.errors: Counter[str] = Counter()

    def ok(self, seconds: float) -> None:
        self.histogram.record_value(min(HIGHEST_US, max(LOWEST_US, round(seconds * 1e6))))

    def error(self, code: str) -> None:
        self.errors[code] += 1

    @property
    def count(self) -> int:
        return int(self.histogram.get_total_count())

    def percentile_ms(self, p: float) -> float | None:
        if not self.count:
            return None
        return round(self.histogram.get_value_at_percentile(p) / 1000, 3)

    def summary(self, seconds: float) -> dict:
        """Throughput counts successes over the measured seconds; errors are apart."""
        out: dict = {
            "requests": self.count,
            "throughput_rps": round(self.count / seconds, 1) if seconds > 0 else 0.0,
        }
        out.update({key: self.percentile_ms(p) for key, p in PERCENTILES.items()})
        out["mean_ms"] = round(self.histogram.get_mean_value() / 1000, 3) if self.count else None
        out["max_ms"] = round(self.histogram.get_max_value() / 1000, 3) if self.count else None
        out["errors"] = dict(self.errors)
        return out

    def cdf(self, ticks_per_half_distance: int = 4) -> list[list[float]]:
        """[percentile, ms] points, denser towards the tail (HDR's percentile iterator)."""
        if not self.count:
            return []
        points = [
            [round(item.percentile_level_iterated_to, 4), round(item.value_iterated_to / 1000, 3)]
            for item in self.histogram.get_percentile_iterator(ticks_per_half_distance)
        ]
        return [p for p in points if p[0] < 100.0] + [[100.0, self.summary(1)["max_ms"]]]
