"""The llm / flow_encoder / flow_estimator_cached export wrappers: spec I/O, exactness against the torch
networks they wrap, and a legacy-exporter round trip through onnxruntime at the specs' validation cases."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn

import cosyvoice_graphs
from cosyvoice_export.config import ModelConfig, tiny
from cosyvoice_export.nets import flow as flow_net
from cosyvoice_export.nets import llm as llm_net
from cosyvoice_export.nets.dit import dit_attention_mask
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.trace import ONNX_DTYPES
from cosyvoice_export.onnx.wrappers.flow import (
    FlowEncoderGraph,
    FlowEstimatorCachedGraph,
)
from cosyvoice_export.onnx.wrappers.llm import LLMGraph
from cosyvoice_graphs import ODE_STEPS, GraphSpec, dit_attention, empty_caches, euler_steps

GRAPHS = ("llm", "flow_encoder", "flow_estimator_cached")
@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return tiny(832)


@pytest.fixture(scope="module")
def lm(cfg: ModelConfig) -> llm_net.CosyVoice3LM:
    net = llm_net.CosyVoice3LM(cfg.llm).eval().requires_grad_(False)
    llm_net.init_random_(net, torch.Generator().manual_seed(0))
    return net


@pytest.fixture(scope="module")
def flow(cfg: ModelConfig) -> flow_net.CausalMaskedDiffWithDiT:
    net = flow_net.CausalMaskedDiffWithDiT(cfg.flow).eval().requires_grad_(False)
    flow_net.init_random_(net, torch.Generator().manual_seed(0))
    return net


@pytest.fixture(scope="module")
def wrappers(lm: llm_net.CosyVoice3LM, flow: flow_net.CausalMaskedDiffWithDiT) -> dict[str, nn.Module]:
    return {
        "llm": LLMGraph(lm).eval(),
        "flow_encoder": FlowEncoderGraph(flow).eval(),
        "flow_estimator_cached": FlowEstimatorCachedGraph(flow.decoder.estimator).eval(),
    }


def _spec(name: str, cfg: ModelConfig) -> GraphSpec:
    return cosyvoice_graphs.spec(name, model_dims(cfg))


def _run(module: nn.Module, s: GraphSpec, feeds: dict[str, np.ndarray]) -> list[Tensor]:
    """The wrapper on spec-named numpy feeds, outputs as a list in the spec's order."""
    with torch.no_grad():
        out = module(*(torch.from_numpy(feeds[n]) for n in s.input_names))
    return list(out) if isinstance(out, tuple) else [out]


def _dynamic_axes(s: GraphSpec) -> dict[str, dict[int, str]]:
    """`dynamic_axes` for the legacy exporter: every symbolic dim of every input and output, by name."""
    return {t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
            for t in (*s.inputs, *s.outputs) if t.symbols()}


# --- spec I/O ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GRAPHS)
def test_outputs_follow_the_spec(name: str, cfg: ModelConfig, wrappers: dict[str, nn.Module]) -> None:
    s = _spec(name, cfg)
    for case in (s.trace, *s.validate):
        outs = _run(wrappers[name], s, s.sample_inputs(case))
        assert len(outs) == len(s.outputs)
        for out, t in zip(outs, s.outputs, strict=True):
            assert tuple(out.shape) == s.shape_of(t, case.dims), t.name
            assert out.dtype == torch.float32, t.name


def test_llm_graph_rejects_a_wrong_cache_count(lm: llm_net.CosyVoice3LM) -> None:
    keys, values = lm.empty_cache()
    with pytest.raises(ValueError, match="past tensors"):
        LLMGraph(lm)(torch.zeros(1, 1, lm.cfg.qwen.hidden_size), *keys, *values[:-1])


# --- exactness against the wrapped networks ---------------------------------------------------------


