"""Graphs on OpenVINO's CPU plugin, compiled at their precision's `Precision.openvino_hint`: fp32 graphs
in float32, bf16 graphs in bfloat16.

A bf16 graph's file is its float32 ONNX graph; OpenVINO converts the weights and runs the matmuls in
bfloat16 (`INFERENCE_PRECISION_HINT`), which is fast only on CPUs with AVX512-BF16 or AMX. onnxruntime has
no fast x86 bf16 matmul, so OpenVINO is the only way this runtime runs bf16. On any other CPU OpenVINO
would silently compute in float32: the runner checks the CPU's capabilities and reads back the precision
it compiled with, and refuses instead. OpenVINO is optional (`pip install 'cosyvoice-onnx[openvino]'`) and
imported when asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from cosyvoice_graphs import GraphSpec, Precision, precisions_on
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.providers import OPENVINO

from ..errors import ProviderError, RuntimeBundleError
from .base import RunnerBase

HINT_CAPABILITIES = {"bf16": "BF16"}
"""An `INFERENCE_PRECISION_HINT` that takes effect only on CPUs with instructions for it -> what OpenVINO
then lists in the CPU's `OPTIMIZATION_CAPABILITIES`. Elsewhere OpenVINO silently computes in f32."""


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


def unsupported_reason(precision: Precision) -> str | None:
    """Why this machine cannot run graphs of `precision` at its OpenVINO hint, or None when it can (also
    when the hint needs no CPU capability: OpenVINO's own import error says the rest)."""
    needed = HINT_CAPABILITIES.get(precision.openvino_hint or "")
    if needed is None:
        return None
    try:
        capabilities = cpu_capabilities()
    except ProviderError as e:
        return str(e)
    if needed in capabilities:
        return None
    return (f"this CPU has no {precision.name} instructions (OpenVINO reports {', '.join(capabilities)}); "
            f"{precision.name} is for {precision.purpose}; use another --precision here")


def check_openvino_runs(path: Path | str, precision: str) -> Precision:
    """`precision`'s record, where OpenVINO is installed and runs a graph (`path`) of it on this CPU; else a
    `ProviderError` in one line."""
    record = Precision.named(precision)
    if record.openvino_hint is None:
        raise ProviderError(f"{path}: a {precision} graph does not run on OpenVINO (it runs "
                            f"{', '.join(precisions_on(OPENVINO))} graphs); use --provider cpu")
    if (reason := unsupported_reason(record)) is not None:
        raise ProviderError(f"{path}: a {precision} graph: {reason}")
    import_openvino()
    return record


def _named(ports: list[set[str]], names: list[str]) -> bool:
    """Whether `ports` (each port's tensor names) are, in order, the ports named `names`."""
    return len(ports) == len(names) and all(name in port for port, name in zip(ports, names, strict=True))


class OpenVinoRunner(RunnerBase):
    """A graph on OpenVINO's CPU plugin at the inference precision of its `precision`.

    Calls may come from several threads at once (the server's sessions): the compiled model is shared,
    each thread gets its own infer request."""

    def __init__(self, path: Path | str, spec: GraphSpec, precision: str = FP32.name, *,
                 threads: int | None = None) -> None:
        """`precision`: the graph's (one with an OpenVINO hint); `threads`: inference threads (None:
        OpenVINO's default)."""
        super().__init__(spec)
        record = check_openvino_runs(path, precision)
        ov = import_openvino()
        wanted = record.openvino_hint
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
