"""What `--precision` names (`cosyvoice_graphs.precision_plan`): a precision, a profile or a precision per
graph, each graph's precision under it, and the one-line refusals of what is unknown or unbounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_export.config import full_size
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_graphs import PRECISIONS, SPECS, ModelDims, spec
from cosyvoice_graphs.precision_plan import GRAPH_ALIASES, PROFILES, PrecisionPlan, PrecisionPlanError
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import PlannedExport
from cosyvoice_runtime.demo import DEMO_BUNDLE

DIT = "flow_estimator_cached"
KNOWN_GRAPHS = ("llm, flow_encoder, flow_estimator_cached, hift_f0, hift_decoder, llm_prefill, llm_decode, "
                "encoder, dit, hift, prefill, decode")


@pytest.fixture(scope="module")
def dims() -> ModelDims:
    return RuntimeBundle.open(DEMO_BUNDLE).dims


def _of(plan: PrecisionPlan, dims: ModelDims) -> dict[str, str]:
    """Each graph of a bundle of `plan` -> its precision."""
    specs = {name: spec(name, dims) for name in plan.graph_names}
    plan.check(specs)
    return {name: precision.name for name, precision in plan.precisions(specs).items()}


def test_a_plans_precisions_are_the_same_at_every_model_size(dims: ModelDims) -> None:
    """A model bundle's options are held against its export before it is made (`PlannedExport`), on
    specs built from the embedded bundle's model constants: what the export of the released model's size
    gets."""
    full = model_dims(full_size())
    assert full != dims
    for text in (*PRECISIONS, *PROFILES, "decode=fp16,prefill=int8,dit=tf32"):
        plan = PrecisionPlan.parse(text)
        precisions = [plan.precisions({g: spec(g, d) for g in plan.graph_names}) for d in (full, dims)]
        assert precisions[0] == precisions[1], text


def test_a_planned_export_has_the_precisions_of_the_export(tiny_bundle: Path, fp16_decode_bundle: Path,
                                                           fp32_decode_bundle: Path) -> None:
    for exported in (fp16_decode_bundle, fp32_decode_bundle):
        bundle = RuntimeBundle.open(exported)
        planned = PlannedExport.of(tiny_bundle, bundle.precision)
        assert (planned.precision, planned.graph_precisions) == (bundle.precision, bundle.graph_precisions)
        assert planned.trt_planned == bundle.trt_planned == []


def test_a_precision_for_the_bundle_goes_to_every_graph_that_bounds_it(dims: ModelDims) -> None:
    assert _of(PrecisionPlan.parse("fp32"), dims) == dict.fromkeys(SPECS, "fp32")
    assert _of(PrecisionPlan.parse("int8"), dims) == {**dict.fromkeys(SPECS, "fp32"), "llm": "int8",
                                                       DIT: "int8"}
    # the DiT has no 4-bit body: under a bundle-wide int4 it stays float32
    assert _of(PrecisionPlan.parse("int4"), dims) == {**dict.fromkeys(SPECS, "fp32"), "llm": "int4"}
    plan = PrecisionPlan.parse("int4")
    assert (plan.name, plan.bundle, plan.named) == ("int4", "int4", (PRECISIONS["int4"],))


def test_tf32_is_the_float32_body_for_every_graph(dims: ModelDims) -> None:
    """No spec bounds tf32 apart: every graph of a tf32 bundle is tf32, validated with its fp32 bounds (on the
    CPU it computes exactly as fp32); a list may name it for any graph but an optional one."""
    assert _of(PrecisionPlan.parse("tf32"), dims) == dict.fromkeys(SPECS, "tf32")
    for name in SPECS:
        s = spec(name, dims)
        assert s.tolerances_for("tf32") == s.tolerances and "tf32" not in s.precision_tolerances
    assert _of(PrecisionPlan.parse("hift=tf32,dit=fp16"), dims) == {
        **dict.fromkeys(SPECS, "fp32"), "hift_f0": "tf32", "hift_decoder": "tf32", DIT: "fp16"}
    with pytest.raises(PrecisionPlanError) as info:
        _of(PrecisionPlan.parse("decode=tf32"), dims)
    assert str(info.value) == ("--precision llm_decode=tf32: llm_decode has no tf32 body; its spec bounds "
                               "fp32, fp16, int8, int4 (an optional graph)")


def test_a_precision_per_graph(dims: ModelDims) -> None:
    plan = PrecisionPlan.parse(" dit=int8, llm=int4 ")
    # the manifest's name: full graph names in pipeline order, whatever order and aliases were given
    assert plan.name == "llm=int4,flow_estimator_cached=int8" and plan.bundle is None
    assert _of(plan, dims) == {**dict.fromkeys(SPECS, "fp32"), "llm": "int4", DIT: "int8"}
    assert [p.name for p in plan.named] == ["int4", "int8"]
    assert PrecisionPlan.parse(plan.name) == plan
    hift = PrecisionPlan.parse("hift_decoder=fp16,llm=fp32")
    assert _of(hift, dims) == {**dict.fromkeys(SPECS, "fp32"), "hift_decoder": "fp16"}
    assert GRAPH_ALIASES["hift"] == ("hift_f0", "hift_decoder")


def test_profiles_name_bounded_precisions(dims: ModelDims) -> None:
    fast = PrecisionPlan.parse("cpu-fast")
    assert (fast.name, fast.bundle) == ("cpu-fast", None)
    assert _of(fast, dims) == _of(PrecisionPlan.parse("llm=int4,prefill=int8,decode=int4,dit=int8"), dims)
    assert fast.graph_names == (*SPECS, "llm_prefill", "llm_decode")
    bf16 = PrecisionPlan.parse("cpu-fast-bf16")
    assert _of(bf16, dims) == {**_of(fast, dims), "hift_decoder": "bf16"}
    assert [p.name for p in bf16.named] == ["int4", "int8", "bf16"]  # what the CPU is checked against
    gpu = PrecisionPlan.parse("gpu-fp16")  # fp16 as the CUDA provider runs it: its decode steps on llm_decode
    assert _of(gpu, dims) == {**_of(PrecisionPlan.parse("fp16"), dims), "llm_decode": "fp16"}
    assert gpu.graph_names == (*SPECS, "llm_decode")
    for name in PROFILES:
        _of(PrecisionPlan.parse(name), dims)


def test_an_optional_graph_is_in_a_bundle_only_where_the_plan_names_it(dims: ModelDims) -> None:
    assert PrecisionPlan.parse("int8").graph_names == tuple(SPECS)  # bundle-wide: no second llm body
    assert PrecisionPlan.parse("llm=int4,dit=int8").graph_names == tuple(SPECS)
    plan = PrecisionPlan.parse("prefill=int8,llm=int4")
    assert plan.name == "llm=int4,llm_prefill=int8" and plan.graph_names == (*SPECS, "llm_prefill")
    assert _of(plan, dims) == {**dict.fromkeys(SPECS, "fp32"), "llm": "int4", "llm_prefill": "int8"}
    exact = PrecisionPlan.parse("decode=fp32")  # the float32 body that batches decodings
    assert exact.graph_names == (*SPECS, "llm_decode")
    assert _of(exact, dims) == {**dict.fromkeys(SPECS, "fp32"), "llm_decode": "fp32"}


@pytest.mark.parametrize(("text", "message"), [
    ("int3", "--precision: unknown precision or profile 'int3'; known: fp32, fp16, int8, int4, bf16, tf32, "
             f"cpu-fast, cpu-fast-bf16, gpu-fp16, or graph=precision,... (graphs: {KNOWN_GRAPHS})"),
    ("vocoder=fp16", f"--precision: unknown graph 'vocoder'; known: {KNOWN_GRAPHS}"),
    ("llm=int3", "--precision: llm=int3: unknown precision 'int3'; known: fp32, fp16, int8, int4, bf16, "
                 "tf32"),
    ("llm=int4,dit", "--precision: 'dit' is not graph=precision"),
    ("llm=", "--precision: 'llm=' is not graph=precision"),
    ("llm=int4,llm=int8", "--precision: llm is given a precision twice"),
    ("dit=int8,flow_estimator_cached=fp32", f"--precision: {DIT} is given a precision twice"),
])
def test_unknown_names_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(PrecisionPlanError) as info:
        PrecisionPlan.parse(text)
    assert str(info.value) == message


@pytest.mark.parametrize(("text", "message"), [
    ("dit=int4", f"--precision {DIT}=int4: {DIT} has no int4 body; its spec bounds fp32, tf32, fp16, int8, "
                 "bf16"),
    ("hift=fp16", "--precision hift_f0=fp16,hift_decoder=fp16: hift_f0 has no fp16 body; its spec bounds "
                  "fp32, tf32 (hift names hift_f0 and hift_decoder: give hift_decoder=fp16 alone)"),
    ("hift=int8", "--precision hift_f0=int8,hift_decoder=int8: hift_f0 has no int8 body; its spec bounds "
                  "fp32, tf32 (hift names hift_f0 and hift_decoder; none has one)"),
    ("llm=bf16", "--precision llm=bf16: llm has no bf16 body; its spec bounds fp32, tf32, fp16, int8, int4"),
    ("prefill=int4", "--precision llm_prefill=int4: llm_prefill has no int4 body; its spec bounds int8 (an "
                     "optional graph)"),
    ("prefill=fp32", "--precision llm_prefill=fp32: llm_prefill has no fp32 body; its spec bounds int8 (an "
                     "optional graph)"),
    ("decode=bf16", "--precision llm_decode=bf16: llm_decode has no bf16 body; its spec bounds fp32, fp16, "
                    "int8, int4 (an optional graph)"),
])
def test_a_precision_the_spec_does_not_bound_is_refused(dims: ModelDims, text: str, message: str
                                                        ) -> None:
    with pytest.raises(PrecisionPlanError) as info:
        _of(PrecisionPlan.parse(text), dims)
    assert str(info.value) == message
