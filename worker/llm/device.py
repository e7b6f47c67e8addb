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


@dataclass(frozen=True)
class Layout:
    """Byte offsets in the cache's [2, layers, slots, kv_heads, max_len, head_dim] of
    `itemsize` bytes: where the device cache binds and copies, and where the host mapping
    returns pages (tests check them against numpy's own layout)."""

    dims: tuple[int, ...]
    itemsize: int

    @property
    def row_bytes(self) -> int:  # one position of one head
        return self.dims[5] * self.itemsize

    @property
    def head_bytes(self) -> int:  # max_len positions
        return self.dims[4] * self.row_bytes

    @property
    def slot_bytes(self) -> int:  # every head
        return self.dims[3] * self.head_bytes

    def offset(self, kv: int, layer: int, slot: int) -> int:
        """Where keys (kv 0) or values (1) of `layer` start for `slot`."""
        return ((kv * self.dims[1] + layer) * self.dims[2] + slot) * self.slot_bytes

    def row_copies(
        self, src: int, dst: int, start: int, stop: int
    ) -> list[tuple[int, int, int, int, int]]:
        """Rows start..stop-1 of slot src into slot dst as 2-D copies, one per layer and K/V:
        (dst offset, src offset, pitch, width, height) as cudaMemcpy2D takes them, every
        head one line of `width` bytes, lines `pitch` apart."""
        skip, width = start * self.row_bytes, (stop - start) * self.row_bytes
        return [
            (
                self.offset(kv, layer, dst) + skip,
                self.offset(kv, layer, src) + skip,
                self.head_bytes,
                width,
                self.dims[3],
            )
            for kv in range(2)
            for layer in range(self.dims[1])
        ]


class CudaCacheMemory:
    """The cache on CUDA device `device_id`: one allocation of the whole layout."""

    def __init__(self, layout: Layout, dtype: str, device_id: int = 0) -> None:
        self.layout = layout
        self.dtype = np.dtype(dtype).type
        self.device_id = device_id
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(
            list(layout.dims), self.dtype, CUDA, device_id
        )
        self.base = int(self.value.data_ptr())
        self._cudart = _runtime()

    def discard(self, slot: int) -> None:
        """Nothing to hand back: device memory is not returned page by page."""

    def discard_from(self, slot: int, start: int) -> None:
        """As `discard`."""

    def views(self, lo: int, hi: int) -> list[tuple[DeviceView, DeviceView]]:
        """Per layer, keys and values of slots lo..hi-1, by address."""
        shape = (hi - lo, *self.layout.dims[3:])

        def view(kv: int, layer: int) -> DeviceView:
            ptr = self.base + self.layout.offset(kv, layer, lo)
            return DeviceView(ptr, shape, self.dtype, self.device_id)

        return [(view(0, layer), view(1, layer)) for layer in range(self.layout.dims[1])]

    def copy_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        """Rows start..stop-1 of slot src into slot dst, every head of every layer, K and V.
        Synchronous: the next step's run (on onnxruntime's own stream) sees the rows."""
        for to, frm, pitch, width, height in self.layout.row_copies(src, dst, start, stop):
            rc = self._cudart.cudaMemcpy2D(
                self.base + to, pitch, self.base + frm, pitch, width, height, _DEVICE_TO_DEVICE
            )
            if rc:
                raise RuntimeError(f"cudaMemcpy2D failed with CUDA error {rc}")
        rc = self._cudart.cudaDeviceSynchronize()  # a device-to-device copy returns at once
        if rc:
            raise RuntimeError(f"cudaDeviceSynchronize failed with CUDA error {rc}")

    def close(self) -> None:
        """onnxruntime's allocator takes the memory back with the OrtValue."""
        del self.value
