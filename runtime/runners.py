"""One runner interface over onnxruntime (CPU, CUDA, its TensorRT provider), TensorRT plans and OpenVINO.

A runner runs one graph: `infer(feeds)` takes and returns numpy arrays keyed by the spec's tensor
names. Feeds are checked against the spec before anything runs, and a runner never falls back to
another execution provider: what was asked for runs, or `ProviderError` says why it cannot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Protocol, Self, TypeAlias, runtime_checkable

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import GraphSpec

from .bundle import RuntimeBundle, TrtPlan
from .cuda_device import cuda_device_name
from .errors import FeedError, ProviderError, RuntimeBundleError

CPU, CUDA, TENSORRT, TRT, OPENVINO = "cpu", "cuda", "tensorrt", "trt", "openvino"
PROVIDERS = (CPU, CUDA, TENSORRT, TRT, OPENVINO)
"""`cpu`, `cuda`, `tensorrt`: onnxruntime and its execution provider; `trt`: the bundle's TensorRT plans;
`openvino`: OpenVINO's CPU plugin. bf16 graphs run on OpenVINO under `cpu` too: it is the only CPU
runtime here that computes in bf16."""
CPU_PROVIDERS = (CPU, OPENVINO)
"""The providers that run a graph on the CPU (where bf16 graphs run)."""

ORT_PROVIDERS = {CPU: "CPUExecutionProvider", CUDA: "CUDAExecutionProvider",
                 TENSORRT: "TensorrtExecutionProvider"}
OPTIMIZATION = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
"""onnxruntime graph optimisation levels by name."""


Feed: TypeAlias = np.ndarray | ort.OrtValue
"""A graph input: a numpy array, or an onnxruntime value left on its device by `OrtRunner.infer_kept`."""


@runtime_checkable
class Runner(Protocol):
    """Runs one graph of the bundle; use as a context manager or call `close`."""

    @property
    def spec(self) -> GraphSpec: ...

    def infer(self, feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every spec input, by name); returns every spec output, by name."""
        ...

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        """`infer` returning only the outputs in `names`."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None: ...


_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
    "tensor(int64)": np.dtype(np.int64), "tensor(int32)": np.dtype(np.int32),
    "tensor(bool)": np.dtype(np.bool_)}


def _shape_dtype(value: object) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """Shape and dtype of a feed (numpy or `OrtValue`); None for anything else."""
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype
    if isinstance(value, ort.OrtValue):
        return tuple(value.shape()), _ORT_DTYPES.get(value.data_type(), np.dtype(object))
    return None


def check_feeds(spec: GraphSpec, feeds: Mapping[str, Feed]) -> None:
    """Raise `FeedError` unless `feeds` are exactly the spec's inputs with its dtypes, ranks and fixed
    dims, and every symbolic dim (free or derived) has one size across them."""
    unknown = [name for name in feeds if name not in spec.input_names]
    if unknown:
        raise FeedError(f"{spec.name}: unknown input {unknown[0]!r}; "
                        f"inputs are {', '.join(spec.input_names)}")
    missing = [name for name in spec.input_names if name not in feeds]
    if missing:
        raise FeedError(f"{spec.name}: missing input {missing[0]!r}")
    seen: dict[str, tuple[int, str]] = {}  # symbolic dim -> (size, the input that set it)
    for t in spec.inputs:
        where = f"{spec.name}.{t.name}"
        described = _shape_dtype(feeds[t.name])
        if described is None:
            raise FeedError(f"{where}: expected a numpy array, got {type(feeds[t.name]).__name__}")
        shape, dtype = described
        if dtype != t.np_dtype:
            raise FeedError(f"{where}: dtype {dtype}, expected {t.dtype}")
        if len(shape) != len(t.shape):
            raise FeedError(f"{where}: shape {shape} has rank {len(shape)}, expected {t.shape}")
        for axis, (want, got) in enumerate(zip(t.shape, shape, strict=True)):
            if isinstance(want, int):
                if got != want:
                    raise FeedError(f"{where}: shape {shape}, dim {axis} must be {want}; "
                                    f"expected {t.shape}")
            elif want in seen and seen[want][0] != got:
                raise FeedError(f"{where}: {want} = {got} (dim {axis}), but {seen[want][1]} has "
                                f"{want} = {seen[want][0]}")
            else:
                seen.setdefault(want, (got, t.name))
    free = {name: size for name, (size, _) in seen.items() if name in spec.dims}
    for name, derived in spec.derived.items():
        if name in seen and set(derived.terms) <= set(free) and seen[name][0] != derived.size(free):
            basis = ", ".join(f"{k} = {free[k]}" for k in derived.terms)
            raise FeedError(f"{spec.name}.{seen[name][1]}: {name} = {seen[name][0]}, expected "
                            f"{derived.size(free)} for {basis}")


class RunnerBase(ABC):
    """What every runner shares: the feed check, the closed state and the context manager. A subclass
    implements `_run` (outputs by name from checked host feeds) and `_release`."""

    def __init__(self, spec: GraphSpec) -> None:
        self._spec = spec
        self._closed = False

    @property
    def spec(self) -> GraphSpec:
        """The graph's spec: what `infer` takes and returns."""
        return self._spec

    def infer(self, feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every spec input, by name); returns every spec output, by name.

        `OrtValue` feeds are copied to the host here. Raises `FeedError` naming the graph and tensor
        when a feed does not match the spec."""
        return self.infer_outputs(feeds, self._spec.output_names)

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        """`infer` returning only the outputs in `names` (spec outputs, in any order): the others are
        not copied out (for a caller that drops a graph's caches)."""
        if self._closed:
            raise RuntimeError(f"{self._spec.name}: runner is closed")
        unknown = [name for name in names if name not in self._spec.output_names]
        if unknown:
            raise ValueError(f"{self._spec.name}: unknown output {unknown[0]!r}; "
                             f"outputs are {', '.join(self._spec.output_names)}")
        check_feeds(self._spec, feeds)
        return self._run({k: v.numpy() if isinstance(v, ort.OrtValue) else v for k, v in feeds.items()},
                         list(names))

    @abstractmethod
    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The outputs `names` of the graph on checked host `feeds`."""

    def close(self) -> None:
        """Release the session or engine; `infer` refuses afterwards. Closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._release()

    @abstractmethod
    def _release(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class OrtRunner(RunnerBase):
    """A graph on onnxruntime with exactly the requested execution provider.

    `session`, `device_type` and `device_id` are there for IOBinding (tensors kept on the device)."""

    def __init__(self, path: Path | str, spec: GraphSpec, provider: str = CPU, *, threads: int | None = None,
                 optimization: str = "all", device_id: int = 0) -> None:
        """`threads`: intra-op threads (None: onnxruntime's default); `optimization`: a key of
        `OPTIMIZATION`; `device_id`: the CUDA device for "cuda" and "tensorrt"."""
        super().__init__(spec)
        if provider not in ORT_PROVIDERS:
            raise ValueError(f"unknown onnxruntime provider {provider!r}; known: {', '.join(ORT_PROVIDERS)}")
        if optimization not in OPTIMIZATION:
            raise ValueError(f"unknown optimization level {optimization!r}; known: {', '.join(OPTIMIZATION)}")
        wanted = ORT_PROVIDERS[provider]
        available = ort.get_available_providers()
        if wanted not in available:
            raise ProviderError(f"provider {provider!r} needs onnxruntime's {wanted}; this onnxruntime "
                                f"{ort.__version__} has only {', '.join(available)} "
                                "(pip install 'cosyvoice-onnx[gpu]')")
        options = ort.SessionOptions()
        options.graph_optimization_level = OPTIMIZATION[optimization]
        if threads is not None:
            options.intra_op_num_threads = threads
        device = {"device_id": device_id}
        # nodes a GPU provider cannot take go to the CPU provider: that is placement, not fallback
        chains: dict[str, list[Any]] = {
            CPU: [wanted],
            CUDA: [(wanted, device), ORT_PROVIDERS[CPU]],
            TENSORRT: [(wanted, device), (ORT_PROVIDERS[CUDA], device), ORT_PROVIDERS[CPU]],
        }
        providers = chains[provider]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        used = self.session.get_providers()
        if not used or used[0] != wanted:
            raise ProviderError(f"{path}: asked onnxruntime for {wanted}, the session fell back to "
                                f"{', '.join(used) or 'nothing'}")
        self.provider = provider
        self.device_type = CPU if provider == CPU else CUDA
        self.device_id = device_id
        names = ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()])
        if names != (spec.input_names, spec.output_names):
            raise RuntimeBundleError(f"{path}: inputs {names[0]}, outputs {names[1]}; spec {spec.name} "
                                     f"v{spec.version} has {spec.input_names}, {spec.output_names}")

    @property
    def metadata(self) -> dict[str, str]:
        """The graph's `metadata_props`, as the session read them."""
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        return dict(zip(names, self.session.run(names, dict(feeds)), strict=True))

    def infer_kept(self, feeds: Mapping[str, Feed], keep: Collection[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, ort.OrtValue]]:
        """`infer` through IOBinding: the outputs named in `keep` stay where the session computed them
        (the GPU for "cuda"/"tensorrt") as `OrtValue`s, which later calls take back as feeds without a
        copy; the other outputs come back as numpy arrays. For the LLM's KV cache, which would otherwise
        cross to the host and back at every token."""
        if self._closed:
            raise RuntimeError(f"{self.spec.name}: runner is closed")
        check_feeds(self.spec, feeds)
        unknown = set(keep) - set(self.spec.output_names)
        if unknown:
            raise ValueError(f"{self.spec.name}: keep names no output: {sorted(unknown)}")
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.spec.output_names:
            binding.bind_output(name, self.device_type if name in keep else CPU, self.device_id)
        self.session.run_with_iobinding(binding)
        values = dict(zip(self.spec.output_names, binding.get_outputs(), strict=True))
        host = {name: v.numpy() for name, v in values.items() if name not in keep}
        return host, {name: values[name] for name in keep}

    def _release(self) -> None:
        del self.session


