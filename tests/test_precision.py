"""The precision records (`cosyvoice_graphs.precision`): the lookup, the records' own checks, and what the
exporter and the runtime take from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cosyvoice_graphs import PRECISION_NAMES, PRECISIONS, REDUCED_PRECISIONS, Precision, precisions_on
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.precision import BF16, FP32
from cosyvoice_graphs.providers import CPU, CUDA, OPENVINO, PROVIDERS, TRT
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import ProviderError, RuntimeBundleError
from cosyvoice_runtime.runners import open_runner

DIT = "flow_estimator_cached"


def test_the_lookup_refuses_an_unknown_name_in_one_line() -> None:
    assert Precision.named("bf16") is PRECISIONS["bf16"] is BF16
    for name in ("fp8", "FP32", 32):
        with pytest.raises(ValueError) as info:
            Precision.named(name)  # type: ignore[arg-type]
        assert str(info.value) == f"unknown precision {name!r}; known: fp32, fp16, int8, int4, bf16"


def test_the_names() -> None:
    assert PRECISION_NAMES == tuple(PRECISIONS) == ("fp32", "fp16", "int8", "int4", "bf16")
    assert REDUCED_PRECISIONS == ("fp16", "int8", "int4", "bf16")
    assert all(name == p.name for name, p in PRECISIONS.items())


def test_where_each_precision_runs() -> None:
    assert FP32.providers == PROVIDERS and FP32.trt_plans
    assert [name for name, p in PRECISIONS.items() if p.trt_plans] == ["fp32", "fp16"]
    assert precisions_on(OPENVINO) == ("fp32", "bf16")
    assert precisions_on(CUDA) == ("fp32", "fp16", "int8", "int4")
    assert [name for name, p in PRECISIONS.items() if p.cpu_provider == OPENVINO] == ["bf16"]
    assert {name: p.weight_bytes for name, p in PRECISIONS.items()} == {"fp32": 4, "fp16": 2, "int8": 1,
                                                                        "int4": 0.5, "bf16": 2}


def test_a_record_must_hold_together() -> None:
    with pytest.raises(ValueError, match="fp32: unknown provider 'tpu'"):
        replace(FP32, providers=(*PROVIDERS, "tpu"))
    with pytest.raises(ValueError, match="bf16: must run under `cpu`"):
        replace(BF16, providers=(OPENVINO,))
    with pytest.raises(ValueError, match="bf16: must run under `cpu`"):
        replace(BF16, cpu_provider=TRT)
    with pytest.raises(ValueError, match="bf16: an OpenVINO hint exactly when it runs on 'openvino'"):
        replace(BF16, providers=(CPU,))


def test_a_manifest_with_an_unknown_precision_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    root.mkdir()
    for path in DEMO_BUNDLE.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            (root / path.relative_to(DEMO_BUNDLE)).parent.mkdir(parents=True, exist_ok=True)
            (root / path.relative_to(DEMO_BUNDLE)).symlink_to(path)
    manifest = json.loads((DEMO_BUNDLE / MANIFEST).read_text())
    manifest["graphs"]["llm"]["precision"] = "fp8"
    manifest["graphs"][DIT]["precision"] = "bf16"
    (root / MANIFEST).write_text(json.dumps(manifest))
    bundle = RuntimeBundle.open(root)
    with pytest.raises(RuntimeBundleError) as info:
        bundle.graph_precision("llm")
    assert str(info.value) == (f"{root / MANIFEST}: graphs.llm.precision: unknown precision 'fp8'; known: "
                               "fp32, fp16, int8, int4, bf16")
    # the runner refuses a provider the graph's precision does not run on before it reads the graph
    with pytest.raises(ProviderError) as refused:
        open_runner(bundle, DIT, CUDA)
    assert str(refused.value) == (f"{DIT} is a bf16 graph, which runs on the CPU (OpenVINO), not on 'cuda', "
                                  "which runs fp32, fp16, int8, int4 graphs")


@pytest.mark.torch
def test_the_exporter_has_a_conversion_for_every_reduced_precision() -> None:
    """A conversion rewrites the float32 graph exactly where the record says so."""
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.onnx.runtime_bundle import CONVERSIONS

    assert tuple(CONVERSIONS) == REDUCED_PRECISIONS
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
        "or AMX: the DiT computed in bfloat16, by OpenVINO; use another --precision here")
    demo = RuntimeBundle.open(DEMO_BUNDLE)
    with pytest.raises(ProviderError, match="a bf16 graph: this CPU has no bf16 instructions"):
        OpenVinoRunner(demo.graph_path(DIT), demo.specs[DIT], "bf16")
    with pytest.raises(ProviderError, match="a int8 graph does not run on OpenVINO \\(it runs fp32, bf16 "):
        OpenVinoRunner(demo.graph_path(DIT), demo.specs[DIT], "int8")
