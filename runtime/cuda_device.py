"""The CUDA device a TensorRT plan is built for and runs on, asked of the driver (libcuda) directly.

A plan runs only on the GPU model it was built on; the export records this name with each plan and the
runtime compares it before loading one, so a mismatch is one clear line instead of a TensorRT error.
"""

from __future__ import annotations

import ctypes


def cuda_device_name() -> str | None:
    """Name of CUDA device 0, or None when there is no CUDA driver or no device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    device = ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0 or cuda.cuDeviceGetName(name, 256, device) != 0:
        return None
    return name.value.decode(errors="replace")
