"""Graphs on OpenVINO's CPU plugin: fp32 graphs in float32, bf16 graphs in bfloat16.

A bf16 graph's file is its float32 ONNX graph; OpenVINO converts the weights and runs the matmuls in
bfloat16 (`INFERENCE_PRECISION_HINT`), which is fast only on CPUs with AVX512-BF16 or AMX. onnxruntime has
no fast x86 bf16 matmul, so OpenVINO is the only way this runtime runs bf16. On any other CPU OpenVINO
would silently compute in float32: the runner reads back the precision it compiled with and refuses
instead. OpenVINO is optional (`pip install 'cosyvoice-onnx[openvino]'`) and imported when asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from cosyvoice_graphs import GraphSpec

from ..errors import ProviderError, RuntimeBundleError
from .base import RunnerBase

INFERENCE_PRECISIONS = {"fp32": "f32", "bf16": "bf16"}
"""A graph's precision -> the `INFERENCE_PRECISION_HINT` it is compiled with. fp16 and int8 bodies are
onnxruntime's (CUDA, int8 operators) and do not run here."""
BF16_CAPABILITY = "BF16"
"""What OpenVINO lists in the CPU's `OPTIMIZATION_CAPABILITIES` when it has bf16 instructions."""


def import_openvino() -> ModuleType:
    """The `openvino` module, or a `ProviderError` saying how to install it."""
    try:
        import openvino
    except ImportError:
        raise ProviderError("OpenVINO runs the 'openvino' provider and every bf16 graph; it is not installed "
                            "(pip install 'cosyvoice-onnx[openvino]')") from None
    return openvino


@cache
def cpu_capabilities() -> tuple[str, ...]:
    """The CPU's `OPTIMIZATION_CAPABILITIES` as OpenVINO reports them (e.g. FP32, INT8, BF16)."""
    return tuple(str(c) for c in import_openvino().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def bf16_unsupported_reason() -> str | None:
    """Why this machine cannot run bf16 graphs, or None when it can."""
    try:
        capabilities = cpu_capabilities()
    except ProviderError as e:
        return str(e)
    if BF16_CAPABILITY in capabilities:
        return None
    return (f"this CPU has no bf16 instructions (OpenVINO reports {', '.join(capabilities)}); bf16 needs "
            "AVX512-BF16 or AMX: use --precision int8 or fp32 here")


def _named(ports: list[set[str]], names: list[str]) -> bool:
    """Whether `ports` (each port's tensor names) are, in order, the ports named `names`."""
    return len(ports) == len(names) and all(name in port for port, name in zip(ports, names, strict=True))


class OpenVinoRunner(RunnerBase):
    """A graph on OpenVINO's CPU plugin at the inference precision of its `precision`.

    Calls may come from several threads at once (the server's sessions): the compiled model is shared,
    each thread gets its own infer request."""

    def __init__(self, path: Path | str, spec: GraphSpec, precision: str = "fp32", *,
                 threads: int | None = None) -> None:
        """`precision`: the graph's (a key of `INFERENCE_PRECISIONS`); `threads`: inference threads
        (None: OpenVINO's default)."""
        super().__init__(spec)
        if precision not in INFERENCE_PRECISIONS:
            raise ProviderError(f"{path}: a {precision} graph does not run on OpenVINO (it runs fp32 and "
                                "bf16 graphs); use --provider cpu")
        if precision == "bf16" and (reason := bf16_unsupported_reason()) is not None:
            raise ProviderError(f"{path}: a bf16 graph: {reason}")
        ov = import_openvino()
        wanted = INFERENCE_PRECISIONS[precision]
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": wanted, "PERFORMANCE_HINT": "LATENCY"}
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        self._compiled = ov.Core().compile_model(str(path), "CPU", config)
        used = self._compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        if used != wanted:
            raise ProviderError(f"{path}: asked OpenVINO for {wanted} inference, it compiled for {used}")
        self.precision = precision
        # a port may carry several tensor names (an output that is also an inner node's): the spec's is one
        inputs = [port.get_names() for port in self._compiled.inputs]
        outputs = [port.get_names() for port in self._compiled.outputs]
        if not (_named(inputs, spec.input_names) and _named(outputs, spec.output_names)):
            raise RuntimeBundleError(f"{path}: inputs {inputs}, outputs {outputs}; spec {spec.name} "
                                     f"v{spec.version} has {spec.input_names}, {spec.output_names}")
        self._local = threading.local()

    def _request(self) -> Any:
        """This thread's infer request."""
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        return request

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        request = self._request()
        request.infer({name: np.ascontiguousarray(value) for name, value in feeds.items()})
        # the request's output memory is reused by its next call: copy out
        return {name: np.array(request.get_tensor(name).data, copy=True) for name in names}

    def _release(self) -> None:
        self._local = threading.local()  # this thread's request; other threads' go when they end
        del self._compiled
