"""Graphs as TensorRT plans (TensorRT 10 API), built by the exporter for one GPU model."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import numpy as np

from cosyvoice_graphs import GraphSpec

from ..bundle import TrtPlan
from ..cuda_device import cuda_device_name
from ..errors import FeedError, ProviderError, RuntimeBundleError
from ..extras import gpu_install_command
from .base import RunnerBase


def import_trt() -> tuple[ModuleType, ModuleType]:
    """tensorrt and polygraphy's CUDA wrapper (device memory, streams), imported only when asked for."""
    try:
        import tensorrt
        from polygraphy import cuda
    except ImportError as e:
        raise ProviderError(f"provider 'trt' needs TensorRT and polygraphy "
                            f"({gpu_install_command(tensorrt=True)}); {e.name} is not installed") from None
    return tensorrt, cuda


class TrtRunner(RunnerBase):
    """A graph's TensorRT plan (TensorRT 10 API): input shapes set per call, outputs sized by the
    engine's shape inference, run on one CUDA stream. Device buffers grow as needed and are reused."""

    def __init__(self, plan: TrtPlan, spec: GraphSpec) -> None:
        super().__init__(spec)
        trt, cuda = import_trt()
        if plan.tensorrt != trt.__version__:
            raise ProviderError(f"{plan.path}: built with TensorRT {plan.tensorrt} (on {plan.gpu}); this is "
                                f"TensorRT {trt.__version__}; export again with --trt here")
        gpu = cuda_device_name()
        if gpu is None:
            raise ProviderError("provider 'trt' needs a CUDA device; the CUDA driver reports none")
        if gpu.strip() != plan.gpu.strip():
            raise ProviderError(f"{plan.path}: built for {plan.gpu}, this GPU is {gpu}; a plan runs only on "
                                "the GPU model it was built on: export again with --trt here")
        try:
            self._stream = cuda.Stream()
        except Exception as e:  # polygraphy raises bare exceptions when there is no driver or device
            raise ProviderError(f"provider 'trt' needs a CUDA device: {e}") from None
        self._trt, self._cuda = trt, cuda
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(plan.path.read_bytes())
        if self._engine is None:
            raise ProviderError(f"{plan.path}: TensorRT {trt.__version__} could not load the plan "
                                f"(built on {plan.gpu}; a plan runs only on that GPU model)")
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        if inputs != spec.input_names or sorted(outputs) != sorted(spec.output_names):
            raise RuntimeBundleError(f"{plan.path}: inputs {inputs}, outputs {outputs}; spec {spec.name} "
                                     f"v{spec.version} has {spec.input_names}, {spec.output_names}")
        self._context = self._engine.create_execution_context()
        self._buffers = {n: cuda.DeviceArray(dtype=np.dtype(trt.nptype(self._engine.get_tensor_dtype(n))))
                         for n in names}

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        for name in self.spec.input_names:
            host = np.ascontiguousarray(feeds[name])
            if not self._context.set_input_shape(name, host.shape):
                raise FeedError(f"{self.spec.name}.{name}: shape {host.shape} is outside the plan's profile")
            device = self._buffers[name].resize(host.shape)
            device.copy_from(host, self._stream)
            self._context.set_tensor_address(name, device.ptr)
        results = {}
        for name in self.spec.output_names:  # the engine writes every output; only `names` come back
            shape = tuple(self._context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"{self.spec.name}.{name}: TensorRT could not infer the shape ({shape})")
            self._context.set_tensor_address(name, self._buffers[name].resize(shape).ptr)
            if name in names:
                results[name] = np.empty(shape, dtype=self._buffers[name].dtype)
        if not self._context.execute_async_v3(self._stream.ptr):
            raise RuntimeError(f"{self.spec.name}: TensorRT execution failed")
        for name in names:
            self._buffers[name].copy_to(results[name], self._stream)
        self._stream.synchronize()
        return results

    def _release(self) -> None:
        for buffer in self._buffers.values():
            buffer.free()
        self._stream.free()
        del self._context, self._engine, self._runtime
