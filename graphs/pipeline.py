"""Which graphs of a bundle a pipeline opens on each provider.

The LLM's function has up to three bodies: `llm`, and the optional `llm_decode` and `llm_prefill`
(`OPTIONAL_SPECS`), which some providers run instead of it. These rules read only each graph's precision
and which graphs have TensorRT plans, so the runtime (what it opens for a bundle) and the exporter (what a
bundle for some providers must hold: `cosyvoice-export all --providers`) apply the same ones.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .precision import FP16, Precision
from .providers import CPU, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT
from .registry import LLM, LLM_DECODE, LLM_PREFILL


class PipelineError(ValueError):
    """A provider cannot run a bundle's pipeline: one line, naming the graph and what would run it."""


def on_openvino(precision: Precision, provider: str) -> bool:
    """Whether a graph of `precision` runs on OpenVINO under `provider`: every graph under `openvino`, and
    under `cpu` a graph whose precision runs there on OpenVINO (bf16: OpenVINO's is the fast x86 bf16)."""
    return provider == OPENVINO or (provider == CPU and precision.cpu_provider == OPENVINO)


def decode_body(precisions: Mapping[str, Precision], provider: str, trt_plans: Collection[str] = ()) -> str:
    """The graph the LLM's decode steps run on under `provider`, of the graphs of `precisions` (graph ->
    its precision; `trt_plans`: the graphs with TensorRT plans): `llm_decode` where there is one and
    `provider` runs it (it needs onnxruntime's own operators: on its CPU provider, and on CUDA in fp16, the
    only float type, with bfloat16, of the CUDA kernel of its `GroupQueryAttention`), else `llm`. A
    `PipelineError` where that is `llm` and the bundle has none, or an fp16 `llm` written for onnxruntime,
    which cannot take them on CUDA."""
    decode = precisions.get(LLM_DECODE)
    if decode is not None:
        if provider == CPU and not on_openvino(decode, provider):
            return LLM_DECODE
        if provider == CUDA and decode == FP16:
            return LLM_DECODE
    if LLM not in precisions:
        where = "onnxruntime's cpu and cuda providers" if decode == FP16 else "onnxruntime's cpu provider"
        raise PipelineError(f"its decode steps on {provider!r} would run on llm, which it was exported "
                            f"without (cosyvoice-export all --providers); its llm_decode runs on {where}")
    if provider in (CUDA, TENSORRT) and precisions[LLM] == FP16 and LLM not in trt_plans:
        # onnxruntime 1.31's CUDA GroupQueryAttention may write its present cache over its past one, which
        # fails when the cache grows ("Shape mismatch attempting to re-use buffer", on an H200)
        # the TensorRT provider runs `llm` only: an fp16 `llm_decode` is no way out there
        hint = ("export the decode steps on an fp16 llm_decode (--precision gpu-fp16, or decode=fp16 "
                "beside a list)" if provider == CUDA else "export it with --trt, in the standard operators "
                "TensorRT parses, or keep the llm in fp32")
        raise PipelineError("its fp16 llm attends with onnxruntime's GroupQueryAttention over growing "
                            f"caches, which onnxruntime's CUDA kernel fails; on {provider!r} {hint}")
    return LLM


def prefill_body(precisions: Mapping[str, Precision], provider: str, trt_plans: Collection[str] = ()
                 ) -> str | None:
    """The graph a request's prefill runs on where it is not the decode body (`decode_body`): `llm_prefill`,
    unless the decode steps keep their caches on a GPU (`llm_decode` on CUDA), where the prefill writes
    them there itself; None where there is none."""
    if LLM_PREFILL not in precisions:
        return None
    if decode_body(precisions, provider, trt_plans) == LLM_DECODE and provider != CPU:
        return None
    return LLM_PREFILL


def graphs_run(precisions: Mapping[str, Precision], provider: str, trt_plans: Collection[str] = ()
               ) -> list[str]:
    """The graphs of `precisions`, in its order, that a pipeline on `provider` opens: all but the LLM's
    bodies it does not run (`decode_body`: where `llm_decode` takes the decode steps, `llm` stays closed;
    `prefill_body`)."""
    decode = decode_body(precisions, provider, trt_plans)
    skipped = {LLM if decode == LLM_DECODE else LLM_DECODE}
    if prefill_body(precisions, provider, trt_plans) is None:
        skipped.add(LLM_PREFILL)
    return [name for name in precisions if name not in skipped]


def check_runs(precisions: Mapping[str, Precision], provider: str, trt_plans: Collection[str] = ()
               ) -> list[str]:
    """`graphs_run`, each of which `provider` runs at its precision (and as a TensorRT plan under `trt`);
    a `PipelineError` naming the first that it does not."""
    if provider not in PROVIDERS:
        raise PipelineError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    graphs = graphs_run(precisions, provider, trt_plans)
    for graph in graphs:
        precision = precisions[graph]
        if provider not in precision.providers:
            raise PipelineError(f"its {graph} is in {precision.name}, which runs on {precision.runs_on}, "
                                f"not on {provider!r}")
        if provider == TRT and graph not in trt_plans:
            raise PipelineError(f"its {graph} has no TensorRT plan, which {provider!r} runs (export with "
                                "--trt on the GPU that will run it)")
    return graphs


def providers_run(precisions: Mapping[str, Precision], trt_plans: Collection[str] = ()) -> list[str]:
    """The providers, of `PROVIDERS`, that run a bundle of `precisions` (`check_runs`)."""
    running = []
    for provider in PROVIDERS:
        try:
            check_runs(precisions, provider, trt_plans)
        except PipelineError:
            continue
        running.append(provider)
    return running
