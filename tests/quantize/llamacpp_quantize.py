"""llama.cpp's own quantizer on a GGUF, in-process in llama-cpp-python (llama-quantize's code).

Run by the tests with the llama-cpp-python venv's own interpreter (it imports nothing of
ours): `python llamacpp_quantize.py '{"source": ..., "target": ..., "ftype": "Q4_K_M"}'`;
`ftype` is a preset name after LLAMA_FTYPE_MOSTLY_ (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K...).
"""

import ctypes
import json
import sys

import llama_cpp


def main() -> None:
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