def test_llm_graph_equals_forward_step(lm: llm_net.CosyVoice3LM) -> None:
    graph = LLMGraph(lm)
    x = torch.randn(1, 9, lm.cfg.qwen.hidden_size, generator=torch.Generator().manual_seed(1))  # (1, T, C)
    keys, values = lm.empty_cache()
    with torch.no_grad():
        for start, end in [(0, 8), (8, 9)]:  # prefill over an empty cache, then a decode step
            past = [t for kv in zip(keys, values, strict=True) for t in kv]
            got = graph(x[:, start:end], *past)
            logp, keys, values = lm.forward_step(x[:, start:end], keys, values)
            want = [logp, *(t for kv in zip(keys, values, strict=True) for t in kv)]
            assert len(got) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert keys[0].shape[2] == 9


@pytest.mark.parametrize("finalize", [True, False])
def test_flow_encoder_equals_inference_decoder_inputs(finalize: bool, flow: flow_net.CausalMaskedDiffWithDiT
                                                      ) -> None:
    g = torch.Generator().manual_seed(2)
    P, N, L = 6, 14, flow.cfg.pre_lookahead_len
    token, prompt = torch.randint(0, 6561, (1, N), generator=g), torch.randint(0, 6561, (1, P), generator=g)
    prompt_feat, embedding = torch.randn(1, 2 * P, 80, generator=g), 3 * torch.randn(1, 192, generator=g)
    calls: list[tuple[Tensor, ...]] = []  # the decoder's positional args: mu, mask, spks, cond, noise
    hook = flow.decoder.register_forward_pre_hook(lambda _, args: calls.append(args))
    try:
        flow.inference(token, prompt, prompt_feat, embedding, torch.zeros(1, 80, 2 * (P + N)),
                       streaming=True, finalize=finalize)
    finally:
        hook.remove()
    ((want_mu, _, want_spks, _, _),) = calls

    tokens = torch.cat((prompt, token), dim=1)  # (1, P+N)
    if finalize:  # every token, and no look-ahead: upstream pads zeros
        lookahead = torch.full((1, L), -1)
    else:  # the last L tokens are look-ahead only
        tokens, lookahead = tokens[:, :-L], tokens[:, -L:]
    with torch.no_grad():
        mu, spks = FlowEncoderGraph(flow)(tokens, lookahead, embedding)
    assert mu.shape == (1, 80, 2 * tokens.shape[1])
    assert torch.equal(mu, want_mu)
    assert torch.equal(spks, want_spks)


@pytest.mark.parametrize("T", [23, 64, 137])
@pytest.mark.parametrize("streaming", [True, False])
def test_dit_attention_with_nothing_cached_is_dit_attention_mask(T: int, streaming: bool) -> None:
    """With no cached frames and positions from 0, the graph's mask is the DiT's (no padding: the runtime
    never pads), block-causal for b = 50 and full attention for b = T, the runtime's offline call."""
    want = dit_attention_mask(torch.ones(1, 1, T), streaming, 50)  # (1, 1, T, T)
    got = dit_attention(0, T, 0, 50 if streaming else T)
    np.testing.assert_array_equal(got["positions"], np.arange(T))
    assert torch.equal(torch.from_numpy(got["attention_mask"])[None, None], want)


