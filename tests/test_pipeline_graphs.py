"""Which graphs a pipeline opens on each provider (`cosyvoice_graphs.pipeline`), from the graphs' precisions
alone: the rules the runtime opens a bundle by and `cosyvoice-export all --providers` exports by."""

from __future__ import annotations

import pytest

from cosyvoice_graphs import LLM, LLM_DECODE, PRECISIONS, SPECS, Precision
from cosyvoice_graphs.pipeline import (
    PipelineError,
    check_runs,
    decode_body,
    graphs_run,
    on_openvino,
    prefill_body,
    providers_run,
)
from cosyvoice_graphs.precision import BF16, FP32
from cosyvoice_graphs.precision_plan import PrecisionPlan
from cosyvoice_graphs.providers import CPU, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT

REST = ["flow_encoder", "flow_estimator_cached", "hift_f0", "hift_decoder"]
"""The graphs every pipeline opens, in pipeline order."""


def _precisions(plan: str, *, without: tuple[str, ...] = ()) -> dict[str, Precision]:
    """Graph -> precision of a bundle of `plan` (a profile or a list), less the graphs `without`."""
    parsed = PrecisionPlan.parse(plan)
    return {g: PRECISIONS[parsed.graphs.get(g, FP32.name)] for g in parsed.graph_names if g not in without}


def test_a_float32_bundle_decodes_on_llm_everywhere() -> None:
    fp32 = {g: FP32 for g in SPECS}
    for provider in PROVIDERS:
        assert decode_body(fp32, provider) == LLM and prefill_body(fp32, provider) is None
        assert graphs_run(fp32, provider) == list(SPECS)
    assert providers_run(fp32) == [CPU, CUDA, TENSORRT, OPENVINO]  # trt: no plans
    assert providers_run(fp32, list(SPECS)) == list(PROVIDERS)


def test_llm_decode_takes_the_decode_steps_where_onnxruntime_runs_it() -> None:
    fast = _precisions("cpu-fast")
    assert graphs_run(fast, CPU) == [*REST, "llm_prefill", LLM_DECODE]
    assert graphs_run(fast, CUDA) == [LLM, *REST, "llm_prefill"]  # an int4 llm_decode is the CPU's
    gpu = _precisions("gpu-fp16")
    assert graphs_run(gpu, CUDA) == [*REST, LLM_DECODE]
    assert graphs_run(gpu, CPU) == [*REST, LLM_DECODE]
    decode = _precisions("decode=fp16,prefill=int8")
    assert prefill_body(decode, CPU) == "llm_prefill"
    assert prefill_body(decode, CUDA) is None  # the prefill writes the GPU's caches itself


def test_a_bundle_without_llm_runs_only_where_llm_decode_decodes() -> None:
    fast = _precisions("cpu-fast", without=(LLM,))
    assert providers_run(fast) == [CPU]
    with pytest.raises(PipelineError) as refused:
        graphs_run(fast, CUDA)
    assert str(refused.value) == ("its decode steps on 'cuda' would run on llm, which it was exported "
                                  "without (cosyvoice-export all --providers); its llm_decode runs on "
                                  "onnxruntime's cpu provider")
    gpu = _precisions("gpu-fp16", without=(LLM,))
    assert providers_run(gpu) == [CPU, CUDA]
    with pytest.raises(PipelineError, match="its llm_decode runs on onnxruntime's cpu and cuda providers$"):
        graphs_run(gpu, OPENVINO)


def test_an_fp16_llm_decodes_on_a_gpu_only_as_a_tensorrt_plan() -> None:
    fp16 = {**{g: FP32 for g in SPECS}, LLM: PRECISIONS["fp16"]}
    for provider in (CUDA, TENSORRT):
        with pytest.raises(PipelineError, match="its fp16 llm attends with onnxruntime's GroupQuery"):
            decode_body(fp16, provider)
        assert decode_body(fp16, provider, trt_plans=[LLM]) == LLM
    assert decode_body(fp16, CPU) == LLM


def test_check_runs_names_the_graph_a_provider_cannot_run() -> None:
    with pytest.raises(PipelineError) as refused:
        check_runs(_precisions("cpu-fast"), OPENVINO)
    assert str(refused.value) == ("its llm is in int4, which runs on onnxruntime (4-bit operators, which "
                                  "TensorRT does not build), not on 'openvino'")
    with pytest.raises(PipelineError, match="its flow_estimator_cached is in tf32, which runs on "
                                            "onnxruntime's CPU"):
        check_runs(_precisions("decode=fp16,dit=tf32"), OPENVINO)
    with pytest.raises(PipelineError, match="its llm has no TensorRT plan, which 'trt' runs"):
        check_runs({g: FP32 for g in SPECS}, TRT)
    with pytest.raises(PipelineError, match="unknown provider 'gpu'; known: cpu, cuda"):
        check_runs({g: FP32 for g in SPECS}, "gpu")


def test_bf16_graphs_run_on_openvino_under_the_cpu_provider() -> None:
    assert on_openvino(BF16, CPU) and on_openvino(FP32, OPENVINO)
    assert not on_openvino(FP32, CPU) and not on_openvino(BF16, CUDA)
    bf16 = _precisions("cpu-fast-bf16")
    assert check_runs(bf16, CPU) == [*REST, "llm_prefill", LLM_DECODE]
    assert providers_run(bf16) == [CPU]  # its bf16 decoder runs on OpenVINO alone, its int4 llm not there
