"""Graphs on onnxruntime, with exactly the requested execution provider (CPU, CUDA or TensorRT)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import (
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    NoSuchFile,
)

from cosyvoice_graphs import GraphSpec
from cosyvoice_graphs.providers import CPU, CUDA, TENSORRT

from ..errors import ProviderError, RuntimeBundleError
from ..extras import gpu_install_command
from ..process_memory import release_free_heap
from .base import BufferView, Feed, RunnerBase
from .capture_gate import on_device
from .ort_settings import (
    ARENA_SHRINKAGE,
    CONV_ALGO_SEARCH,
    FALLBACK,
    FORCE_SPINNING_STOP,
    OPTIMIZATION,
    cuda_options,
    keeps_spinning,
    settings_for,
    shrinks_arena,
)

GPU_GRAPH_ID = "gpu_graph_id"
"""onnxruntime's run option naming the CUDA graph a call captures or replays (a session with CUDA graphs)."""
SKIP_GRAPH = "-1"
"""`GPU_GRAPH_ID` for a call that runs outside every CUDA graph."""
ORT_PROVIDERS = {CPU: "CPUExecutionProvider", CUDA: "CUDAExecutionProvider",
                 TENSORRT: "TensorrtExecutionProvider"}
"""The providers onnxruntime runs -> its execution provider."""
LOAD_ERRORS = (InvalidProtobuf, InvalidGraph, InvalidArgument, NoSuchFile)
"""onnxruntime's errors for a graph file it cannot read as a model: missing, damaged (a flipped byte inside a
node: InvalidArgument, "Invalid model") or not ONNX."""


def unloadable(path: str | Path, error: Exception) -> RuntimeBundleError:
    """The one line for a bundle's ONNX file that onnxruntime cannot load (`LOAD_ERRORS`): reached where the
    bundle's sha256 check was skipped."""
    detail = " ".join(str(error).rpartition(" failed:")[2].split()).rstrip(".")
    return RuntimeBundleError(f"{path}: not a graph onnxruntime can load ({detail}); verifying the bundle's "
                              "sha256s finds a damaged file")


@functools.cache
def preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of NVIDIA's pip packages (the `gpu` extra installs them) before the
    first GPU session, as onnxruntime's `preload_dlls` does: its CUDA provider finds them only so, or on
    LD_LIBRARY_PATH. Once per process; what it prints goes to stderr, leaving stdout the command's own."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        with contextlib.redirect_stdout(sys.stderr):
            preload()


def provider_chain(provider: str, device_id: int = 0, *, tf32: bool = False,
                   conv_algo_search: str = CONV_ALGO_SEARCH, cuda_graph: bool = False) -> list[Any]:
    """onnxruntime's `providers` argument for `provider`, options included (`cuda_options`): nodes a GPU
    provider cannot take go to the CPU provider (placement, not fallback; `OrtRunner` refuses a session
    whose first provider is not the one asked for)."""
    if cuda_graph and provider != CUDA:
        raise ValueError(f"CUDA graphs are an option of the cuda provider, not {provider!r}")
    cuda = (ORT_PROVIDERS[CUDA], cuda_options(device_id, tf32=tf32, conv_algo_search=conv_algo_search,
                                              cuda_graph=cuda_graph))
    chains: dict[str, list[Any]] = {
        CPU: [ORT_PROVIDERS[CPU]],
        CUDA: [cuda, ORT_PROVIDERS[CPU]],
        TENSORRT: [(ORT_PROVIDERS[TENSORRT], {"device_id": str(device_id)}), cuda, ORT_PROVIDERS[CPU]],
    }
    return chains[provider]


def check_installed(provider: str) -> None:
    """A `ProviderError` (one line, with the command that installs it) unless this onnxruntime has
    `provider`'s execution provider."""
    wanted = ORT_PROVIDERS[provider]
    available = ort.get_available_providers()
    if wanted not in available:
        raise ProviderError(f"provider {provider!r} needs onnxruntime's {wanted}; this onnxruntime "
                            f"{ort.__version__} has only {', '.join(available)} "
                            f"({gpu_install_command(tensorrt=provider == TENSORRT)})")


