#!/usr/bin/env bash
# Tensor parallelism on a GPU machine, one command, under 5 minutes:
#   benchmarks/gpu_check.sh            (PYTHON=... to use another interpreter)
# Needs the project installed with onnxruntime-gpu and a CUDA torch (deploy/Dockerfile.gpu).
# Prints the JSON report and writes benchmarks/results/tp_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
"$PYTHON" -c "import onnxruntime as o, torch; print('ort', o.__version__, o.get_available_providers()); print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
exec timeout 290 "$PYTHON" -m benchmarks.gpu_check
