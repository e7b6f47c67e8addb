"""benchmarks/llm.py's reading: ratios against llama.cpp and the targets, sentences made from
the numbers, and the concurrency plot."""

from __future__ import annotations

from pathlib import Path


def _level(system: dict, streams: int) -> dict:
    return next((p for p in system.get("concurrency", []) if p["streams"] == streams), {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def summary(systems: dict) -> tuple[dict, list[str]]:
    """Ratios against llama.cpp and the issue's targets; sentences made from the numbers."""
    lc, srv, ms = (systems.get(k, {}) for k in ("llamacpp", "llamacpp-server", "meshserve"))
    out: dict = {}
    lines: list[str] = []
    for name, s in systems.items():
        single_ = s.get("single")
        if single_:
            lines.append(
                f"{name}: decode {single_['decode_tokens_per_s']} tok/s single-stream, "
                f"prompt {single_['prompt_tokens_per_s_500']} tok/s (500) / "
                f"{single_['prompt_tokens_per_s_1500']} tok/s (1,500)"
            )
        for p in s.get("concurrency", []):
            lines.append(
                f"{name}: {p['streams']} streams -> {p['output_tokens_per_s']} output tok/s "
                f"aggregate, TTFT p50 {p['ttft_p50_ms']} ms / p99 {p['ttft_p99_ms']} ms, "
                f"ITL p50 {p['itl_p50_ms']} ms ({p['requests']} requests, {p['errors']} errors)"
            )
    one, eight = _level(srv, 1), _level(srv, 8)
    if one and eight:
        out["llamacpp_server_8_over_1"] = _ratio(
            eight["output_tokens_per_s"], one["output_tokens_per_s"]
        )
        lines.append(
            f"llama.cpp server: 8 streams give {out['llamacpp_server_8_over_1']}x the output "
            "tokens/s of 1 stream."
        )
    if lc.get("single") and srv.get("single"):
        out["llamacpp_server_over_inprocess_decode"] = _ratio(
            srv["single"]["decode_tokens_per_s"], lc["single"]["decode_tokens_per_s"]
        )
    if ms.get("single") and lc.get("single") and eight:
        m8 = _level(ms, 8)
        targets = {
            "decode_vs_llamacpp_inprocess": (
                _ratio(ms["single"]["decode_tokens_per_s"], lc["single"]["decode_tokens_per_s"]),
                1.0,
                ">=",
            ),
            "aggregate_8_vs_llamacpp_server": (
                _ratio(m8.get("output_tokens_per_s"), eight["output_tokens_per_s"]),
                3.0,
                ">=",
            ),
            "ttft_p50_8_vs_llamacpp_server": (
                _ratio(m8.get("ttft_p50_ms"), eight["ttft_p50_ms"]),
                0.5,
                "<=",
            ),
            "prompt_500_vs_llamacpp_inprocess": (
                _ratio(
                    ms["single"]["prompt_tokens_per_s_500"],
                    lc["single"]["prompt_tokens_per_s_500"],
                ),
                2.0,
                ">=",
            ),
        }
        out["targets"] = {}
        for key, (value, target, op) in targets.items():
            met = value is not None and (value >= target if op == ">=" else value <= target)
            out["targets"][key] = {"ratio": value, "target": f"{op} {target}", "met": met}
            lines.append(
                f"meshserve {key.replace('_', ' ')}: {value}x (target {op} {target}x): "
                + ("met" if met else "NOT met")
            )
    return out, lines


def plots(result: dict, folder: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(s.get("concurrency") for s in result["systems"].values()):
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system, s in result["systems"].items():
        points = s.get("concurrency") or []
        if not points:
            continue
        xs = [p["streams"] for p in points]
        axes[0].plot(xs, [p["output_tokens_per_s"] for p in points], "o-", label=system)
        axes[1].plot(xs, [p["ttft_p50_ms"] for p in points], "o-", label=system)
    axes[0].set(xlabel="concurrent streams", ylabel="output tokens/s", title="aggregate")
    axes[1].set(xlabel="concurrent streams", ylabel="ms", title="TTFT p50", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M Q4_1, {result['settings']['threads']} threads, noisy machine")
    fig.tight_layout()
    fig.savefig(folder / f"{name}_concurrency.png", dpi=90)
    plt.close(fig)
