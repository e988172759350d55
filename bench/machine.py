"""The machine: what it is, and what it can do: memory bandwidth (numpy copies) and matmul throughput
(an onnxruntime MatMul graph) at the benchmark's thread count."""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd", "sve")
"""The SIMD features that decide CPU matmul speed, reported where /proc/cpuinfo lists them."""


def describe(threads: int, torch_version: str | None) -> dict[str, Any]:
    """The machine and software the figures come from."""
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "onnxruntime_providers": ort.get_available_providers(),
        "openvino": _version("openvino"),
        "torch": torch_version,
        "threads": threads,
    }


def _version(package: str) -> str | None:
    """An installed package's version (None when it is not installed), without importing it."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


# --- memory bandwidth ---------------------------------------------------------------------------------


def memory_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s: (bytes read + bytes written) / seconds of the fastest of `repeats`
    `np.copyto`s of a `mib` MiB float32 array, split over `threads` threads (numpy releases the GIL).

    A decode step streams every LLM weight from memory once, so this is its bound's denominator.
    """
    n = mib * 2**20 // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.zeros_like(src)
    bounds = np.linspace(0, n, threads + 1).astype(int)

    def copy(i: int) -> None:
        np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])

    def timed_pass() -> float:
        workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    timed_pass()  # faults the destination pages in
    return 2 * src.nbytes / min(timed_pass() for _ in range(repeats)) / 1e9


# --- matmul throughput --------------------------------------------------------------------------------


def matmul_gflops(m: int, k: int, n: int, threads: int, repeats: int = 5) -> float:
    """GFLOP/s of onnxruntime's CPU MatMul (m, k) x (k, n) in float32 at `threads` intra-op threads:
    2·m·k·n / seconds of the fastest of `repeats` runs after one warm-up."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(matmul_model(m, k, n), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((m, k), dtype=np.float32),
             "b": rng.standard_normal((k, n), dtype=np.float32)}
    session.run(None, feeds)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def matmul_model(m: int, k: int, n: int, opset: int = 17) -> bytes:
    """A serialised ONNX model y = MatMul(a (m, k), b (k, n)), float32, written without the onnx package
    (the runtime does not depend on it): ModelProto -> GraphProto -> NodeProto / ValueInfoProto."""
    def tensor(name: str, shape: tuple[int, ...]) -> bytes:
        dims = b"".join(_bytes(1, _int(1, d)) for d in shape)  # TensorShapeProto.dim.dim_value
        tensor_type = _int(1, 1) + _bytes(2, dims)  # elem_type FLOAT, shape
        return _bytes(1, name.encode()) + _bytes(2, _bytes(1, tensor_type))  # name, type.tensor_type

    node = _bytes(1, b"a") + _bytes(1, b"b") + _bytes(2, b"y") + _bytes(4, b"MatMul")
    graph = (_bytes(1, node) + _bytes(2, b"matmul") + _bytes(11, tensor("a", (m, k)))
             + _bytes(11, tensor("b", (k, n))) + _bytes(12, tensor("y", (m, n))))
    return _int(1, 8) + _bytes(7, graph) + _bytes(8, _int(2, opset))  # ir_version 8, graph, opset_import


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload
