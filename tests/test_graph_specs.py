"""`cosyvoice_graphs`: the specs are consistent plain data, sized by the model's dims."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from cosyvoice_export.config import full_size, tiny
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_graphs import (
    SPECS,
    Case,
    DecodeGates,
    DerivedDim,
    DimRange,
    GraphSpec,
    ModelDims,
    SolveGates,
    TensorSpec,
    Tolerance,
    cache_pairs,
    metadata,
    spec,
)
from cosyvoice_graphs.bundle_layout import FLOW_NOISE
from cosyvoice_graphs.recipes import NOISE_TABLES

FULL = model_dims(full_size())


def test_full_size_dims() -> None:
    assert FULL == ModelDims(
        llm_hidden=896, llm_layers=24, llm_kv_heads=2, llm_head_dim=64, speech_vocab=6761,
        speech_token_size=6561, mel_bins=80, spk_embed_dim=192, pre_lookahead_len=3, token_mel_ratio=2,
        dit_block_frames=50, dit_dim=1024, dit_depth=22, dit_heads=16, dit_head_dim=64, dit_conv_kernel=31,
        harmonics=9, samples_per_frame=480, sample_rate=24000,
    )
    assert ModelDims.from_metadata(FULL.to_metadata()) == FULL


def test_graphs_import_neither_torch_nor_onnxruntime() -> None:
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *a):\n"
            "        if name.split('.')[0] in ('torch', 'onnxruntime', 'cosyvoice_export'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import cosyvoice_graphs as g\n"
            "print(len(g.SPECS))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(len(SPECS))


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dims", [FULL, model_dims(tiny(832))], ids=["full", "tiny"])
def test_every_spec_is_consistent(name: str, dims: ModelDims) -> None:
    s = spec(name, dims)
    assert s.name == name and s.version >= 1 and s.opset >= 17
    for case in (s.trace, *s.validate):
        feeds = s.sample_inputs(case)
        assert list(feeds) == s.input_names
        for t in s.inputs:
            assert feeds[t.name].dtype == t.np_dtype
            assert feeds[t.name].shape == s.shape_of(t, case.dims)
    for t in s.inputs:
        lo, opt, hi = s.profile(t)
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True))
    meta = metadata(s, dims, {"checkpoint_sha256": "abc"})
    assert meta["spec_name"] == name and meta["spec_version"] == str(s.version)
    assert meta["llm_layers"] == str(dims.llm_layers) and meta["checkpoint_sha256"] == "abc"


def test_llm_cache_pairs_follow_one_rule() -> None:
    s = spec("llm", FULL)
    pairs = cache_pairs(s)
    assert len(pairs) == 2 * 24
    assert pairs[0] == ("past_key_0", "present_key_0") and pairs[-1] == ("past_value_23", "present_value_23")
    assert s.sizes({"new_len": 4, "past_len": 13})["total_len"] == 17
    present = next(t for t in s.outputs if t.name == "present_key_5")
    assert s.shape_of(present, {"new_len": 1, "past_len": 9}) == (1, 2, 10, 64)


def test_derived_and_pinned_values() -> None:
    enc = spec("flow_encoder", FULL)
    mu = next(t for t in enc.outputs if t.name == "mu")
    assert enc.shape_of(mu, {"tokens": 37}) == (1, 80, 74)
    final = enc.validate[1]
    assert (enc.sample_inputs(final)["lookahead_tokens"] == -1).all()
    est = spec("flow_estimator_cached", FULL)
    traced = est.sample_inputs(est.trace)
    assert traced["attention_mask"].shape == (64, 164) and traced["attention_mask"][:, :100].all()
    np.testing.assert_array_equal(traced["positions"], np.arange(100, 164))
    assert traced["attention_mask"][0, 100:].sum() == 50  # frame 100 sees its block of 50 (100..149)
    dec = spec("hift_decoder", FULL)
    noise = next(t for t in dec.inputs if t.name == "sine_noise")
    assert dec.profile(noise) == ((1, 1920, 9), (1, 240000, 9), (1, 1440000, 9))


def test_the_dit_graph_covers_offline_and_streaming_calls() -> None:
    """One DiT graph serves every flow call: its validation covers a first chunk (nothing cached,
    block-causal), an offline call (nothing cached, full attention: b = offset + new frames), and full
    attention after a cache; its profile reaches as far as the flow noise table and is tuned for a call
    with nothing cached over 10 s."""
    s = spec("flow_estimator_cached", FULL)

    def point(case: Case) -> tuple[int, int, int, bool]:
        """new frames, cached frames, the first new frame's position, and whether they see each other all."""
        inputs = s.sample_inputs(case)
        new, past = case.dims["new_frames"], case.dims["past_frames"]
        return new, past, int(inputs["positions"][0]), bool(inputs["attention_mask"][:, past:].all())

    points = [point(c) for c in s.validate]
    assert any(past == offset == 0 and not full and new > 50 for new, past, offset, full in points)
    assert any(past == offset == 0 and full for new, past, offset, full in points)
    assert any(past > 0 and full for new, past, offset, full in points)
    assert (s.dims["new_frames"].opt, s.dims["past_frames"].opt) == (500, 0)
    graph, dim = NOISE_TABLES[FLOW_NOISE]
    assert (graph, s.dims[dim].max) == ("flow_estimator_cached", 3000)


def _tiny_spec(**overrides: object) -> GraphSpec:
    fields: dict[str, object] = dict(
        name="toy", version=1, opset=17, doc="",
        inputs=(TensorSpec("a", "float32", (1, "n")),),
        outputs=(TensorSpec("b", "float32", (1, "m")),),
        dims={"n": DimRange(1, 2, 3)}, derived={"m": DerivedDim({"n": 2})},
        tolerances={"b": Tolerance("max_abs", 1e-4)},
        trace=Case({"n": 2}), validate=(Case({"n": 3}),),
    )
    fields.update(overrides)
    return GraphSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("overrides,message", [
    ({"validate": (Case({"n": 2}),)}, "other than the trace shape"),
    ({"tolerances": {}}, "tolerances must cover exactly the outputs"),
    ({"inputs": (TensorSpec("a", "float32", (1, "k")),)}, "undeclared dims"),
    ({"outputs": (TensorSpec("a", "float32", (1, "m")),)}, "duplicate tensor names"),
    ({"derived": {"m": DerivedDim({"q": 1})}}, "unknown free dims"),
    ({"trace": Case({})}, "must size every free dim"),
    ({"precision_dtypes": {"fp16": {"a": "float16"}}}, "I/O dtypes for fp16, which has no tolerances"),
    ({"precision_tolerances": {"fp16": {"b": Tolerance("max_abs", 1e-2)}},
      "precision_dtypes": {"fp16": {"z": "float16"}}}, r"fp16 dtypes for unknown tensors \['z'\]"),
    ({"precision_tolerances": {"fp16": {"b": Tolerance("max_abs", 1e-2)}},
      "precision_dtypes": {"fp16": {"a": "half"}}}, "fp16 dtypes must be among"),
])
def test_inconsistent_specs_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _tiny_spec(**overrides)


def test_bad_profile_and_dtype_are_rejected() -> None:
    with pytest.raises(ValueError, match="min <= opt <= max"):
        DimRange(3, 2, 4)
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorSpec("x", "float64", (1,))


def test_cache_without_output_is_rejected() -> None:
    s = _tiny_spec(inputs=(TensorSpec("past_key_0", "float32", (1, "n")),))
    with pytest.raises(ValueError, match="has no output present_key_0"):
        cache_pairs(s)


def test_tolerance_metrics() -> None:
    got, want = np.array([1.0, 2.0, 3.5]), np.array([1.0, 2.5, 3.0])
    assert Tolerance("max_abs", 1).measure(got, want) == 0.5
    assert Tolerance("mean_abs", 1).measure(got, want) == pytest.approx(1 / 3)
    assert Tolerance("rel_max_abs", 1).measure(got, want) == pytest.approx(0.5 / 3.0)
    assert Tolerance("rel_mean_abs", 1).measure(got, want) == pytest.approx((1 / 3) / (6.5 / 3))
    with pytest.raises(ValueError, match="unknown metric"):
        Tolerance("rms", 1)


