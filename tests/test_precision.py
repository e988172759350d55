"""The precision records (`cosyvoice_graphs.precision`): the lookup, the records' own checks, and what the
exporter and the runtime take from them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_runtime_core import clone

from cosyvoice_graphs import (
    DIT,
    HIFT_DECODER,
    LLM,
    PRECISION_NAMES,
    PRECISIONS,
    REDUCED_PRECISIONS,
    Precision,
    Tolerance,
    precisions_on,
)
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.precision import BF16, FP16, FP32, TF32
from cosyvoice_graphs.providers import CPU, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT
from cosyvoice_graphs.recipes import RECIPES
from cosyvoice_graphs.spec import TF32_REL_MAX
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import ProviderError, RuntimeBundleError
from cosyvoice_runtime.runners import ORT_PROVIDERS, decode_body, open_runner, provider_chain
from cosyvoice_runtime.runners.ort_settings import cuda_options


def test_the_lookup_refuses_an_unknown_name_in_one_line() -> None:
    assert Precision.named("bf16") is PRECISIONS["bf16"] is BF16
    for name in ("fp8", "FP32", 32):
        with pytest.raises(ValueError) as info:
            Precision.named(name)  # type: ignore[arg-type]
        assert str(info.value) == f"unknown precision {name!r}; known: fp32, fp16, int8, int4, bf16, tf32"


def test_the_names() -> None:
    assert PRECISION_NAMES == tuple(PRECISIONS) == ("fp32", "fp16", "int8", "int4", "bf16", "tf32")
    assert REDUCED_PRECISIONS == ("fp16", "int8", "int4", "bf16")
    assert [name for name, p in PRECISIONS.items() if p.exact_on_cpu] == ["fp32", "tf32"]
    assert all(name == p.name for name, p in PRECISIONS.items())


def test_where_each_precision_runs() -> None:
    assert FP32.providers == PROVIDERS and FP32.trt_plans
    assert [name for name, p in PRECISIONS.items() if p.trt_plans] == ["fp32", "fp16"]
    assert precisions_on(OPENVINO) == ("fp32", "bf16")
    assert precisions_on(CUDA) == ("fp32", "fp16", "int8", "int4", "tf32")
    assert [name for name, p in PRECISIONS.items() if p.cpu_provider == OPENVINO] == ["bf16"]
    assert {name: p.weight_bytes for name, p in PRECISIONS.items()} == {"fp32": 4, "fp16": 2, "int8": 1,
                                                                        "int4": 0.5, "bf16": 2, "tf32": 4}
    # TF32 is asked for by a tf32 graph alone: every other precision's CUDA sessions compute float32
    assert [name for name, p in PRECISIONS.items() if p.cuda_tf32] == ["tf32"]


def test_which_graphs_are_written_for_onnxruntime_alone() -> None:
    """Rewritten graphs that neither OpenVINO nor a TensorRT plan of this export reads: int8 and int4
    always, fp16 where the export builds no plans; of the float32 exports, tf32's where the graph's form for
    onnxruntime computes float32 on CUDA (the DiT's); never fp32's or bf16's."""
    alone = {(plans, cuda): [name for name, p in PRECISIONS.items()
                             if p.onnxruntime_only(trt_plans=plans, float32_cuda_form=cuda)]
             for plans in (False, True) for cuda in (False, True)}
    assert alone == {(False, False): ["fp16", "int8", "int4"], (True, False): ["int8", "int4"],
                     (False, True): ["fp16", "int8", "int4", "tf32"], (True, True): ["int8", "int4", "tf32"]}
    assert [r.name for r in RECIPES.values() if r.float32_cuda_form] == [DIT]


def test_a_record_must_hold_together() -> None:
    with pytest.raises(ValueError, match="fp32: unknown provider 'tpu'"):
        replace(FP32, providers=(*PROVIDERS, "tpu"))
    with pytest.raises(ValueError, match="bf16: must run under `cpu`"):
        replace(BF16, providers=(OPENVINO,))
    with pytest.raises(ValueError, match="bf16: must run under `cpu`"):
        replace(BF16, cpu_provider=TRT)
    with pytest.raises(ValueError, match="bf16: an OpenVINO hint exactly when it runs on 'openvino'"):
        replace(BF16, providers=(CPU,))
    with pytest.raises(ValueError, match="fp16: TF32 is the math of a float32 graph, not of a rewritten one"):
        replace(FP16, cuda_tf32=True)


def test_cuda_sessions_compute_float32_unless_the_graph_is_tf32() -> None:
    """onnxruntime's CUDA provider runs float32 matmuls in TF32 by default: the options turn it off for
    every precision but tf32, on the CUDA provider and under the TensorRT provider's CUDA placement."""
    cuda = ORT_PROVIDERS[CUDA]
    assert provider_chain(CPU) == ["CPUExecutionProvider"]
    strict = provider_chain(CUDA, 1)
    assert strict == [(cuda, {"device_id": "1", "use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}),
                      "CPUExecutionProvider"]
    assert provider_chain(CUDA, tf32=True)[0] == (cuda, {"device_id": "0", "use_tf32": "1",
                                                         "cudnn_conv_algo_search": "HEURISTIC"})
    trt = provider_chain(TENSORRT)
    assert [p if isinstance(p, str) else p[0] for p in trt] == [ORT_PROVIDERS[TENSORRT], cuda,
                                                                 "CPUExecutionProvider"]
    assert trt[1][1]["use_tf32"] == "0"
    with pytest.raises(ValueError, match="unknown cuDNN algorithm search 'FAST'; known: EXHAUSTIVE, "
                                         "HEURISTIC, DEFAULT"):
        cuda_options(0, tf32=False, conv_algo_search="FAST")
    assert provider_chain(CUDA, cuda_graph=True)[0][1]["enable_cuda_graph"] == "1"
    assert "enable_cuda_graph" not in strict[0][1]
    with pytest.raises(ValueError, match="CUDA graphs are an option of the cuda provider, not 'tensorrt'"):
        provider_chain(TENSORRT, cuda_graph=True)


def test_open_runner_asks_for_tf32_exactly_for_tf32_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`open_runner` passes the graph's precision's TF32 choice to its onnxruntime session (seen here
    through the runner's arguments, since this machine's onnxruntime may have no CUDA provider)."""
    import cosyvoice_runtime.runners as runners

    root_manifest = json.loads((DEMO_BUNDLE / MANIFEST).read_text())
    seen: dict[str, bool] = {}

    class Recorder:
        def __init__(self, path: Path, spec: object, provider: str, *, threads: int | None, tf32: bool,
                     cuda_graph: bool) -> None:
            seen[Path(path).stem] = tf32
            raise _Stop

    class _Stop(Exception):
        pass

    monkeypatch.setattr(runners, "OrtRunner", Recorder)
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    monkeypatch.setattr(bundle, "graph_precision",
                        lambda name: TF32 if name == "hift_f0" else FP32)
    for graph in ("hift_f0", "hift_decoder"):
        with pytest.raises(_Stop):
            open_runner(bundle, graph, CPU)
    assert seen == {"hift_f0": True, "hift_decoder": False}
    assert root_manifest["precision"] == FP32.name  # the demo bundle itself is fp32


def test_a_manifest_with_an_unknown_precision_is_one_line(tmp_path: Path) -> None:
    def precisions(llm: str) -> Callable[[dict[str, Any]], None]:
        def edit(manifest: dict[str, Any]) -> None:
            manifest["graphs"]["llm"]["precision"] = llm
            manifest["graphs"][DIT]["precision"] = "bf16"
        return edit

    root = clone(DEMO_BUNDLE, tmp_path / "bundle", precisions("fp8"))
    with pytest.raises(RuntimeBundleError) as info:
        RuntimeBundle.open(root)  # each graph's I/O follows its precision (`GraphSpec.io_at`)
    assert str(info.value) == (f"{root / MANIFEST}: graphs.llm.precision: unknown precision 'fp8'; known: "
                               "fp32, fp16, int8, int4, bf16, tf32")
    bundle = RuntimeBundle.open(clone(DEMO_BUNDLE, tmp_path / "fixed", precisions("fp32")))
    # the runner refuses a provider the graph's precision does not run on before it reads the graph
    with pytest.raises(ProviderError) as refused:
        open_runner(bundle, DIT, CUDA)
    assert str(refused.value) == (f"{DIT} is a bf16 graph, which runs on the CPU (OpenVINO), not on 'cuda', "
                                  "which runs fp32, fp16, int8, int4, tf32 graphs")


@pytest.mark.torch
def test_the_exporter_has_a_conversion_for_every_reduced_precision() -> None:
    """A conversion rewrites the float32 graph exactly where the record says so."""
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.onnx.conversions import CONVERSIONS

    assert tuple(CONVERSIONS) == tuple(name for name in PRECISIONS if name != FP32.name)
    for name, conversion in CONVERSIONS.items():
        assert (conversion.rewrite is None) == (PRECISIONS[name].rewrite is None), name


def test_openvino_refuses_a_hint_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without bf16 instructions (as OpenVINO reports them) bf16 graphs are refused, fp32 ones
    are not; whatever this CPU has."""
    from cosyvoice_runtime.runners import OpenVinoRunner, openvino

    monkeypatch.setattr(openvino, "cpu_capabilities", lambda: ("FP32", "INT8"))
    assert openvino.unsupported_reason(FP32) is None
    assert openvino.unsupported_reason(BF16) == (
        "this CPU has no bf16 instructions (OpenVINO reports FP32, INT8); bf16 is for CPUs with AVX512-BF16 "
        "or AMX: the DiT and HiFT's decoder computed in bfloat16, by OpenVINO; use another --precision here")
    demo = RuntimeBundle.open(DEMO_BUNDLE)
    with pytest.raises(ProviderError, match="a bf16 graph: this CPU has no bf16 instructions"):
        OpenVinoRunner(demo.graph_path(DIT), demo.specs[DIT], "bf16")
    with pytest.raises(ProviderError, match="a int8 graph does not run on OpenVINO \\(it runs fp32, bf16 "):
        OpenVinoRunner(demo.graph_path(DIT), demo.specs[DIT], "int8")


def test_tf32_graphs_on_cuda_are_judged_relative_to_their_scale() -> None:
    """A tf32 graph is the float32 export: on the CPU its spec's float32 bounds hold; where the CUDA provider
    computes it in TF32, a largest-error bound becomes relative to the output's scale, a mean bound stays."""
    specs = RuntimeBundle.open(DEMO_BUNDLE).specs
    llm, hift = specs[LLM], specs[HIFT_DECODER]
    assert llm.tolerances_on(TF32.name, CPU) == llm.tolerances == llm.tolerances_on(FP32.name, CUDA)
    assert set(llm.tolerances_on(TF32.name, CUDA).values()) == {TF32_REL_MAX}
    assert llm.tolerances_on(TF32.name, TENSORRT) == llm.tolerances_on(TF32.name, CUDA)
    assert hift.tolerances_on(TF32.name, CUDA) == hift.tolerances == {"waveform": Tolerance("mean_abs", 2e-3)}
    assert llm.tolerances_on(FP16.name, CUDA) == llm.tolerances_for(FP16.name)


def test_an_fp16_llm_written_for_onnxruntime_is_refused_on_cuda(tmp_path: Path) -> None:
    """onnxruntime's CUDA GroupQueryAttention fails on an fp16 `llm`'s growing caches: a bundle that would
    decode there is refused before any session opens, naming the profile that decodes on an fp16
    `llm_decode`."""
    def fp16_llm(manifest: dict[str, Any]) -> None:
        manifest["graphs"]["llm"]["precision"] = FP16.name

    bundle = RuntimeBundle.open(clone(DEMO_BUNDLE, tmp_path, fp16_llm))
    for provider, hint in ((CUDA, r"export the decode steps on an fp16 llm_decode \(--precision gpu-fp16, or "
                                  r"decode=fp16 beside a list\)"),
                           (TENSORRT, "export it with --trt, in the standard operators TensorRT parses, or "
                                      "keep the llm in fp32")):
        with pytest.raises(ProviderError, match=r"its fp16 llm attends with onnxruntime's "
                           rf"GroupQueryAttention .* on '{provider}' {hint}"):
            decode_body(bundle, provider)
    assert decode_body(bundle, CPU) == LLM
    assert decode_body(RuntimeBundle.open(DEMO_BUNDLE), CUDA) == LLM  # fp32: CUDA decodes on llm
