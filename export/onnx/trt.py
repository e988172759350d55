"""TensorRT plans from the exported ONNX graphs: profiles from the specs, a cache keyed by what a plan
depends on, and validation of each plan against onnxruntime with the spec's tolerances.

tensorrt, polygraphy and the CUDA driver are imported only when a plan is built (the `trt` extra);
`require_trt` says in one line what is missing, before any work is done.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cosyvoice_graphs import GraphSpec
from cosyvoice_runtime.bundle import file_sha256
from cosyvoice_runtime.cuda_device import cuda_device_name
from cosyvoice_runtime.extras import gpu_install_command

from .output_dir import PARTIAL

if TYPE_CHECKING:
    from .validate import GraphValidation

Shape = tuple[int, ...]
PLAN_SUFFIX = ".plan"


class TrtUnavailable(RuntimeError):
    """No CUDA device, TensorRT / polygraphy are not installed, or the graphs' precision is one TensorRT does
    not build; the message is one line."""


@dataclass(frozen=True)
class TrtEnv:
    """What a plan is built for: it runs only on this GPU model with this TensorRT version."""

    gpu_name: str
    trt_version: str


@dataclass(frozen=True)
class PlanResult:
    """A built (or cached) plan."""

    path: Path
    key: str
    cached: bool
    seconds: float


def input_profiles(spec: GraphSpec) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shapes of every input that has a symbolic dim; fixed inputs need no profile."""
    return {t.name: spec.profile(t) for t in spec.inputs if t.symbols()}


def plan_cache_key(onnx_sha256: str, profiles: Mapping[str, tuple[Shape, Shape, Shape]], gpu_name: str,
                   trt_version: str) -> str:
    """The cache key of a plan: a plan is valid only for these ONNX bytes, GPU model and TensorRT, and
    tuned for these profiles (`input_profiles`), which a spec can change without changing the graph."""
    shapes = ";".join(f"{name}={lo}/{opt}/{hi}" for name, (lo, opt, hi) in sorted(profiles.items()))
    text = "\n".join(("cosyvoice-trt-plan", onnx_sha256, shapes, gpu_name.strip(), trt_version.strip()))
    return hashlib.sha256(text.encode()).hexdigest()


def plan_file_name(graph: str, key: str) -> str:
    """`<graph>.<first 16 hex of the key>.plan`: one file per key, so a stale plan is never reused."""
    return f"{graph}.{key[:16]}{PLAN_SUFFIX}"


def require_trt() -> TrtEnv:
    """Check that plans can be built here (a CUDA device, tensorrt and polygraphy importable)."""
    gpu = cuda_device_name()
    if gpu is None:
        raise TrtUnavailable("--trt needs a CUDA device; the CUDA driver (libcuda.so.1) reports none")
    try:
        import polygraphy  # noqa: F401
        import tensorrt
    except ImportError as e:
        raise TrtUnavailable(f"--trt needs TensorRT and polygraphy ({gpu_install_command(tensorrt=True)}); "
                             f"{e.name} is not installed") from None
    return TrtEnv(gpu_name=gpu, trt_version=str(tensorrt.__version__))


def build_plan(onnx_path: Path, spec: GraphSpec, cache_dir: Path, env: TrtEnv) -> PlanResult:
    """The fp32 plan of `onnx_path` with one optimisation profile from the spec, from the cache if
    there is one for (ONNX sha256, profile, GPU, TensorRT version), else built and written there
    atomically.

    TF32 is off: the plan is held to the fp32 tolerances of the spec.
    """
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network
    from polygraphy.backend.trt import network_from_onnx_path as parse_onnx

    start = time.perf_counter()
    profiles = input_profiles(spec)
    key = plan_cache_key(file_sha256(onnx_path), profiles, env.gpu_name, env.trt_version)
    path = Path(cache_dir) / plan_file_name(spec.name, key)
    if path.is_file():
        return PlanResult(path, key, cached=True, seconds=time.perf_counter() - start)
    profile = Profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.add(name, min=lo, opt=opt, max=hi)
    # parse by path so the parser finds a large graph's external-data file beside it
    plan = engine_bytes_from_network(parse_onnx(str(onnx_path)),
                                     config=CreateConfig(tf32=False, profiles=[profile]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(plan))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return PlanResult(path, key, cached=False, seconds=time.perf_counter() - start)


def _run_plan(runner: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # the runner reuses its host buffers between calls: copy
    return {name: np.array(value, copy=True) for name, value in runner.infer(feeds).items()}


def validate_plan(plan_path: Path, onnx_path: Path, spec: GraphSpec) -> GraphValidation:
    """Compare the plan with onnxruntime (CPU) on the same graph at every validation case."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    # here, not above: `require_trt` refuses a machine without TensorRT before torch loads
    from .validate import CPU, GraphValidation, compare_outputs, ort_session, run_ort, validation_cases

    session = ort_session(onnx_path, CPU)
    figures = []
    with TrtRunner(EngineFromBytes(Path(plan_path).read_bytes())) as runner:
        for case in validation_cases(spec):
            feeds = spec.sample_inputs(case)
            figures += compare_outputs(spec, case, _run_plan(runner, feeds), run_ort(session, spec, feeds))
    return GraphValidation(spec.name, "TensorRT", "onnxruntime", tuple(figures))
