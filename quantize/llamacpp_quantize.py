"""llama.cpp's own quantizer on a GGUF, in-process in llama-cpp-python (llama-quantize's code).

`quantize(python, source, target, preset)` runs this file with the llama-cpp-python venv's
interpreter (`make llamacpp-venv`), as the parity tests and benchmarks.llm do; run so, it
imports nothing of ours: `python llamacpp_quantize.py '{"source": ..., "target": ...,
"ftype": "Q4_K_M"}'`. `ftype` is a preset name after LLAMA_FTYPE_MOSTLY_ (Q4_K_M, Q5_K_M,
Q6_K, Q3_K_M, Q2_K...). Rows that are not whole 256-wide super-blocks fall back to the
types llama-quantize picks for them (Q5_0, Q5_1, Q8_0, Q4_0...).
"""

import ctypes
import json
import subprocess
import sys
from pathlib import Path


def quantize(
    python: Path, source: Path, target: Path, preset: str, timeout_s: float = 1800
) -> subprocess.CompletedProcess:
    """`source` quantized to `preset` into `target` by `python`'s llama-cpp-python; the
    finished process (its return code is the caller's to judge: a SIGILL says the venv's
    llama.cpp was built for another CPU)."""
    job = {"source": str(source), "target": str(target), "ftype": preset}
    return subprocess.run(
        [str(python), __file__, json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def main() -> None:
    import llama_cpp

    args = json.loads(sys.argv[1])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args['ftype']}")
    params.nthread = 2
    done = llama_cpp.llama_model_quantize(
        args["source"].encode(), args["target"].encode(), ctypes.byref(params)
    )
    if done != 0:
        sys.exit(f"llama_model_quantize returned {done}")


if __name__ == "__main__":
    main()