def test_reduced_precision_bounds_cover_exactly_the_outputs() -> None:
    with pytest.raises(ValueError, match="fp16 tolerances must cover exactly the outputs"):
        _tiny_spec(precision_tolerances={"fp16": {"zz": Tolerance("rel_max_abs", 1e-2)}})
    with pytest.raises(ValueError, match="'fp8' is not a reduced precision"):
        _tiny_spec(precision_tolerances={"fp8": {"b": Tolerance("rel_max_abs", 1e-2)}})
    for name in SPECS:
        s = spec(name, FULL)
        assert all(set(bounds) == set(s.output_names) for bounds in s.precision_tolerances.values())
        assert set(s.decode_gates) | set(s.solve_gates) <= set(s.precision_tolerances)


def test_decode_gates() -> None:
    gates = DecodeGates("b", steps=2, mean_kl=0.1, top_k=2, top_logp_error=0.5, greedy_mismatches=0)
    want = np.log(np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.05, 0.15, 0.8]]))
    got = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.5, 0.4]]))
    figures = gates.measure(got, want)
    kl = [0.7 * np.log(0.7 / 0.6) + 0.2 * np.log(0.2 / 0.3), 0.0,
          0.05 * np.log(0.05 / 0.1) + 0.15 * np.log(0.15 / 0.5) + 0.8 * np.log(0.8 / 0.4)]
    assert figures["mean_kl"] == pytest.approx(np.mean(kl))
    assert figures["top_logp_error"] == pytest.approx(np.log(0.5 / 0.15))  # id 1 is in row 2's top 2
    assert figures["greedy_mismatches"] == 1
    assert set(gates.bounds()) == set(figures)
    bounds = {"b": Tolerance("rel_max_abs", 1e-2)}
    with pytest.raises(ValueError, match="gates for int8, which has no tolerances"):
        _tiny_spec(decode_gates={"int8": gates})
    with pytest.raises(ValueError, match="gates on unknown output 'zz'"):
        _tiny_spec(precision_tolerances={"int8": bounds}, decode_gates={"int8": replace(gates, output="zz")})
    s = _tiny_spec(precision_tolerances={"int8": bounds}, decode_gates={"int8": gates})
    assert (s.precision_in("int8"), s.precision_in("fp16")) == ("int8", "fp32")
    assert s.at_precision("int8").tolerances == bounds and s.tolerances_for("fp32") == s.tolerances


def test_solve_gates() -> None:
    gates = SolveGates("b", frames=8, min_snr_db=20.0)
    want = np.array([[3.0, -4.0]])
    got = want + np.array([[0.3, 0.4]])  # |error| 0.5 of |want| 5: 20 dB exactly
    assert gates.measure(got, want) == {"mel_rel_rms": pytest.approx(0.1)}
    assert gates.bounds() == {"mel_rel_rms": pytest.approx(0.1)}
    bounds = {"b": Tolerance("rel_max_abs", 1e-2)}
    with pytest.raises(ValueError, match="gates for int8, which has no tolerances"):
        _tiny_spec(solve_gates={"int8": gates})
    with pytest.raises(ValueError, match="gates on unknown output 'zz'"):
        _tiny_spec(precision_tolerances={"int8": bounds}, solve_gates={"int8": replace(gates, output="zz")})


def test_a_body_may_have_its_own_io_dtypes() -> None:
    """`llm_decode`'s fp16 body (CUDA's) has float16 caches, the rest of its I/O the spec's; every other body
    and graph has the spec's I/O."""
    s = spec("llm_decode", FULL)
    body = s.io_at("fp16")
    caches = {name for pair in cache_pairs(s) for name in pair}
    assert {t.name for t in (*body.inputs, *body.outputs) if t.dtype == "float16"} == caches
    assert [t.name for t in body.inputs] == s.input_names and body.outputs[0] == s.outputs[0]
    assert s.at_precision("fp16").inputs == body.inputs
    assert s.at_precision("fp16").tolerances == s.precision_tolerances["fp16"]
    for precision in ("fp32", "int8", "int4", "tf32"):
        assert s.io_at(precision) is s
    for name in SPECS:
        g = spec(name, FULL)
        assert g.io_at("fp16") is g
    fed = body.sample_inputs(s.validate[1])
    assert fed["past_key_0"].dtype == np.float16 and fed["inputs_embeds"].dtype == np.float32
