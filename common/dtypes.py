"""The KServe v2 datatype names and their numpy, ONNX and config equivalents."""

from __future__ import annotations

import numpy as np

# v2 datatype name -> numpy dtype. BYTES is an object array of `bytes`.
NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

# onnxruntime's NodeArg.type string -> v2 datatype name.
FROM_ONNX: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


# v2 datatype -> its typed field in InferTensorContents; FP16 and BF16 travel only as raw bytes.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# config.pbtxt DataType enum names are "TYPE_" + the v2 name, except BYTES <-> TYPE_STRING.
def to_config(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def from_config(type_name: str) -> str:
    name = type_name.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def from_numpy(dtype: np.dtype) -> str:
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    for name, candidate in NUMPY.items():
        if candidate == dtype:
            return name
    raise ValueError(f"no v2 datatype for numpy dtype {dtype}")
