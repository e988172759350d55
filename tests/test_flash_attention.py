"""`flash_when_unmasked`: a cached float32 `MultiHeadAttention` runs onnxruntime's flash kernel (the node
without bias and caches) exactly when its call has nothing cached and its bias is all zeros, and the node as
it was otherwise, with the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper

from cosyvoice_export.onnx.flash_attention import MHA, MS_DOMAIN, flash_when_unmasked

HEADS, HEAD_DIM = 2, 8
DIM = HEADS * HEAD_DIM
ORIGINAL = "attention"


def _model(**inputs: str) -> onnx.ModelProto:
    """One `MultiHeadAttention` over q, k, v (2, T, DIM) with the inputs given (by their index's name)
    beside them, and the outputs it has with past inputs."""
    order = ("q", "k", "v", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value")
    names = ["q", "k", "v", *(inputs.get(n, "") for n in order[3:])]
    while not names[-1]:
        names.pop()
    shapes = {"q": [2, "T", DIM], "k": [2, "T", DIM], "v": [2, "T", DIM], "attention_bias": [1, 1, "T", "S"],
              "past_key": [2, HEADS, "P", HEAD_DIM], "past_value": [2, HEADS, "P", HEAD_DIM],
              "key_padding_mask": [2, "S"]}
    graph_inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "key_padding_mask"
                                                  else TensorProto.FLOAT, shapes[n]) for n in names if n]
    outputs = ["y", "present_key", "present_value"] if "past_key" in inputs else ["y"]
    node = helper.make_node(MHA, names, outputs, name=ORIGINAL, domain=MS_DOMAIN, num_heads=HEADS)
    out_shapes = {"y": [2, "T", DIM], "present_key": [2, HEADS, "S", HEAD_DIM],
                  "present_value": [2, HEADS, "S", HEAD_DIM]}
    graph_outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, out_shapes[o]) for o in outputs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


CACHED = {"attention_bias": "attention_bias", "past_key": "past_key", "past_value": "past_value"}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tmp_path: Path
         ) -> tuple[list[np.ndarray], set[str]]:
    """The outputs, and the names of the attention nodes that ran (from onnxruntime's profile)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.enable_profiling = True
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    out = session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    ran = {e["name"].removesuffix("_kernel_time") for e in events
           if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == MHA}
    return out, ran


def _feeds(new: int, past: int, bias: np.ndarray | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal((2, new, DIM), dtype=np.float32) for n in ("q", "k", "v")}
    feeds |= {n: rng.standard_normal((2, HEADS, past, HEAD_DIM), dtype=np.float32)
              for n in ("past_key", "past_value")}
    feeds["attention_bias"] = np.zeros((1, 1, new, past + new), np.float32) if bias is None else bias
    return feeds


def _block_causal(new: int, block: int) -> np.ndarray:
    visible = np.arange(new)[None, :] < (np.arange(new)[:, None] // block + 1) * block
    return np.where(visible, 0.0, -np.inf).astype(np.float32)[None, None]


def _raised(new: int) -> np.ndarray:
    """A bias that masks nothing and is 0 but for one score it raises."""
    bias = np.zeros((1, 1, new, new), np.float32)
    bias[0, 0, 3, 4] = 0.5
    return bias


def test_a_cached_attention_is_wrapped_in_an_if() -> None:
    model = _model(**CACHED)
    assert flash_when_unmasked(model) == 1
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if n.op_type == "If"]
    branches = {a.name: a.g for a in node.attribute}
    flash = [n for n in branches["then_branch"].node if n.op_type == MHA]
    # the flash kernel's form: q, k, v alone, one output
    assert len(flash) == 1 and list(flash[0].input) == ["q", "k", "v"] and len(flash[0].output) == 1
    (masked,) = branches["else_branch"].node
    assert masked.name == ORIGINAL and list(masked.input) == list(_model(**CACHED).graph.node[0].input)
    assert [n.op_type for n in model.graph.node].count(MHA) == 0


@pytest.mark.parametrize("case", ["nothing cached, unmasked", "nothing cached, block-causal",
                                  "cached, unmasked", "a nonzero bias"])
def test_the_flash_branch_runs_exactly_when_nothing_is_cached_or_masked(case: str, tmp_path: Path) -> None:
    new = 12
    feeds = {"nothing cached, unmasked": _feeds(new, 0),
             "nothing cached, block-causal": _feeds(new, 0, _block_causal(new, 5)),
             "cached, unmasked": _feeds(new, 7),
             "a nonzero bias": _feeds(new, 0, _raised(new))}[case]
    want, ran = _run(_model(**CACHED), feeds, tmp_path / "original")
    assert ran == {ORIGINAL}
    wrapped = _model(**CACHED)
    flash_when_unmasked(wrapped)
    got, ran = _run(wrapped, feeds, tmp_path / "wrapped")
    if case == "nothing cached, unmasked":
        assert ran == {f"{ORIGINAL}/flash/attention"}
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-6)
        for g, w in zip(got[1:], want[1:], strict=True):  # the new keys/values themselves
            np.testing.assert_array_equal(g, w)
    else:
        assert ran == {ORIGINAL}
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("inputs", [{}, {"attention_bias": "attention_bias"},
                                    {**CACHED, "key_padding_mask": "key_padding_mask"}],
                         ids=["uncached, unbiased", "no caches", "a key padding mask"])
def test_other_attention_nodes_are_left_alone(inputs: dict[str, str]) -> None:
    model = _model(**inputs)
    before = model.SerializeToString()
    assert flash_when_unmasked(model) == 0
    assert model.SerializeToString() == before