@pytest.mark.parametrize(("offset", "new", "past"), [(100, 37, 100), (600, 20, 100), (50, 45, 50)])
def test_dit_attention_after_a_cache_sees_every_cached_frame_and_the_blocks_so_far(offset: int, new: int,
                                                                                     past: int) -> None:
    """After `past` cached frames, every new frame sees all of them and, among the new ones, every frame up
    to the end of its own 50-frame block, the blocks counted from the sequence's first frame."""
    got = dit_attention(offset, new, past, 50)
    mask = got["attention_mask"]
    assert mask.shape == (new, past + new) and mask[:, :past].all()
    for i, p in enumerate(got["positions"]):
        visible = np.flatnonzero(mask[i, past:])
        assert visible[0] == 0 and offset + visible[-1] == min((p // 50 + 1) * 50, offset + new) - 1


@pytest.mark.parametrize("T", [7, 123, 451])
@pytest.mark.parametrize("streaming", [True, False])
def test_cached_graph_with_nothing_cached_equals_dit(T: int, streaming: bool, cfg: ModelConfig,
                                                     wrappers: dict[str, nn.Module],
                                                     flow: flow_net.CausalMaskedDiffWithDiT) -> None:
    """The DiT graph with empty caches and offset 0 is `DiT.forward` over every frame, bit for bit: the
    runtime's offline flow, a stream's first chunk and its final re-run."""
    s = _spec("flow_estimator_cached", cfg)
    rng = np.random.default_rng(T)
    x, mu, cond = (rng.standard_normal((2, 80, T), dtype=np.float32) for _ in range(3))
    spks = rng.standard_normal((2, 80), dtype=np.float32)
    step = T % ODE_STEPS
    t = np.full(2, euler_steps()[step][0])  # the step's time, which the graph's modulation row is of
    block = 50 if streaming else T
    dit = flow.decoder.estimator
    feeds = {"x": x, "mu": mu, "ode_step": np.array([step]), "spks": spks, "cond": cond,
             **dit_attention(0, T, 0, block), **empty_caches(s)}
    velocity = _run(wrappers["flow_estimator_cached"], s, feeds)[0]
    mask = torch.ones(2, 1, T)
    with torch.no_grad():
        want = dit(torch.from_numpy(x), mask, torch.from_numpy(mu), torch.from_numpy(t),
                                      torch.from_numpy(spks), torch.from_numpy(cond),
                                      dit_attention_mask(mask, streaming, 50))
    assert torch.equal(velocity, want)


# --- ONNX export + onnxruntime ----------------------------------------------------------------------


def _export(module: nn.Module, s: GraphSpec, path: Path) -> None:
    feeds = s.sample_inputs(s.trace)
    args = tuple(torch.from_numpy(feeds[n]) for n in s.input_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and constant-folding notes
        torch.onnx.export(module, args, path, dynamo=False, opset_version=s.opset,
                          input_names=s.input_names, output_names=s.output_names,
                          dynamic_axes=_dynamic_axes(s))


@pytest.fixture(scope="module")
def exported(cfg: ModelConfig, wrappers: dict[str, nn.Module],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("onnx")
    paths = {}
    for name in GRAPHS:
        paths[name] = out / f"{name}.onnx"
        _export(wrappers[name], _spec(name, cfg), paths[name])
    return paths


def _dims(value_info: Any) -> tuple[int | str, ...]:
    return tuple(d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim)


@pytest.mark.parametrize("name", GRAPHS)
def test_exported_graph_io_matches_spec(name: str, cfg: ModelConfig, exported: dict[str, Path]) -> None:
    s = _spec(name, cfg)
    model = onnx.load(exported[name])
    assert model.ir_version <= 10  # onnxruntime 1.31 loads up to IR 10
    onnx.checker.check_model(model)
    for got, want in [(model.graph.input, s.inputs), (model.graph.output, s.outputs)]:
        assert [v.name for v in got] == [t.name for t in want]
        for v, t in zip(got, want, strict=True):
            assert v.type.tensor_type.elem_type == ONNX_DTYPES[t.dtype], t.name
            if got is model.graph.input:
                assert _dims(v) == t.shape, t.name
            else:
                # The legacy exporter leaves some static output dims unknown (named after the node, e.g.
                # mu's 1 and 80 behind PreLookaheadLayer's computed Pad); runtime shapes are checked below.
                dims = _dims(v)
                assert len(dims) == len(t.shape), t.name
                assert all(d == w or (isinstance(w, int) and isinstance(d, str))
                           for d, w in zip(dims, t.shape, strict=True)), (t.name, dims)


def test_llm_graph_has_one_matmul_per_shared_input(cfg: ModelConfig, exported: dict[str, Path]) -> None:
    """q|k|v and gate|up are one weight matmul each in the graph, their weights stacked (`_linears`): per
    layer qkv, o, gate|up and down, then the speech decoder."""
    model = onnx.load(exported["llm"])
    weights = {i.name: tuple(i.dims) for i in model.graph.initializer}
    shapes = [weights[n.input[1]] for n in model.graph.node
              if n.op_type == "MatMul" and n.input[1] in weights]
    q = cfg.llm.qwen
    heads, kv, head_dim = q.num_attention_heads, q.num_key_value_heads, q.head_dim
    layer = [(q.hidden_size, (heads + 2 * kv) * head_dim), (heads * head_dim, q.hidden_size),
             (q.hidden_size, 2 * q.intermediate_size), (q.intermediate_size, q.hidden_size)]
    assert shapes[:-1] == layer * q.num_hidden_layers
    assert len(shapes) == 4 * q.num_hidden_layers + 1


def test_dit_export_is_what_onnxruntime_fuses(cfg: ModelConfig, exported: dict[str, Path], tmp_path: Path
                                              ) -> None:
    """The DiT's export is written for onnxruntime's fusions: each block's queries scaled by a constant
    (`dit._attention`; no scale computed from a shape), so that its scores are one `FusedMatMul` reading the
    keys transposed in place, with no pass over the keys of its own; its GELU one `FastGelu` (`_TanhGelu`);
    and no masking of query rows (every frame a real one)."""
    nodes = onnx.load(exported["flow_estimator_cached"]).graph.node
    assert not [n for n in nodes if n.op_type in ("Sqrt", "Where") and "/transformer_blocks." in n.name]
    depth = cfg.flow.dit.depth
    keys = {n.output[0] for n in nodes if n.op_type == "Transpose" and n.input[0].startswith("present_key_")}
    assert len(keys) == depth
    assert sorted(n.op_type for n in nodes if keys & set(n.input)) == ["MatMul"] * depth
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(exported["flow_estimator_cached"]), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(tmp_path / "optimized.onnx").graph.node
    readers = [n for n in optimized if any(i.startswith("present_key_") for i in n.input)]
    assert [n.op_type for n in readers] == ["FusedMatMul"] * depth
    assert all(onnx.helper.get_node_attr_value(n, "transB") == 1 for n in readers)
    assert [n.op_type for n in optimized].count("FastGelu") == depth
    assert not [n for n in optimized if n.op_type == "Tanh" and "/ff/" in n.name]


def test_the_dit_export_for_onnxruntime_computes_the_standard_ones_outputs(
        cfg: ModelConfig, exported: dict[str, Path], flow: flow_net.CausalMaskedDiffWithDiT,
        tmp_path: Path) -> None:
    """Written for onnxruntime alone (`onnxruntime_only`), each block's RoPE is two `RotaryEmbedding`s over
    the whole q and k (head 0's channels rotated) and its attention over the caches one
    `MultiHeadAttention`; its modulated norms are LayerNormalizations with the modulation as their scale and
    bias; Mish has no Softplus. onnxruntime's CPU provider computes the standard export's outputs at every
    case of the spec to float rounding: its rotary kernel rounds its own way (fused multiply-adds), so do
    the fused norms and Mish's other form; the attention alone is exact (a power-of-two scale; the mask
    adds 0 or -inf)."""
    s = _spec("flow_estimator_cached", cfg)
    path = tmp_path / "for_onnxruntime.onnx"
    _export(FlowEstimatorCachedGraph(flow.decoder.estimator, onnxruntime_only=True).eval(), s, path)
    nodes = onnx.load(path).graph.node
    depth, dims = cfg.flow.dit.depth, cfg.flow.dit
    fused = [n for n in nodes if n.op_type == "MultiHeadAttention"]
    assert len(fused) == depth and all(n.domain == "com.microsoft" for n in fused)
    assert [n.output[1:] for n in fused] == [[f"present_key_{i}", f"present_value_{i}"] for i in range(depth)]
    rope = [n for n in nodes if n.op_type == "RotaryEmbedding"]
    assert len(rope) == 2 * depth  # q and k
    assert {onnx.helper.get_node_attr_value(n, "rotary_embedding_dim") for n in rope} == {dims.dim_head}
    assert not [n for n in nodes if n.op_type in ("Softmax", "Neg", "Softplus")]
    assert not [n for n in nodes if n.op_type in ("Split", "Concat") and "/attn/" in n.name]
    linears = [n for n in nodes if n.op_type == "MatMul" and "/attn/" in n.name]
    assert len(linears) == 4 * depth  # q, k, v, out: the attention's own products are in the operator
    norms = [n for n in nodes if n.op_type == "LayerNormalization"]
    assert len(norms) == 2 * depth + 1 and all(len(n.input) == 3 for n in norms)
    initializers = {t.name for t in onnx.load(path).graph.initializer}
    assert not [n for n in norms if n.input[1] in initializers]  # the modulation, not a fixed weight
    plain, ort_only = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
                       for p in (exported["flow_estimator_cached"], path))
    for case in (s.trace, *s.validate):
        feeds = s.sample_inputs(case)
        for name, a, b in zip(s.output_names, plain.run(None, feeds), ort_only.run(None, feeds), strict=True):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), (dict(case.dims), name)


@pytest.mark.parametrize("name", ["llm", "llm_prefill"])
def test_the_llm_export_for_onnxruntime_computes_the_standard_ones_outputs(
        name: str, cfg: ModelConfig, lm: llm_net.CosyVoice3LM, tmp_path: Path) -> None:
    """Written for onnxruntime alone (`onnxruntime_only`), each layer's RoPE and attention over its cache is
    one `GroupQueryAttention` (the cache taken as a buffer it fills, the new positions written after it),
    with none of the standard export's softmax, causal mask or rotated halves; onnxruntime's CPU provider
    computes the standard export's log-probs and caches at every case of the spec, with and without a
    cache before the new positions, to float rounding (its kernel rounds its own way)."""
    s = _spec(name, cfg)
    paths = {only: tmp_path / f"{only}.onnx" for only in (False, True)}
    for only, path in paths.items():
        _export(LLMGraph(lm, onnxruntime_only=only).eval(), s, path)
    nodes = onnx.load(paths[True]).graph.node
    layers = cfg.llm.qwen.num_hidden_layers
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers and all(n.domain == "com.microsoft" for n in gqa)
    assert [n.output[1:] for n in gqa] == [[f"present_key_{i}", f"present_value_{i}"] for i in range(layers)]
    assert [n.op_type for n in nodes].count("Softmax") == 0 and "Where" not in [n.op_type for n in nodes]
    plain, ort_only = (ort.InferenceSession(str(paths[only]), providers=["CPUExecutionProvider"])
                       for only in (False, True))
    cases = (s.trace, *s.validate)
    assert {case.dims["past_len"] > 0 for case in cases} == {False, True}
    for case in cases:
        feeds = s.sample_inputs(case)
        for out, a, b in zip(s.output_names, plain.run(None, feeds), ort_only.run(None, feeds), strict=True):
            assert a.shape == b.shape, (dict(case.dims), out)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), (dict(case.dims), out)


@pytest.mark.parametrize("name", GRAPHS)
def test_onnxruntime_matches_torch(name: str, cfg: ModelConfig, wrappers: dict[str, nn.Module],
                                   exported: dict[str, Path]) -> None:
    s = _spec(name, cfg)
    sess = ort.InferenceSession(str(exported[name]), providers=["CPUExecutionProvider"])
    for label, feeds in [(str(dict(c.dims)), s.sample_inputs(c)) for c in s.validate]:
        got = sess.run(s.output_names, feeds)
        want = _run(wrappers[name], s, feeds)
        for out, g, w in zip(s.outputs, got, want, strict=True):
            assert g.shape == tuple(w.shape), (label, out.name)
            err = s.tolerances[out.name].measure(g, w.numpy())
            assert err <= s.tolerances[out.name].bound, (label, out.name, err)
