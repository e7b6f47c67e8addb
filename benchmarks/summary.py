"""Render benchmarks/README.md from benchmarks/results/*.json (run by `make bench`)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import readings

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def worker_section(r: dict) -> str:
    rows = []
    for key, points in r["results"].items():
        for p in points:
            rows.append([key, p["concurrency"], p["throughput_rps"], p["p50_ms"], p["p99_ms"]])
    s = r["summary"]
    return "\n\n".join(
        [
            "## Worker: tiny MLP, batching on vs off, against a bare grpc.aio server",
            f"`python -m benchmarks.worker` — {r['model']}; closed loop, "
            f"{r['seconds_per_point']} s per point. `bare_grpc_aio` is the floor: one "
            "onnxruntime session behind a grpc.aio ModelInfer with no validation, batching, "
            "statistics or health.",
            table(["server/model", "concurrency", "req/s", "p50 ms", "p99 ms"], rows),
            "Worker with batching over the bare server: "
            + ", ".join(
                f"{c}: {v['batching_over_bare']}x" for c, v in s.items() if c.startswith("c")
            )
            + ".",
            delay_text(s),
        ]
    )


def delay_text(s: dict) -> str:
    """The 500 us delay applied only while a batch runs against waiting it out when idle."""
    if "target" not in s:
        return ""
    rows = [
        [
            c,
            v["delay_p50_ms"],
            v["delay_when_idle_p50_ms"],
            v["bare_p50_ms"],
            f"{v['delay_p50_over_bare']}x",
            v["delay_rps"],
            v["delay_when_idle_rps"],
            f"{v['delay_rps_over_when_idle']}x",
        ]
        for c, v in s.items()
        if c.startswith("c")
    ]
    header = ["c", "p50 ms now", "p50 ms waiting when idle", "p50 ms bare", "now / bare"]
    header += ["req/s now", "req/s waiting when idle", "now / waiting"]
    met = "met" if s["target"]["met"] else "not met"
    return "\n\n".join(
        [
            "Batching delay 500 us (the toy `mlp`'s): applied only while a batch runs (now) "
            "against waited out even when idle (`meshserve.batch_delay_when_idle`, the rule "
            "before).",
            table(header, rows),
            f"Target ({s['target']['rule']}): {met}.",
        ]
    )


def router_scale_section(r: dict) -> str:
    rows = [
        [
            label,
            p["concurrency"],
            p["throughput_rps"],
            p["p50_ms"],
            p["p99_ms"],
            p.get("proxy_cpu_us_per_call"),
            p["cpu_cores"],
        ]
        for label, points in r["results"].items()
        for p in points
    ]
    s = r["summary"]
    ratios = [
        [
            c,
            v.get("python-floor_over_nginx_rps"),
            v["router-1_over_nginx_rps"],
            v["router-2_over_nginx_rps"],
            v.get("router-1_over_floor_rps"),
            v.get("router-2_over_floor_rps"),
            v["router-1_over_nginx_p50"],
            v["router-2_over_nginx_p50"],
        ]
        for c, v in s.items()
        if c.startswith("c")
    ]
    met = "met" if s["target"]["met"] else "not met"
    return "\n\n".join(
        [
            "## Router processes against nginx as a gRPC proxy",
            f"`python -m benchmarks.router_scale` — {r['model']}; {r['client']}, "
            f"{r['seconds_per_point']} s per point. direct: the client balances itself; nginx: "
            "`grpc_pass`, 2 worker processes; python-floor: grpc.aio passing bytes on and "
            "nothing else (benchmarks/bare_proxy.py); router-N: `python -m router --processes "
            "N` with p2c and accounting. CPU in cores per part; proxy CPU per call in us.",
            table(["path", "c", "req/s", "p50 ms", "p99 ms", "proxy us/call", "CPU cores"], rows),
            table(
                [
                    "c",
                    "floor / nginx req/s",
                    "router-1 / nginx req/s",
                    "router-2 / nginx req/s",
                    "router-1 / floor req/s",
                    "router-2 / floor req/s",
                    "router-1 / nginx p50",
                    "router-2 / nginx p50",
                ],
                ratios,
            ),
            f"Target ({s['target']['rule']}): {met}.",
        ]
    )


def idle_section(r: dict) -> str:
    rows = [
        [phase, part, v["before"], v["after"]]
        for phase, parts in r["summary"].items()
        for part, v in parts.items()
    ]
    f = r["refresh"]
    return "\n\n".join(
        [
            "## Idle cost: registry pushed (pub/sub) against polled",
            f"`python -m benchmarks.idle` — one real worker and a router, before (`"
            f"{r['baseline_ref'][:10]}`) and after, CPU in {r['cpu_unit']} over "
            f"{r['seconds_per_phase']} s per phase.",
            table(["phase", "process", "before", "after"], rows),
            f"One full registry read with 100 registered workers: {f['refresh_ms']} ms, "
            "timed in the benchmark's own process beside the fakes' writer thread (an upper "
            f"bound: the phases above measure the router itself); the router did "
            f"{f['before_per_s']:g} a second before, {f['after_per_s']:g} now.",
        ]
    )


def router_hop_text(r: dict) -> str:
    s = r["summary"]
    return (
        f"p50 ratio at c=1: **{s['hop_p50_ratio_c1']}x**; throughput ratio at c=32: "
        f"**{s['hop_throughput_ratio_c32']}x**. `bare_proxy` is the floor for any Python "
        "router: grpc.aio passing the bytes to one upstream with no balancing, accounting, "
        "metrics or failover. " + readings.hop_reading(r["hop"], r["machine"]["cores"])
    )


def router_section(r: dict) -> str:
    h = r["hop"]
    hop_rows = [
        [label, c, h[label][c]["throughput_rps"], h[label][c]["p50_ms"], h[label][c]["p99_ms"]]
        for label in ("direct", "bare_proxy", "router")
        for c in ("c1", "c32")
    ]
    rep_rows = [
        [
            label,
            p["workers"],
            p["offered_rps"],
            p["throughput_rps"],
            p["p50_ms"],
            p["p99_ms"],
            " / ".join(str(x) for x in p["per_worker_rps"]),
        ]
        for label, points in r["replicas"].items()
        for p in points
    ]
    pol_rows = [
        [
            p["policy"],
            p["offered_rps"],
            p["p50_ms"],
            p["p99_ms"],
            f"{p['slow_share']:.1%}",
            p["errors"] or "-",
        ]
        for p in r["policies"]
    ]
    enc_rows = [[k, v["header_parse_us"], v["decode_encode_us"]] for k, v in r["reencode"].items()]
    parts = [
        "## Router",
        "`python -m benchmarks.router` — client, router, Redis and workers share the machine.",
        "### (a) The hop: client -> router -> worker vs client -> worker (tiny MLP)",
        table(["path", "concurrency", "req/s", "p50 ms", "p99 ms"], hop_rows),
        router_hop_text(r),
        "### (b) More replicas at a fixed offered load (open loop, Poisson arrivals)",
        table(
            [
                "model",
                "workers",
                "offered rps",
                "served rps",
                "p50 ms",
                "p99 ms",
                "rps per worker",
            ],
            rep_rows,
        ),
        " ".join(readings.replicas_reading(k, v) for k, v in r["replicas"].items()),
        readings.client_limited_reading(
            [
                (f"{label}, {p['workers']} workers", p)
                for label, points in r["replicas"].items()
                for p in points
            ]
            + [(f"policy {p['policy']}", p) for p in r["policies"]]
        ),
        "![replicas](results/router_replicas.png)",
        "### (c) Policies, one of three replicas 4x slower, ~80% of capacity",
        table(
            ["policy", "offered rps", "p50 ms", "p99 ms", "slow replica's share", "errors"],
            pol_rows,
        ),
        readings.policies_reading(r["policies"]),
        "![policies](results/router_policies.png)",
        "### (d) Forwarding bytes untouched vs decoding and re-encoding the request",
        table(["request size", "header parse (us)", "full decode + encode (us)"], enc_rows),
    ]
    return "\n\n".join(x for x in parts if x)


def mlserver_section(r: dict) -> str:
    names = {
        "worker": "meshserve worker (1 process)",
        "mlserver": "MLServer, parallel_workers=0",
        "router_2_workers": "meshserve router + 2 workers",
        "mlserver_2_workers": "MLServer, parallel_workers=2",
    }
    rows = [
        [
            names.get(key, key),
            p["concurrency"],
            p["throughput_rps"],
            p["p50_ms"],
            p["p99_ms"],
            p["errors"] or "-",
        ]
        for key, points in r["results"].items()
        for p in points
    ]
    ratio_rows = [
        [
            names[key.split("_over_")[0]],
            names[key.split("_over_")[1].rsplit("_c", 1)[0]],
            key.rsplit("_c", 1)[1],
            v["throughput_ratio"],
            v["p99_ratio"],
        ]
        for key, v in r["summary"].items()
        if isinstance(v, dict)
    ]
    c8 = r["summary"]["worker_over_mlserver_c8"]
    verdict = "met" if r["summary"]["target_met"] else "**not met**"
    worse = readings.mlserver_reading(r["summary"], names)
    return "\n\n".join(
        [
            "## Side by side with MLServer",
            f"`python -m benchmarks.mlserver` — {r['model']}; MLServer {r['mlserver']} in its "
            "own venv "
            "with a minimal onnxruntime runtime (`benchmarks/mlserver_runtime.py`), one "
            "onnxruntime thread per process on both sides; the same load tool (`loadtest`, "
            f"closed loop, {r['seconds_per_point']} s per point) drives both, with requests "
            "built from each server's model metadata. Load generator and servers share the "
            "machine.",
            table(["server", "concurrency", "req/s", "p50 ms", "p99 ms", "errors"], rows),
            table(
                ["meshserve", "MLServer", "concurrency", "throughput ratio", "p99 ratio"],
                ratio_rows,
            ),
            f"Target (worker >= 2x MLServer's throughput at c=8, p99 no worse): {verdict} — "
            f"{c8['throughput_ratio']}x the throughput at {c8['p99_ratio']}x the p99. " + worse,
            "![latency vs throughput](results/mlserver_latency.png)",
            "![latency CDF at c=8](results/mlserver_cdf_c8.png)",
        ]
    )


def accounting_pairs(a: dict) -> list[dict]:
    """[{"on": rps, "off": rps}, ...] in run order; results before pairs were recorded ran
    on, off, on, off."""
    if "pairs" in a:
        return list(a["pairs"])
    return [
        {"on": x, "off": y} for x, y in zip(a["runs_rps"]["on"], a["runs_rps"]["off"], strict=True)
    ]


def ledger_section(r: dict) -> str:
    a, e = r["accounting"], r.get("economics")
    pairs = accounting_pairs(a)
    stats = readings.paired_cost([p["on"] for p in pairs], [p["off"] for p in pairs])
    rows = [
        [i + 1, p.get("order", "on, off"), p["on"], p["off"], f"{cost:.1%}"]
        for i, (p, cost) in enumerate(zip(pairs, stats["cost_per_pair"], strict=True))
    ]
    if e is None:
        economics = ["The economics run was skipped (`--skip-economics`)."]
    else:
        exact = "the two are equal" if e["exact"] else "the two **differ**"
        economics = [
            f"Waves of load through the mesh with the ledger running (no failures injected): "
            f"the client saw {e['client_successes']:,} successes, the durable ledger holds "
            f"{e['durable_calls']:,}: {exact}.",
            "```\n" + e["text"] + "\n```",
            "![ledger](results/ledger.png)",
        ]
    return "\n\n".join(
        [
            "## Ledger: what exact accounting costs, and the economics after a load run",
            "`python -m benchmarks.ledger` — router saturation throughput (closed loop, c=32, "
            f"tiny MLP, 2 workers, {r['seconds_per_point']} s per run), accounting on (each "
            "success answered once its record is in Redis) vs `--no-accounting`, in "
            f"{len(pairs)} alternated pairs; cost per pair = 1 - on / off:",
            table(["pair", "order", "on req/s", "off req/s", "cost"], rows),
            readings.accounting_reading(stats),
            *economics,
        ]
    )


def quantize_section(r: dict) -> str:
    m = r["minilm_int8"]
    enc_rows = [
        [batch, v["fp32"], v["encoder-int8-dynamic"], f"{m['speedup'][batch]}x"]
        for batch, v in m["latency_ms"].items()
    ]
    dec_rows = []
    for recipe, d in r["smollm2"].items():
        x = d["metrics"]
        step = d["speedup"].get("batch_1", {}).get("decode_step_ms", "-")
        dec_rows.append(
            [
                recipe,
                d["verdict"],
                f"{x['top1_agreement']:.3f}",
                f"{x['kl_divergence']:.4f}",
                f"{x['greedy_match']:.2f}",
                d["size_ratio"],
                f"{step}x" if step != "-" else "-",
            ]
        )
    b = r["batching"]
    return "\n\n".join(
        [
            "## Quantization (real MiniLM and SmolLM2) and text batching",
            "`python -m benchmarks.quantize` — onnxruntime CPU, latency medians measured in "
            "alternation (fp32, quantized, fp32, ...), so other load hits both alike.",
            f"### MiniLM int8 dynamic vs fp32 (16-token sentences); mean cosine "
            f"{m['metrics']['mean_cosine']:.4f}, min {m['metrics']['min_cosine']:.4f}",
            table(["batch", "fp32 ms", "int8 ms", "speedup"], enc_rows),
            "### SmolLM2-135M recipes vs fp32 (gate: top-1 >= 0.9, KL <= 0.1, greedy >= 0.6)",
            table(
                ["recipe", "verdict", "top-1", "KL", "greedy", "size", "decode step b1"], dec_rows
            ),
            f"### Dynamic batching, MiniLM int8 from TEXT, concurrency {b['concurrency']}",
            table(
                ["config", "req/s", "p50 ms", "p99 ms"],
                [
                    [k, b[k]["throughput_rps"], b[k]["p50_ms"], b[k]["p99_ms"]]
                    for k in ("batching", "no_batching")
                ],
            ),
            f"Gain: **{b['gain']}x**.",
        ]
    )


def tp_section(r: dict) -> str:
    parts = [
        "## Tensor parallelism: TP1 vs TP2/TP3 on this CPU (gloo)",
        f"`python -m benchmarks.tp` — a fresh gloo group per point, median of {r['repeat']} "
        "forwards timed on rank 0: compute = onnxruntime segments, comm = collectives "
        "(including waiting for the slowest rank). TP1 runs as one process with every core "
        "and with one thread (the compute TP divides); TP N ranks have one thread each.",
    ]
    for model, label in (("minilm", "MiniLM, 32 tokens"), ("smollm2", "SmolLM2, 8 new tokens")):
        if model not in r:
            continue
        rows = [
            [
                batch.removeprefix("batch"),
                p["tp"],
                p["threads_per_rank"],
                p["total_ms"],
                p["compute_ms"],
                p["comm_ms"],
                f"{p['vs_tp1_all_cores']}x",
            ]
            for batch, points in r[model]["latency"].items()
            for p in points
        ]
        header = ["batch", "TP", "threads/rank", "total ms", "compute ms", "comm ms", "vs TP1"]
        bytes_ = ", ".join(
            f"{k}: {max(v) / 1e6:.0f} MB" for k, v in r[model]["weight_bytes_per_rank"].items()
        )
        err = max(r[model]["max_abs_diff_vs_tp1"].values(), default=0.0)
        parts += [
            f"**{label}** (max weight bytes per rank — {bytes_}; max |TP N - TP1| = {err:.1e})",
            table(header, rows),
        ]
    parts.append(readings.tp_reading(r))
    return "\n\n".join(parts)


def kv_balance_section(r: dict) -> str:
    s, load = r["summary"], r["setup"]["load"]
    rows = [
        [
            x["policy"],
            x["requests"],
            x["throughput_rps"],
            x["ttft_ms"]["p50"],
            x["ttft_ms"]["p99"],
            x["served_by_a"],
            x["served_by_b"],
        ]
        for x in r["runs"]
    ]
    ratio = s["kv_over_plain_p99"]
    verdict = "meets" if s["target_at_most_half_met"] else "misses"
    return "\n\n".join(
        [
            "## KV-aware balancing: one replica's KV cache nearly full",
            f"`python -m benchmarks.kv_balance` — 2 SmolLM2 replicas with "
            f"{s['kv_tokens_per_replica']} KV tokens each; a long generation pinned on A; "
            f"a closed loop of {load['concurrency']} callers through the router, "
            f"{load['seconds']} s per policy, {load['max_tokens']} tokens per request "
            "(on A/on B: requests each replica served). "
            f"Machine: {r['machine'].get('note', 'not noted')}.",
            table(
                ["policy", "requests", "req/s", "TTFT p50 ms", "TTFT p99 ms", "on A", "on B"],
                rows,
            ),
            f"TTFT p99 under KV-aware p2c is {ratio}x plain p2c's: it {verdict} the target "
            "of at most 0.5x."
            if ratio is not None
            else "No TTFT p99 under plain p2c: no ratio.",
            f"TTFT p50: {s['ttft_p50_ms_kv_p2c']} ms under KV-aware p2c, "
            f"{s['ttft_p50_ms_plain_p2c']} ms under plain p2c "
            f"({round(s['ttft_p50_ms_kv_p2c'] / s['ttft_p50_ms_plain_p2c'], 2)}x).",
        ]
    )


def llm_section(r: dict) -> str:
    systems = {k: v for k, v in r["systems"].items() if v.get("single")}
    single_rows = [
        [
            name,
            s["single"]["decode_tokens_per_s"],
            s["single"]["itl_ms"],
            s["single"]["prompt_tokens_per_s_500"],
            s["single"]["prompt_tokens_per_s_1500"],
            _rss(s.get("rss_mb", {})),
            s.get("load", {}).get("before", {}).get("load_avg", ["?"])[0],
        ]
        for name, s in systems.items()
    ]
    level_rows = [
        [
            name,
            p["streams"],
            p["requests"],
            p["output_tokens_per_s"],
            p["ttft_p50_ms"],
            p["ttft_p99_ms"],
            p["itl_p50_ms"],
            p["errors"],
        ]
        for name, s in systems.items()
        for p in s.get("concurrency", [])
    ]
    skipped = [
        f"{k}: {v.get('skipped') or v.get('error')}"
        for k, v in r["systems"].items()
        if not v.get("single")
    ]
    parts = [
        "## LLM serving: llama.cpp vs meshserve (SmolLM2-135M, the shipped Q4_1 GGUF)",
        f"`python -m benchmarks.llm` — {r['note']} Settings: {r['settings']}.",
        table(
            [
                "system",
                "decode tok/s",
                "ITL ms",
                "prompt tok/s (500)",
                "prompt tok/s (1,500)",
                "RSS MB",
                "load before",
            ],
            single_rows,
        ),
        table(
            [
                "system",
                "streams",
                "requests",
                "output tok/s",
                "TTFT p50",
                "TTFT p99",
                "ITL p50",
                "errors",
            ],
            level_rows,
        ),
    ]
    if skipped:
        parts.append("Not measured: " + "; ".join(skipped) + ".")
    if "genai_perf" in r:
        g = r["genai_perf"]
        parts.append("genai-perf: " + (g.get("error") or json.dumps(g)[:400]))
    parts.append("\n".join(f"- {line}" for line in r["reading"]))
    return "\n\n".join(parts)


def llm_int4_section(r: dict) -> str:
    rows = [
        [
            name,
            g["verdict"],
            g["metrics"]["top1_agreement"],
            g["metrics"]["kl_divergence"],
            g["metrics"]["greedy_match"],
            f"{g['bytes'] / 1e6:.0f}",
        ]
        for name, g in r["gate"].items()
    ]
    w = r["weights"]
    return "\n\n".join(
        [
            "## SmolLM2 int4: the GGUF's own Q4_1 blocks vs re-quantizing them",
            f"`python -m benchmarks.llm_int4` — {r['note']}. MatMul weights as the recipe "
            f"writes them: {w['codecs']}, max |dW| per kind {w['max_abs_error']}; MatMul "
            f"bytes {w['matmul_bytes_fp32'] / 1e6:.0f} MB fp32 -> "
            f"{w['matmul_bytes_after'] / 1e6:.0f} MB.",
            table(["variant", "gate", "top-1", "KL", "greedy match", "file MB"], rows),
            "\n".join(f"- {line}" for line in r["reading"]),
        ]
    )


def llm_speculative_section(r: dict) -> str:
    rows = [
        [
            name,
            "-" if v["acceptance_rate"] is None else v["acceptance_rate"],
            "-" if v["tokens_per_target_run"] is None else v["tokens_per_target_run"],
            v["decode_tokens_per_s"],
            f"{v['decode_speedup']}x",
            v["draft_share_of_decode"],
            "yes" if v["identical_to_target"] else "no",
        ]
        for name, v in r["results"].items()
    ]
    s = r["settings"]
    return "\n\n".join(
        [
            f"## LLM: speculative decoding with a draft model ({s['target_kind']} target)",
            f"`{r['command'].strip()}` — target `{s['target']}`, drafts "
            + ", ".join(f"{n}: `{p}`" for n, p in s["drafts"].items())
            + f"; batch {s['batch']}, {s['sampling']}, {len(s['prompts'])} prompts of up to "
            f"{s['max_tokens']} new tokens, median of {s['rounds']} rounds, "
            f"{s['intra_op_threads']} intra-op threads; loadavg {' '.join(r['loadavg_before'])} "
            f"before, {' '.join(r['loadavg_after'])} after.",
            table(
                [
                    "configuration",
                    "acceptance",
                    "tokens per target run",
                    "decode tok/s",
                    "speed-up",
                    "draft share of decode time",
                    "same text as the target",
                ],
                rows,
            ),
            "\n".join(f"- {line}" for line in r["reading"]),
        ]
    )


def llm_genai_perf_section(r: dict) -> str:
    g = r.get("genai_perf", {})
    if "error" in g:
        return f"## genai-perf against meshserve\n\nnot measured: {g['error']}"
    rows = [
        [k, g[k]["unit"], *(round(g[k][q], 1) if q in g[k] else "-" for q in ("avg", "p50", "p99"))]
        for k in (
            "time_to_first_token",
            "inter_token_latency",
            "output_token_throughput",
            "request_throughput",
            "input_sequence_length",
            "output_sequence_length",
        )
        if k in g
    ]
    return "\n\n".join(
        [
            "## genai-perf against meshserve (its own report)",
            "`python -m benchmarks.llm --systems --genai-perf ...` ran "
            f"`genai-perf {g['command']}`",
            table(["metric", "unit", "avg", "p50", "p99"], rows),
        ]
    )


def planner_section(r: dict) -> str:
    def pct(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:+.0%}"

    def ms(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:.1f}"  # the queue never settles

    rows = []
    for c in r["configurations"]:
        m, roof, cal = c["measured"], c["roofline"], c["calibrated"]
        served = c.get("served", cal)
        rows.append(
            [
                c["config"],
                c["diagnosis"]["bound"],
                round(m["throughput_rps"], 2),
                f"{roof['capacity_rps']:.1f} ({pct(roof['throughput_error'])})",
                f"{cal['capacity_rps']:.1f} ({pct(cal['throughput_error'])})",
                f"{served['capacity_rps']:.1f} ({pct(served['throughput_error'])}, "
                f"{served['limit']})",
                round(m["offered_rps"], 2),
                round(m["p99_ms"], 1),
                f"{ms(roof['p99_ms'])} ({pct(roof['p99_error'])})",
                f"{ms(cal['p99_ms'])} ({pct(cal['p99_error'])})",
                f"{ms(served['p99_ms'])} ({pct(served['p99_error'])})",
                f"{m['closed']['mean_batch']:.1f} / {m['open']['mean_batch']:.1f}",
                m.get("background_cores", 0.0),
                f"{m['closed'].get('other_cores', 0.0):.2f} / "
                f"{m['open'].get('other_cores', 0.0):.2f}",
            ]
        )
    s = r["summary"]

    def verdict(m: dict, label: str) -> str:
        return f"{label}: " + ", ".join(
            f"{k} median |error| {m[f'median_abs_{k}_error']:.0%} (target "
            f"{s['targets'][k]:.0%}: {'met' if m['met'][k] else 'missed'})"
            for k in ("throughput", "p99")
        )

    calibrations = "; ".join(
        f"{k}: {v['runs_ms']} ms by batch, {v['call_overhead_ms']} ms fixed per run, "
        f"efficiency {v['efficiency']}"
        + (f", prefill {v['prefill_ms']} ms" if v["prefill_ms"] else "")
        for k, v in r["calibrations"].items()
    )

    def tail(v: dict) -> str:
        points = v["served"][-1].get("tail") or []
        return (
            ", trip tail "
            + ", ".join(
                f"p99 {p99 * 1e3:.0f} ms at {rate:.0f}/s ({busy:.2f} cores busy)"
                for busy, p99, rate in points
            )
            if points
            else ""
        )

    servings = "; ".join(
        f"{k}: {v['cycles_ms']} ms per batch by batch{tail(v)}"
        for k, v in r.get("servings", {}).items()
    )
    p = r["profile"]
    misses = [
        f"- **{c['config']}**: " + "; ".join(c["explanation"])
        for c in r["configurations"]
        if c["explanation"]
    ]
    return "\n\n".join(
        [
            "## Planner: predicted against measured (issue 14)",
            f"`python -m benchmarks.planner` — {r['machine_note']}. Profile: {p['source']}; "
            f"mesh {p['mesh_latency_s'] * 1e3:.1f} ms (p99 {p['mesh_latency_p99_s'] * 1e3:.1f} "
            f"ms at a quarter of its top rate) and {p['mesh_cpu_s'] * 1e3:.2f} CPU-ms per call, "
            f"at most {p['mesh_max_rps']:.0f} calls/s. Throughput: the saturation throughput of "
            "a closed loop with 4 x replicas x max batch callers (8 to 64); p99: an open loop at "
            "half the measured throughput (offered /s). *Roofline*: predicted from the probe "
            "and the graph alone; *calibrated*: the Roofline fitted to each model's own "
            "session timed alone, outside the mesh (CPU time, one thread, batch 1 and the "
            f"largest): {calibrations}; *served*: fitted to each encoder served through a "
            "one-worker mesh (planner/serving.py; seconds per batch and host CPU per call at "
            "saturation at batch limits 2 and 16, which no checked row uses, and the trip's "
            f"tail under Poisson arrivals at a quarter, half and three quarters of the 16's "
            f"rate): {servings}; the LLM rows' *served* is "
            "the calibrated prediction. Batch: what the workers formed in the closed / open "
            "loop. Background: other jobs' CPU demand (cores) measured just before each row; "
            "other: their cores during the closed / open loop (the host's busy cores less ours)."
            + (f" The {r['reanalysed']}." if r.get("reanalysed") else ""),
            table(
                [
                    "configuration",
                    "bound",
                    "req/s",
                    "roofline",
                    "calibrated",
                    "served",
                    "offered /s",
                    "p99 ms",
                    "roofline",
                    "calibrated",
                    "served",
                    "batch",
                    "background",
                    "other",
                ],
                rows,
            ),
            verdict(s["roofline"], "Roofline only")
            + "; "
            + verdict(s["calibrated"], "calibrated")
            + (("; " + verdict(s["served"], "served")) if "served" in s else "")
            + ".",
            "Misses of the best prediction and why:\n\n" + "\n".join(misses)
            if misses
            else "No misses.",
            "![roofline](results/planner_roofline.png)",
        ]
    )


def distill_section(r: dict) -> str:
    parts = [
        "## Distillation beside quantization (teacher vs student, fp32 vs int8)",
        "`python -m benchmarks.distill` — onnxruntime CPU, the four files measured in "
        "alternation; gate metrics against the fp32 teacher, each judged by its own recipe's "
        "gate (int8: the quantization gate; students: the distillation gate).",
    ]
    for model, m in r["models"].items():
        s = m["student"]
        resumed = s.get("resumed_from_step", 0)
        timed = f" (this build resumed its checkpoint at step {resumed})" if resumed else ""
        repeats = f", median of {m['repeats']} runs" if m.get("repeats") else ""
        parts.append(
            f"### {model}: {s['plan']['layers']}-layer student (layers {s['kept_layers']} of "
            f"the teacher), {s['plan']['steps']} steps of {s['plan']['batch']} on "
            f"{s['texts']} sentences, {s['train_seconds']} s of training on "
            f"{s['torch_threads']} torch threads{timed}; "
            f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}. Latency: "
            f"{m['latency_measures']}{repeats}."
        )
        first = "mean_cosine" if m["kind"] == "encoder" else "top1_agreement"
        second = "triplet_order_kept" if m["kind"] == "encoder" else "kl_divergence"
        rows = []
        for label, size in m["size_bytes"].items():
            x = m["metrics"].get(label)
            verdict = m["gate"].get(label)
            rows.append(
                [
                    label,
                    f"{size / 1e6:.1f}",
                    m["latency_ms"]["batch_1"][label],
                    m["latency_ms"]["batch_16"][label],
                    f"{m['speedup_vs_teacher_fp32']['batch_16'][label]}x",
                    f"{x[first]:.4f}" if x else "-",
                    f"{x[second]:.4f}" if x else "-",
                    ("accepted" if verdict["accepted"] else "refused") if verdict else "-",
                ]
            )
        parts.append(
            table(["file", "MB", "b1 ms", "b16 ms", "b16 speedup", first, second, "gate"], rows)
        )
        if "target" in m:
            t = m["target"]
            parts.append(
                f"Target (student int8 >= 4x teacher fp32 at batch 16, mean cosine >= 0.95, "
                f"rankings kept): {t['speedup_batch_16']}x, cosine {t['mean_cosine']:.4f}, "
                f"triplet order kept {t['triplet_order_kept']:.2f} -> "
                f"**{'met' if t['met'] else 'not met'}**."
            )
    return "\n\n".join(parts)


def _rss(rss: dict) -> str:
    if "peak" in rss:
        return f"{rss['start']} -> peak {rss['peak']}"
    end = rss.get("end", {})
    return str(end.get("VmHWM", "?")) if isinstance(end, dict) else "?"


def tenants_section(r: dict) -> str:
    labels = ("off", "auth", "tls", "on")
    rows = [
        [
            label,
            round(r["throughput_rps_c32"][label]),
            r["throughput_ratio"][label],
            round(r["p50_ms_c1"][label], 3),
            r["added_p50_ms"][label],
            r["cpu_ms_per_call_c32_total"][label],
            round(r["scripts_per_call_c32"][label], 3),
            len(r["errors"][label]),
        ]
        for label in labels
    ]
    parts = ", ".join(f"{k} {v}" for k, v in r["components_us"].items())
    return "\n\n".join(
        [
            "## Tenants, keys and TLS: what trust costs",
            "`python -m benchmarks.tenants` — four meshes side by side on the tiny MLP: "
            "nothing (off), API keys + rate limits from per-router leases (auth), TLS to the "
            "router + mutual TLS to the worker (tls), all of it (on). p50 from "
            f"{r['calls']} rounds of one call to each (order rotated); throughput at 32 callers "
            f"from {r['slices_per_mesh']} rotated slices of {r['seconds_per_slice']} s "
            f"(ratio: median per slice). {r['note']}; load average "
            f"{r['load_average_before'][0]:.2f} before, {r['load_average_after'][0]:.2f} after.",
            table(
                [
                    "trust",
                    "req/s c=32",
                    "ratio to off",
                    "p50 c=1 (ms)",
                    "added p50 (ms)",
                    "CPU ms/call",
                    "Redis scripts/call",
                    "errors",
                ],
                rows,
            ),
            f"The auth path's parts, timed in process (us): {parts}.",
            "\n".join(f"- {line}" for line in r["reading"]),
        ]
    )


def http_stack_section(r: dict) -> str:
    rows = [
        [stack, f"{v['p50_ms_1_caller']:.3f}", f"{v['rps_32_callers']:.0f}", v["installed_mb"]]
        for stack, v in r["results"].items()
    ]
    return "\n\n".join(
        [
            "## http_stack\n\nThe router's HTTP server, chosen by measurement (one JSON echo "
            "endpoint per stack, its own process, alternating rounds, medians).",
            table(["stack", "p50 ms, 1 connection", "req/s, 32 connections", "MB installed"], rows),
            f"Chosen: {r['verdict']}.",
        ]
    )


def http_edge_section(r: dict) -> str:
    m = r["medians"]
    rows = [[path, f"{v['p50_ms_c1']:.3f}", f"{v['rps_c32']:.0f}"] for path, v in m.items()]
    parts = [
        "## http_edge\n\nThe HTTP front door against the gRPC port of the same router, on "
        "`mlp` (medians of the rounds).",
        table(["path", "p50 ms, 1 caller", "req/s, 32 callers"], rows),
        r["verdict"]["summary"] + ".",
    ]
    stream = r.get("stream", {})
    if "sse_cost_per_token_ms" in stream:
        parts.append(
            f"SmolLM2, {stream['tokens']} tokens streamed: gRPC {stream['grpc_stream_s']:.3f} s, "
            f"server-sent events {stream['sse_stream_s']:.3f} s: "
            f"{stream['sse_cost_per_token_ms']:+.3f} ms per token over the gRPC stream."
        )
    elif stream:
        parts.append(f"Streams not measured: {stream.get('error')}.")
    return "\n\n".join(parts)


SECTIONS = {
    "worker": worker_section,
    "router": router_section,
    "ledger": ledger_section,
    "mlserver": mlserver_section,
    "quantize": quantize_section,
    "tp": tp_section,
    "kv_balance": kv_balance_section,
    "llm": llm_section,
    "llm_int4": llm_int4_section,
    "llm_speculative": llm_speculative_section,
    "llm_speculative_fp32": llm_speculative_section,
    "llm_genai_perf": llm_genai_perf_section,
    "planner": planner_section,
    "tenants": tenants_section,
    "router_scale": router_scale_section,
    "idle": idle_section,
    "distill": distill_section,
    "http_stack": http_stack_section,
    "http_edge": http_edge_section,
}


def render(results: Path = RESULTS) -> str:
    """benchmarks/README.md's text from the result files in `results`."""
    parts = [
        "# Benchmark results",
        "Generated by `make bench` (`python -m benchmarks.summary`) "
        "from `benchmarks/results/*.json`; numbers from one run of each benchmark, and "
        "every sentence below is computed from them.",
    ]
    machine_noted = False
    for name, section in SECTIONS.items():
        path = results / f"{name}.json"
        if not path.exists():
            parts.append(f"## {name}\n\nnot run yet: `python -m benchmarks.{name}`")
            continue
        result = json.loads(path.read_text())
        if not machine_noted:
            m = result["machine"]
            parts.append(
                f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
                f"onnxruntime {m['onnxruntime']}, {m['platform']}."
            )
            machine_noted = True
        parts.append(section(result))
    return "\n\n".join(p for p in parts if p) + "\n"


def main() -> None:
    (HERE / "README.md").write_text(render())
    print(f"wrote {HERE / 'README.md'}")


if __name__ == "__main__":
    main()