def _import_trt() -> tuple[ModuleType, ModuleType]:
    """tensorrt and polygraphy's CUDA wrapper (device memory, streams), imported only when asked for."""
    try:
        import tensorrt
        from polygraphy import cuda
    except ImportError as e:
        raise ProviderError("provider 'trt' needs TensorRT and polygraphy (pip install "
                            f"'cosyvoice-onnx[gpu]'); {e.name} is not installed") from None
    return tensorrt, cuda


class TrtRunner(RunnerBase):
    """A graph's TensorRT plan (TensorRT 10 API): input shapes set per call, outputs sized by the
    engine's shape inference, run on one CUDA stream. Device buffers grow as needed and are reused."""

    def __init__(self, plan: TrtPlan, spec: GraphSpec) -> None:
        super().__init__(spec)
        trt, cuda = _import_trt()
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


def on_openvino(bundle: RuntimeBundle, graph: str, provider: str) -> bool:
    """Whether `open_runner` runs `graph` on OpenVINO: a bf16 graph (OpenVINO's is the fast x86 bf16), or
    any graph under the `openvino` provider."""
    return bundle.graph_precision(graph) == "bf16" or provider == OPENVINO


def open_runner(bundle: RuntimeBundle, graph: str, provider: str = CPU, *, threads: int | None = None
                ) -> Runner:
    """A runner for `graph` of `bundle` on `provider` (one of `PROVIDERS`), its metadata checked
    against the manifest. `threads` sets onnxruntime's intra-op threads (OpenVINO's inference threads).
    A bf16 graph runs on OpenVINO under `cpu` and `openvino`, and is refused on a GPU provider."""
    if graph not in bundle.specs:
        raise KeyError(f"unknown graph {graph!r}; known: {', '.join(bundle.specs)}")
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    spec = bundle.specs[graph]
    precision = bundle.graph_precision(graph)
    if precision == "bf16" and provider not in CPU_PROVIDERS:
        raise ProviderError(f"{graph} is a bf16 graph, which runs on the CPU (OpenVINO), not on "
                            f"{provider!r}; for a GPU export --precision fp16")
    if on_openvino(bundle, graph, provider):
        from .openvino_runner import OpenVinoRunner  # OpenVINO is optional: imported when asked for

        bundle.graph_metadata(graph)  # checked against the manifest as it is read
        return OpenVinoRunner(bundle.graph_path(graph), spec, precision, threads=threads)
    if provider == TRT:
        bundle.graph_metadata(graph)  # the plan was built from this graph: its provenance is the plan's
        return TrtRunner(bundle.trt_plan(graph), spec)
    runner = OrtRunner(bundle.graph_path(graph), spec, provider, threads=threads)
    try:
        bundle.check_metadata(graph, runner.metadata)
    except RuntimeBundleError:
        runner.close()
        raise
    return runner
