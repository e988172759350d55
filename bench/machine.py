"""The machine: what it is (CPU model, vector features and the class they make), and what it can do: memory
bandwidth (numpy copies) and matmul throughput (onnxruntime graphs: float32 `MatMul`, and the int8
`DynamicQuantizeMatMul` of an int8 DiT; OpenVINO's bf16 `MatMul` where a graph runs in bf16) at the
benchmark's thread count."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs.precision import BF16, FP32, Precision
from cosyvoice_runtime.runners.openvino import import_openvino
from cosyvoice_runtime.runners.ort_settings import usable_cpus

CPU_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")
"""The SIMD features that decide CPU matmul speed, reported where /proc/cpuinfo lists them."""
VECTOR_FEATURES: dict[str, tuple[str, ...]] = {
    "AVX2": ("avx2",),
    "AVX-512": ("avx512f",),
    "VNNI": ("avx512_vnni", "avx_vnni"),
    "BF16": ("avx512_bf16", "amx_bf16"),
    "AMX": ("amx_tile",),
}
"""The features named plainly, each from the flags that give it (any one): VNNI's int8 dot products come
with AVX-512 or as AVX-VNNI on AVX2-only cores; bf16 matmuls with AVX512-BF16 or AMX."""


def describe(threads: int, torch_version: str | None) -> dict[str, Any]:
    """The machine and software the figures come from."""
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    features = vector_features(flags)
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "vector_features": features,
        "cpu_class": cpu_class(features),
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


def vector_features(flags: set[str]) -> dict[str, bool]:
    """`VECTOR_FEATURES` present among /proc/cpuinfo's `flags`."""
    return {name: any(f in flags for f in given_by) for name, given_by in VECTOR_FEATURES.items()}


def cpu_class(features: dict[str, bool]) -> str:
    """The vector class figures are comparable within, e.g. "avx512+vnni+bf16" or "avx2": a figure from
    one class is not a figure from another, whatever the CPU's name."""
    base = "avx512" if features["AVX-512"] else "avx2" if features["AVX2"] else platform.machine().lower()
    extras = [name.lower() for name in ("VNNI", "BF16", "AMX") if features[name]]
    return "+".join([base, *extras])


def _version(package: str) -> str | None:
    """An installed package's version (None when it is not installed), without importing it."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


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


@dataclass(frozen=True)
class Rates:
    """What the machine measured at one thread count (or on its GPU): the bounds' denominators."""

    threads: int
    bandwidth_gbs: float
    """Copy bandwidth (`memory_bandwidth`; on a GPU its memory's, `cosyvoice_bench.gpu.gpu_rates`)."""
    matmul_shape: tuple[int, int, int]
    """(m, k, n) the matmul rates were measured at."""
    matmul_gflops: float
    """float32 `MatMul` (`matmul_gflops`)."""
    int8_matmul_gflops: float | None
    """int8 `DynamicQuantizeMatMul` (`int8_matmul_gflops`); None where no bounded graph runs in int8."""
    device: str = "cpu"
    """Where they were measured: "cpu", or "cuda" (the GPU, through onnxruntime's CUDA provider)."""
    precision_gflops: Mapping[str, float] = field(default_factory=dict)
    """`MatMul` rates of other precisions' math, by precision name (on a GPU: tf32, fp16; on a CPU: bf16,
    OpenVINO's, where a graph runs in it)."""

    def matmul_rate(self, precision: Precision) -> tuple[float, str]:
        """GFLOP/s of `precision`'s matmul math as measured, and what it is in words: its own rate where
        measured, else float32's (no CPU rate of fp16 is measured, nor bf16's where no graph runs in it, so
        such a graph can pass its bound)."""
        if precision.name in self.precision_gflops:
            return self.precision_gflops[precision.name], f"{precision.name} MatMul"
        if precision == FP32:
            return self.matmul_gflops, "float32 MatMul"
        return self.matmul_gflops, f"float32 MatMul (no {precision.name} rate measured)"


def measure_rates(threads: int, shape: tuple[int, int, int], *, int8: bool, quick: bool,
                  bandwidth_gbs: float | None = None, bf16: bool = False) -> Rates:
    """The rates at `threads` threads, the matmuls at `shape`; `bandwidth_gbs` when already measured at
    that thread count; `bf16`: OpenVINO's bf16 rate too (a bf16 graph's bound). `quick`: a small copy and
    fewer repeats (smoke runs)."""
    repeats = 2 if quick else 5
    if bandwidth_gbs is None:
        bandwidth_gbs = memory_bandwidth(threads, mib=64 if quick else 512, repeats=repeats)
    others = {BF16.name: bf16_matmul_gflops(*shape, threads, repeats=repeats)} if bf16 else {}
    return Rates(threads, bandwidth_gbs, shape, matmul_gflops(*shape, threads, repeats=repeats),
                 int8_matmul_gflops(*shape, threads, repeats=repeats) if int8 else None,
                 precision_gflops=others)


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
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((m, k), dtype=np.float32),
             "b": rng.standard_normal((k, n), dtype=np.float32)}
    return _gflops(matmul_model(m, k, n), feeds, m, k, n, threads, repeats)


def int8_matmul_gflops(m: int, k: int, n: int, threads: int, repeats: int = 5) -> float:
    """GFLOP/s (2·m·k·n per call, as float32's) of onnxruntime's CPU `DynamicQuantizeMatMul` with a
    constant int8 weight (k, n): what an int8 DiT's weight matmuls run after graph optimisation (7-bit
    weights per output channel, activations quantized to uint8 per call), quantizing the activations
    included."""
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((m, k), dtype=np.float32)}
    return _gflops(int8_matmul_model(m, k, n), feeds, m, k, n, threads, repeats)


