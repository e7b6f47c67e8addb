"""The Roofline plot: log-log FLOP/s against arithmetic intensity, the profile's roofs, and
each model's operating points (predicted, and measured when given)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from perfmodel.profiles import Profile
from perfmodel.roofline import Diagnosis


def roofline_png(
    profile: Profile,
    points: list[Diagnosis],
    path: Path,
    measured: list[tuple[str, float, float]] | None = None,
) -> Path:
    """`measured`: (label, intensity FLOP/B, achieved FLOP/s) from real runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = [p for p in points if p.intensity > 0 and p.flops > 0]
    intensities = [p.intensity for p in points] + [m[1] for m in measured or []]
    lo = min([0.1, *intensities]) / 2
    hi = max([10 * profile.ridge("int8"), *intensities]) * 2
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    bw = profile.bandwidth()
    for dtype, style in (("fp32", "-"), ("fp16", "--"), ("int8", ":")):
        if dtype == "fp16" and profile.flops.get("fp16") == profile.flops["fp32"]:
            continue
        peak = profile.peak(dtype)
        ax.plot(x, np.minimum(peak, bw * x), "k" + style, lw=1.2, label=f"roof {dtype}")
    if profile.cache_bandwidth:
        peak = profile.peak("fp32")
        ax.plot(
            x,
            np.minimum(peak, profile.cache_bandwidth * x),
            color="0.6",
            lw=1,
            label="roof fp32, weights in LLC",
        )
    markers = "osD^v<>p*h"
    groups = sorted({(p.model, p.recipe) for p in points})
    for i, (model, recipe) in enumerate(groups):
        mine = sorted(
            (p for p in points if (p.model, p.recipe) == (model, recipe)), key=lambda p: p.batch
        )
        ax.plot(
            [p.intensity for p in mine],
            [p.attained_flops for p in mine],
            marker=markers[i % len(markers)],
            ls="-",
            alpha=0.8,
            label=f"{model} {recipe}",
        )
        for p in mine:
            ax.annotate(
                f"b{p.batch}",
                (p.intensity, p.attained_flops),
                fontsize=7,
                xytext=(3, -9),
                textcoords="offset points",
            )
    for label, intensity, achieved in measured or []:
        ax.plot([intensity], [achieved], "rx", ms=8)
        ax.annotate(
            label,
            (intensity, achieved),
            fontsize=7,
            color="r",
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP / byte)",
        ylabel="FLOP/s",
        title=f"Roofline: {profile.name}",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
