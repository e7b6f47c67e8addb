"""The KV cache's memory on a CUDA device, for a step graph onnxruntime runs on its CUDA
execution provider.

On the CPU the cache is an anonymous mapping whose pages become resident as they are
written (worker/llm/cache.py). On a GPU it is one device allocation of the whole
[2, layers, slots, kv_heads, max_len, head_dim], made by onnxruntime's own CUDA allocator
(an OrtValue on "cuda"). The step graph's attention reads and writes it where it computes:
each layer's past and present are bound by address (`DeviceView`), so a step moves none of
the cache between host and device. A host cache bound to a CUDA session would instead be
copied to the device and back on every run.

A reused prefix's rows are copied between slots with cudaMemcpy2D, one per layer and K/V
(the rows of every head, at a pitch of max_len rows), through the CUDA runtime that
onnxruntime's CUDA provider has loaded. Discarding rows is bookkeeping: device memory is not
handed back page by page as the host mapping's is, and it is not zeroed: attention reads
each row's own length only.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

CUDA = "cuda"
_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind
_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


@dataclass(frozen=True)
class DeviceView:
    """A contiguous block of device memory, as IOBinding.bind_input / bind_output take it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: type[np.generic]
    device_id: int = 0


def _runtime() -> ctypes.CDLL:
    """libcudart, as loaded by onnxruntime's CUDA provider (or loadable beside it)."""
    errors = []
    for name in _RUNTIMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        size, ptr = ctypes.c_size_t, ctypes.c_void_p
        lib.cudaMemcpy2D.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int]
        lib.cudaMemcpy2D.restype = ctypes.c_int
        lib.cudaDeviceSynchronize.restype = ctypes.c_int
        return lib
    raise RuntimeError("the CUDA runtime (libcudart) cannot be loaded: " + "; ".join(errors))


class CudaCacheMemory:
    """[2, layers, slots, kv_heads, max_len, head_dim] of `dtype` on CUDA device `device_id`."""

    def __init__(self, dims: tuple[int, ...], dtype: str, device_id: int = 0) -> None:
        self.dims = dims
        self.dtype = np.dtype(dtype).type
        self.device_id = device_id
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(
            list(dims), self.dtype, CUDA, device_id
        )
        self.base = int(self.value.data_ptr())
        itemsize = np.dtype(dtype).itemsize
        _, layers, slots, heads, max_len, head_dim = dims
        self.row_bytes = head_dim * itemsize
        self.head_bytes = max_len * self.row_bytes
        self.slot_bytes = heads * self.head_bytes
        self.layer_bytes = slots * self.slot_bytes
        self._cudart = _runtime()

    def views(self, layer: int, lo: int, hi: int) -> tuple[DeviceView, DeviceView]:
        """Layer `layer`'s keys and values of slots lo..hi-1."""
        _, _, _, heads, max_len, head_dim = self.dims
        shape = (hi - lo, heads, max_len, head_dim)
        k, v = (
            self.base + (kv * self.dims[1] + layer) * self.layer_bytes + lo * self.slot_bytes
            for kv in range(2)
        )
        return (
            DeviceView(k, shape, self.dtype, self.device_id),
            DeviceView(v, shape, self.dtype, self.device_id),
        )

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        """Rows start..stop-1 of slot src into slot dst, every head of every layer, K and V.
        Synchronous: the next step's run (on onnxruntime's own stream) sees the rows."""
        width = (stop - start) * self.row_bytes
        heads = self.dims[3]
        offset = start * self.row_bytes
        for block in range(2 * self.dims[1]):  # kv * layers + layer
            layer = self.base + block * self.layer_bytes + offset
            rc = self._cudart.cudaMemcpy2D(
                layer + dst * self.slot_bytes,
                self.head_bytes,
                layer + src * self.slot_bytes,
                self.head_bytes,
                width,
                heads,
                _DEVICE_TO_DEVICE,
            )
            if rc:
                raise RuntimeError(f"cudaMemcpy2D failed with CUDA error {rc}")
        rc = self._cudart.cudaDeviceSynchronize()  # a device-to-device copy returns at once
        if rc:
            raise RuntimeError(f"cudaDeviceSynchronize failed with CUDA error {rc}")

    def read(self) -> np.ndarray:
        """The whole cache, copied to the host (tests)."""
        return np.asarray(self.value.numpy())