def bf16_matmul_gflops(m: int, k: int, n: int, threads: int, repeats: int = 5) -> float:
    """GFLOP/s of OpenVINO's CPU plugin on a float32 `MatMul` with a constant weight (k, n) compiled with
    bf16 inference precision, as it runs a bf16 graph (the weight converted once, the activations per
    call), at `threads` inference threads. Only on a CPU with bf16 instructions is this bf16's rate
    (elsewhere OpenVINO computes in float32, and the runtime refuses bf16 graphs)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((k, n), dtype=np.float32)
    model = _model(_node("MatMul", ["a", "b"], ["y"]), [_value("a", (m, k))], [_value("y", (m, n))],
                   [_tensor("b", weight, _FLOAT)], {"": 17})
    feeds = {"a": rng.standard_normal((m, k), dtype=np.float32)}
    ov = import_openvino()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "matmul.onnx"
        path.write_bytes(model)
        compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "bf16",
                                                              "INFERENCE_NUM_THREADS": threads,
                                                              "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    request.infer(feeds)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        request.infer(feeds)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def _gflops(model: bytes, feeds: dict[str, np.ndarray], m: int, k: int, n: int, threads: int, repeats: int
            ) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


# The two graphs are serialised ONNX written without the onnx package (the runtime does not depend on
# it): ModelProto -> GraphProto -> NodeProto / ValueInfoProto / TensorProto, by field number.
_FLOAT, _INT8, _FLOAT16 = 1, 3, 10  # TensorProto.DataType
_ELEMENT_TYPES = {np.dtype(np.float32): _FLOAT, np.dtype(np.float16): _FLOAT16}
_MS_DOMAIN = "com.microsoft"


def matmul_model(m: int, k: int, n: int, opset: int = 17, dtype: type[np.floating] = np.float32) -> bytes:
    """y = MatMul(a (m, k), b (k, n)), in `dtype` (float32 or float16)."""
    node = _node("MatMul", ["a", "b"], ["y"])
    element = _ELEMENT_TYPES[np.dtype(dtype)]
    return _model(node, [_value("a", (m, k), element), _value("b", (k, n), element)],
                  [_value("y", (m, n), element)], [], {"": opset})


def scale_model(n: int, opset: int = 17) -> bytes:
    """y = x (n,) * 1, float32: reads and writes n floats, a copy's memory traffic on any device."""
    node = _node("Mul", ["x", "one"], ["y"])
    one = _tensor("one", np.ones((), dtype=np.float32), _FLOAT)
    return _model(node, [_value("x", (n,))], [_value("y", (n,))], [one], {"": opset})


def int8_matmul_model(m: int, k: int, n: int, opset: int = 17) -> bytes:
    """y = DynamicQuantizeMatMul(a (m, k) float32, b (k, n) int8 in [-64, 63], per-column scales, zero
    points 0), b and its scales constants, as onnxruntime's dynamic quantization leaves a DiT matmul."""
    rng = np.random.default_rng(0)
    weights = rng.integers(-64, 64, size=(k, n), dtype=np.int8)
    scales = np.full(n, 1e-2, dtype=np.float32)
    initializers = [_tensor("b", weights, _INT8), _tensor("b_scale", scales, _FLOAT),
                    _tensor("b_zero_point", np.zeros(n, dtype=np.int8), _INT8)]
    node = _node("DynamicQuantizeMatMul", ["a", "b", "b_scale", "b_zero_point"], ["y"], _MS_DOMAIN)
    return _model(node, [_value("a", (m, k))], [_value("y", (m, n))], initializers,
                  {"": opset, _MS_DOMAIN: 1})


def _model(node: bytes, inputs: list[bytes], outputs: list[bytes], initializers: list[bytes],
           opsets: dict[str, int]) -> bytes:
    graph = (_bytes(1, node) + _bytes(2, b"matmul") + b"".join(_bytes(5, t) for t in initializers)
             + b"".join(_bytes(11, v) for v in inputs) + b"".join(_bytes(12, v) for v in outputs))
    opset_import = b"".join(_bytes(8, _bytes(1, domain.encode()) + _int(2, version))
                            for domain, version in opsets.items())
    return _int(1, 8) + _bytes(7, graph) + opset_import  # ir_version 8, graph, opset_import


def _node(op: str, inputs: list[str], outputs: list[str], domain: str = "") -> bytes:
    return (b"".join(_bytes(1, i.encode()) for i in inputs) + b"".join(_bytes(2, o.encode()) for o in outputs)
            + _bytes(4, op.encode()) + (_bytes(7, domain.encode()) if domain else b""))


def _value(name: str, shape: tuple[int, ...], element: int = _FLOAT) -> bytes:
    """A ValueInfoProto of a tensor of `element` (TensorProto.DataType, float32 by default)."""
    dims = b"".join(_bytes(1, _int(1, d)) for d in shape)  # TensorShapeProto.dim.dim_value
    tensor_type = _int(1, element) + _bytes(2, dims)  # elem_type, shape
    return _bytes(1, name.encode()) + _bytes(2, _bytes(1, tensor_type))  # name, type.tensor_type


def _tensor(name: str, value: np.ndarray, data_type: int) -> bytes:
    """A TensorProto holding `value` as raw little-endian bytes."""
    dims = b"".join(_int(1, d) for d in value.shape)
    raw = value.astype(value.dtype.newbyteorder("<")).tobytes()
    return dims + _int(2, data_type) + _bytes(8, name.encode()) + _bytes(9, raw)


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
