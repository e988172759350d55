"""One runner interface over onnxruntime (CPU, CUDA, its TensorRT provider), TensorRT plans and OpenVINO.

A runner runs one graph: `infer(feeds)` takes and returns numpy arrays keyed by the spec's tensor
names. Feeds are checked against the spec before anything runs, and a runner never falls back to
another execution provider: what was asked for runs, or `ProviderError` says why it cannot.
`open_runner` picks the runner for a graph of a bundle and a provider.
"""

from __future__ import annotations

from cosyvoice_graphs import LLM, LLM_DECODE, LLM_PREFILL, precisions_on
from cosyvoice_graphs.precision import FP16
from cosyvoice_graphs.providers import CPU, CPU_PROVIDERS, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT

from ..bundle import RuntimeBundle
from ..errors import ProviderError
from .base import BufferView, Feed, Runner, RunnerBase, check_feeds, feed_nbytes, feed_shape, to_host
from .openvino import OpenVinoRunner
from .ort import OPTIMIZATION, ORT_PROVIDERS, OrtRunner, provider_chain
from .ort_settings import shape_sessions
from .shape_pool import ShapePool
from .trt import TrtRunner

__all__ = ["CPU", "CPU_PROVIDERS", "CUDA", "OPENVINO", "OPTIMIZATION", "ORT_PROVIDERS", "PROVIDERS",
           "TENSORRT", "TRT", "BufferView", "Feed", "OpenVinoRunner", "OrtRunner", "Runner", "RunnerBase",
           "ShapePool", "TrtRunner", "check_feeds", "decode_body", "feed_nbytes", "feed_shape", "graphs_run",
           "on_openvino", "open_runner", "prefill_body", "provider_chain", "to_host"]


def on_openvino(bundle: RuntimeBundle, graph: str, provider: str) -> bool:
    """Whether `open_runner` runs `graph` on OpenVINO: any graph under the `openvino` provider, and under
    `cpu` a graph whose precision runs there on OpenVINO (bf16: OpenVINO's is the fast x86 bf16)."""
    cpu_on_openvino = provider == CPU and bundle.graph_precision(graph).cpu_provider == OPENVINO
    return provider == OPENVINO or cpu_on_openvino


def decode_body(bundle: RuntimeBundle, provider: str) -> str:
    """The graph the LLM's decode steps run on with `provider`: `llm_decode` where the bundle has it and
    `provider` runs it (it needs onnxruntime's own operators: on its CPU provider, and on CUDA in fp16, the
    only float type, with bfloat16, of the CUDA kernel of its `GroupQueryAttention`), else `llm`. An fp16
    `llm` written for onnxruntime cannot take them on CUDA: a `ProviderError` before anything opens."""
    if LLM_DECODE in bundle.specs:
        if provider == CPU and not on_openvino(bundle, LLM_DECODE, provider):
            return LLM_DECODE
        if provider == CUDA and bundle.graph_precision(LLM_DECODE) == FP16:
            return LLM_DECODE
    if provider in (CUDA, TENSORRT) and bundle.graph_precision(LLM) == FP16 and not bundle.has_trt_plan(LLM):
        # onnxruntime 1.31's CUDA GroupQueryAttention may write its present cache over its past one, which
        # fails when the cache grows ("Shape mismatch attempting to re-use buffer", on an H200)
        raise ProviderError(f"{bundle.root}: its fp16 llm attends with onnxruntime's GroupQueryAttention "
                            "over growing caches, which onnxruntime's CUDA kernel fails; on "
                            f"{provider!r} export the decode steps on an fp16 llm_decode (--precision "
                            "gpu-fp16, or decode=fp16 beside a list)")
    return LLM


def prefill_body(bundle: RuntimeBundle, provider: str) -> str | None:
    """The graph a request's prefill runs on where it is not the decode body: the bundle's `llm_prefill`,
    unless the decode steps keep their caches on a GPU (`llm_decode` on CUDA), where the prefill writes
    them there itself; None where there is none."""
    if LLM_PREFILL not in bundle.specs or (decode_body(bundle, provider) == LLM_DECODE and provider != CPU):
        return None
    return LLM_PREFILL


def graphs_run(bundle: RuntimeBundle, provider: str) -> list[str]:
    """The graphs of `bundle` a pipeline on `provider` runs: all of them but the bodies it does not run
    (`decode_body`: where `llm_decode` takes the decode steps, `llm` stays closed; `prefill_body`)."""
    skipped = {LLM if decode_body(bundle, provider) == LLM_DECODE else LLM_DECODE}
    if prefill_body(bundle, provider) is None:
        skipped.add(LLM_PREFILL)
    return [name for name in bundle.specs if name not in skipped]


def open_runner(bundle: RuntimeBundle, graph: str, provider: str = CPU, *, threads: int | None = None,
                cuda_graph: bool = False) -> Runner:
    """A runner for `graph` of `bundle` on `provider` (one of `PROVIDERS`), its metadata checked
    against the manifest. `threads` sets onnxruntime's intra-op threads (OpenVINO's inference threads);
    `cuda_graph` (cuda only) lets the session replay calls from CUDA graphs (`OrtRunner`). On cuda the
    vocoder's graphs get a session per input shape they meet (`shape_sessions`, a `ShapePool`).
    A graph runs only on its precision's providers (a bf16 graph: on OpenVINO, under `cpu` and
    `openvino`)."""
    if graph not in bundle.specs:
        raise KeyError(f"unknown graph {graph!r}; known: {', '.join(bundle.specs)}")
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    spec = bundle.specs[graph]
    precision = bundle.graph_precision(graph)
    if provider not in precision.providers:
        raise ProviderError(f"{graph} is a {precision.name} graph, which runs on {precision.runs_on}, not on "
                            f"{provider!r}, which runs {', '.join(precisions_on(provider))} graphs")
    if on_openvino(bundle, graph, provider):
        bundle.graph_metadata(graph)  # checked against the manifest as it is read
        return OpenVinoRunner(bundle.graph_path(graph), spec, precision.name, threads=threads)
    if provider == TRT:
        bundle.graph_metadata(graph)  # the plan was built from this graph: its provenance is the plan's
        return TrtRunner(bundle.trt_plan(graph), spec)
    runners: list[Runner] = []
    try:
        for _ in range(shape_sessions(graph, provider)):
            runner = OrtRunner(bundle.graph_path(graph), spec, provider, threads=threads,
                               tf32=precision.cuda_tf32, cuda_graph=cuda_graph)
            runners.append(runner)
            bundle.check_metadata(graph, runner.metadata)
    except BaseException:
        for opened in runners:
            opened.close()
        raise
    return runners[0] if len(runners) == 1 else ShapePool(runners)
