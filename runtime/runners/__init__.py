"""One runner interface over onnxruntime (CPU, CUDA, its TensorRT provider), TensorRT plans and OpenVINO.

A runner runs one graph: `infer(feeds)` takes and returns numpy arrays keyed by the spec's tensor
names. Feeds are checked against the spec before anything runs, and a runner never falls back to
another execution provider: what was asked for runs, or `ProviderError` says why it cannot.
`open_runner` picks the runner for a graph of a bundle and a provider.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

from cosyvoice_graphs import Precision, pipeline, precisions_on
from cosyvoice_graphs.providers import CPU, CPU_PROVIDERS, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT

from ..bundle import BundleGraphs, RuntimeBundle
from ..errors import ProviderError
from .base import BufferView, Feed, Runner, RunnerBase, check_feeds, feed_nbytes, feed_shape, to_host
from .openvino import OpenVinoRunner, check_openvino_runs, import_openvino
from .ort import OPTIMIZATION, ORT_PROVIDERS, OrtRunner, check_installed, provider_chain
from .ort_settings import shape_sessions
from .shape_pool import ShapePool
from .trt import TrtRunner, import_trt

__all__ = ["CPU", "CPU_PROVIDERS", "CUDA", "OPENVINO", "OPTIMIZATION", "ORT_PROVIDERS", "PROVIDERS",
           "TENSORRT", "TRT", "BufferView", "Feed", "OpenVinoRunner", "OrtRunner", "Runner", "RunnerBase",
           "ShapePool", "TrtRunner", "check_feeds", "check_opens", "check_provider_installed", "check_runs",
           "decode_body", "feed_nbytes", "feed_shape", "graphs_run", "on_openvino", "open_runner",
           "prefill_body", "provider_chain", "to_host"]

T = TypeVar("T")


def on_openvino(bundle: RuntimeBundle, graph: str, provider: str) -> bool:
    """Whether `open_runner` runs `graph` on OpenVINO (`cosyvoice_graphs.pipeline.on_openvino`)."""
    return pipeline.on_openvino(bundle.graph_precision(graph), provider)


def decode_body(bundle: BundleGraphs, provider: str) -> str:
    """The graph the LLM's decode steps run on with `provider` (`cosyvoice_graphs.pipeline.decode_body`):
    `llm_decode` on onnxruntime's CPU, and on CUDA in fp16, where the bundle has it, else `llm`; a
    `ProviderError` before anything opens where `provider` cannot decode on the bundle's graphs."""
    return _pipeline(bundle, pipeline.decode_body, provider)


def prefill_body(bundle: BundleGraphs, provider: str) -> str | None:
    """The graph a request's prefill runs on where it is not the decode body
    (`cosyvoice_graphs.pipeline.prefill_body`); None where there is none."""
    return _pipeline(bundle, pipeline.prefill_body, provider)


def graphs_run(bundle: BundleGraphs, provider: str) -> list[str]:
    """The graphs of `bundle` a pipeline on `provider` runs (`cosyvoice_graphs.pipeline.graphs_run`): all of
    them but the LLM's bodies it does not run."""
    return _pipeline(bundle, pipeline.graphs_run, provider)


def check_runs(bundle: BundleGraphs, provider: str) -> list[str]:
    """`graphs_run`, each of which `provider` runs at its precision (and under `trt` as a plan of the
    bundle's): a `ProviderError` naming the first it does not, before anything opens
    (`cosyvoice_graphs.pipeline.check_runs`)."""
    return _pipeline(bundle, pipeline.check_runs, provider)


def check_opens(bundle: RuntimeBundle, provider: str) -> list[str]:
    """`check_runs`, and what runs each of those graphs on `provider` is installed here (onnxruntime's
    provider; OpenVINO, and the CPU's instructions for a bf16 graph; TensorRT): a `ProviderError` in one
    line where `open_runner` would refuse one for either, before anything opens."""
    graphs = check_runs(bundle, provider)
    for graph in graphs:
        if on_openvino(bundle, graph, provider):
            check_openvino_runs(bundle.graph_path(graph), bundle.graph_precision(graph).name)
        elif provider == TRT:
            import_trt()
        else:
            check_installed(provider)
    return graphs


def check_provider_installed(provider: str) -> None:
    """What runs graphs on `provider` is installed here (onnxruntime's provider, OpenVINO, TensorRT), as far
    as that holds for any bundle: a `ProviderError` in one line (`check_opens` checks a bundle's graphs)."""
    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    if provider == OPENVINO:
        import_openvino()
    elif provider == TRT:
        import_trt()
    else:
        check_installed(provider)


def _pipeline(bundle: BundleGraphs, rule: Callable[[Mapping[str, Precision], str, Collection[str]], T],
              provider: str) -> T:
    """`rule` applied to `bundle`'s graphs; its `PipelineError` as a `ProviderError` naming the bundle."""
    try:
        return rule(bundle.graph_precisions, provider, bundle.trt_planned)
    except pipeline.PipelineError as e:
        raise ProviderError(f"{bundle.root}: {e}") from None


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