def bound_inputs(session: ort.InferenceSession, feeds: Mapping[str, Feed], device_id: int = 0
                 ) -> ort.IOBinding:
    """A new IOBinding of `session` with `feeds` bound: `OrtValue`s and `BufferView`s where they are (a GPU's
    on `device_id`), arrays from the host."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
        elif isinstance(value, BufferView):
            binding.bind_input(name, value.device, device_id if value.device != CPU else 0,
                               value.dtype, list(value.shape), value.address)
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
    return binding


class OrtRunner(RunnerBase):
    """A graph on onnxruntime with exactly the requested execution provider.

    `session`, `device_type` and `device_id` are there for IOBinding (tensors kept on the device)."""

    def __init__(self, path: Path | str, spec: GraphSpec, provider: str = CPU, *, threads: int | None = None,
                 optimization: str | None = None, device_id: int = 0, tf32: bool = False,
                 conv_algo_search: str = CONV_ALGO_SEARCH, cuda_graph: bool = False) -> None:
        """`threads`: intra-op threads; `optimization`: a key of `OPTIMIZATION`; either, when None, is
        the graph's setting (CPU only) in its bundle's tuning file, else its default, else `FALLBACK`
        (`ort_settings.settings_for`). `device_id`: the CUDA device for "cuda" and "tensorrt"; `tf32`: the
        CUDA provider computes float32 matmuls and convolutions in TF32; `conv_algo_search`: how it picks
        cuDNN's convolution algorithms; `cuda_graph`: whether the session can replay calls from CUDA graphs
        (both `ort_settings.cuda_options`), the runner's own calls running outside them (`run_options`)."""
        super().__init__(spec)
        if optimization is None or threads is None:
            # the defaults and the tuning file are CPU measurements; GPU sessions keep onnxruntime's defaults
            chosen = settings_for(Path(path), spec.name) if provider == CPU else FALLBACK
            optimization = chosen.optimization if optimization is None else optimization
            threads = chosen.threads if threads is None else threads
        if provider not in ORT_PROVIDERS:
            raise ValueError(f"unknown onnxruntime provider {provider!r}; known: {', '.join(ORT_PROVIDERS)}")
        if optimization not in OPTIMIZATION:
            raise ValueError(f"unknown optimization level {optimization!r}; known: {', '.join(OPTIMIZATION)}")
        check_installed(provider)
        wanted = ORT_PROVIDERS[provider]
        if provider != CPU:
            preload_cuda_libraries()
        options = ort.SessionOptions()
        options.graph_optimization_level = OPTIMIZATION[optimization]
        if threads is not None:
            options.intra_op_num_threads = threads
        if not keeps_spinning(spec.name):
            options.add_session_config_entry(FORCE_SPINNING_STOP, "1")
        providers = provider_chain(provider, device_id, tf32=tf32, conv_algo_search=conv_algo_search,
                                   cuda_graph=cuda_graph)
        with on_device(CPU if provider == CPU else CUDA):
            try:
                self.session = ort.InferenceSession(str(path), options, providers=providers)
            except LOAD_ERRORS as e:
                raise unloadable(path, e) from None
        used = self.session.get_providers()
        if not used or used[0] != wanted:
            why = "" if provider == CPU else (f"; onnxruntime's log above says why (CUDA 13 and cuDNN 9 "
                                              f"libraries not found? {gpu_install_command()} brings them)")
            raise ProviderError(f"{path}: asked onnxruntime for {wanted}, the session fell back to "
                                f"{', '.join(used) or 'nothing'}{why}")
        self.provider = provider
        self.run_options: ort.RunOptions | None = None
        """What the runner's own calls run with: with CUDA graphs, outside them (graphs are captured and
        replayed through bindings of their own, `decode_graphs.GraphedSteps`); on the CPU, for a graph whose
        recipe asks (`shrinks_arena`), the session's arena shrunk back when the call ends. A GPU session's
        host arena is left as it is: its growth was not measured on a GPU."""
        self.cuda_graph = cuda_graph
        """Whether the session captures calls into CUDA graphs (through bindings of their own)."""
        self.shrinks_arena = provider == CPU and shrinks_arena(spec.name)
        """Whether every call of the runner gives back, when it ends, the arena's regions that no tensor holds
        (`run_options`): onnxruntime shrinks an arena at no other time."""
        entries = {GPU_GRAPH_ID: SKIP_GRAPH} if cuda_graph else {}
        if self.shrinks_arena:
            entries[ARENA_SHRINKAGE] = "cpu:0"
        if entries:
            self.run_options = ort.RunOptions()
            for key, value in entries.items():
                self.run_options.add_run_config_entry(key, value)
        self.device_type = CPU if provider == CPU else CUDA
        self.device_id = device_id
        try:  # read once, here: a flipped byte in it is no UTF-8 (where the file's sha256 went unchecked)
            self._metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        except UnicodeDecodeError:
            raise RuntimeBundleError(f"{path}: its metadata is not UTF-8 text; verifying the bundle's "
                                     "sha256s finds a damaged file") from None
        names = ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()])
        if names != (spec.input_names, spec.output_names):
            raise RuntimeBundleError(f"{path}: inputs {names[0]}, outputs {names[1]}; spec {spec.name} "
                                     f"v{spec.version} has {spec.input_names}, {spec.output_names}")
        # making the session parsed the model and rewrote its graph: hundreds of MB at full size, freed
        # again but left resident by the C heap (how much varies run to run with the threads that freed it)
        release_free_heap()

    @property
    def metadata(self) -> dict[str, str]:
        """The graph's `metadata_props`, as the session read them."""
        return dict(self._metadata)

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        with on_device(self.device_type):  # the feeds' copies to the host included
            return super().infer_outputs(feeds, names)

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        return dict(zip(names, self.session.run(names, dict(feeds), self.run_options), strict=True))

    def infer_kept(self, feeds: Mapping[str, Feed], keep: Collection[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Feed]]:
        """`infer` through IOBinding: the outputs named in `keep` stay where the session computed them
        (the GPU for "cuda"/"tensorrt") as `OrtValue`s, which later calls take back as feeds without a
        copy; the other outputs come back as numpy arrays. For the LLM's KV cache, which would otherwise
        cross to the host and back at every token."""
        self._check_call(feeds, keep)
        outputs, kept = self.spec.output_names, set(keep)
        with on_device(self.device_type):  # binding copies host feeds to the device
            binding = bound_inputs(self.session, feeds, self.device_id)
            for name in outputs:
                binding.bind_output(name, self.device_type if name in kept else CPU, self.device_id)
            self.session.run_with_iobinding(binding, self.run_options)
        values = dict(zip(outputs, binding.get_outputs(), strict=True))
        host = {name: v.numpy() for name, v in values.items() if name not in kept}  # bound on the host
        return host, {name: values[name] for name in keep}

    def infer_in_place(self, feeds: Mapping[str, Feed], in_place: Mapping[str, str], names: Sequence[str]
                       ) -> dict[str, np.ndarray]:
        """`infer_outputs` for the outputs `names` (to the host), each output of `in_place` (output -> input)
        written into the memory of its input's feed, an `OrtValue` or a `BufferView` on the session's
        device: for a graph that extends its inputs in place (`llm_decode`'s caches), nothing is allocated
        or copied for them. onnxruntime refuses a call where such an output would not have its input's
        shape."""
        self._check_call(feeds, [*names, *in_place])
        if self.provider == TENSORRT:
            raise ValueError(f"{self.spec.name}: outputs written in place need the cpu or cuda provider, not "
                             f"{self.provider!r}")
        for source in in_place.values():
            value = feeds[source]
            device = value.device if isinstance(value, BufferView) else (
                value.device_name().lower() if isinstance(value, ort.OrtValue) else None)
            if device != self.device_type:
                raise ValueError(f"{self.spec.name}.{source}: an output written in place needs its input as "
                                 f"an OrtValue or a BufferView on {self.device_type}")
        with on_device(self.device_type):  # binding copies host feeds to the device
            binding = bound_inputs(self.session, feeds, self.device_id)
            for name in names:
                binding.bind_output(name, CPU)
            for output, source in in_place.items():
                value = feeds[source]
                if isinstance(value, BufferView):
                    binding.bind_output(output, self.device_type, self.device_id, value.dtype,
                                        list(value.shape), value.address)
                else:
                    binding.bind_ortvalue_output(output, value)
            self.session.run_with_iobinding(binding, self.run_options)
        return {name: v.numpy() for name, v in zip(names, binding.get_outputs(), strict=False)}

    def _release(self) -> None:
        with on_device(self.device_type):  # frees the session's device memory
            del self.session
