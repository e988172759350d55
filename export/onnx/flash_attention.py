"""onnxruntime's flash attention for a float32 graph's cached `MultiHeadAttention` calls that allow it.

onnxruntime's CPU `MultiHeadAttention` kernel runs a tiled (flash) attention, its scores kept in the L2
cache, only for a node with neither an attention bias nor caches (no past inputs, no present outputs);
otherwise it writes every score (B, H, T, S) to memory, adds the bias and runs the softmax over them. The
DiT's node has both, though a call over frames with nothing cached whose every key is visible (the offline
flow, a stream's final full-attention re-run: most of the DiT's work) needs neither. So each such node goes
into an `If` on that condition, computed from the call's own inputs: its then-branch is the operator
without bias or caches, the present keys/values the new ones in (B, H, T, Dh); its else-branch the node as
it was. The two kernels sum in different orders (outputs 2e-7 to 8e-7 apart on unit-scale inputs).

Only for graphs whose activations are float32 (the quantized ones): the flash kernel is float32's alone.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

MHA = "MultiHeadAttention"
MS_DOMAIN = "com.microsoft"
_BIAS, _PAST_KEY, _PAST_VALUE = 5, 6, 7
"""`MultiHeadAttention`'s inputs: query, key, value, bias, key_padding_mask, attention_bias, past_key,
past_value."""
_PREFIX = "flash_attention"
_ZERO_LEN, _ZERO_SCORE = f"{_PREFIX}/zero_len", f"{_PREFIX}/zero_score"


def _wrappable(node: onnx.NodeProto) -> bool:
    """A node with an attention bias, past keys/values and present outputs, and nothing the flash kernel
    lacks (a q/k/v bias, a key padding mask, a causal flag)."""
    inputs = list(node.input) + [""] * (8 - len(node.input))
    flags = {a.name: a for a in node.attribute}
    return (node.op_type == MHA and node.domain == MS_DOMAIN and len(node.output) == 3 and all(node.output)
            and not inputs[3] and not inputs[4] and all(inputs[i] for i in (_BIAS, _PAST_KEY, _PAST_VALUE))
            and ("unidirectional" not in flags or flags["unidirectional"].i == 0))


def flash_when_unmasked(model: onnx.ModelProto) -> int:
    """Wrap every cached float32 `MultiHeadAttention` of `model`'s main graph in an `If` that runs it
    without bias and caches where its call has nothing cached and masks no key (see the module's doc), in
    place; returns how many were wrapped."""
    graph = model.graph
    if not any(_wrappable(n) for n in graph.node):
        return 0
    nodes: list[onnx.NodeProto] = []
    unmasked: dict[str, str] = {}  # attention bias -> its "every key visible" flag
    constants = {_ZERO_LEN: helper.make_tensor("", TensorProto.INT64, [1], [0]),
                 _ZERO_SCORE: helper.make_tensor("", TensorProto.FLOAT, [], [0.0])}
    wrapped = 0
    for node in graph.node:
        if not _wrappable(node):
            nodes.append(node)
            continue
        tag = f"{node.name or node.output[0]}/flash"
        bias = node.input[_BIAS]
        if bias not in unmasked:
            unmasked[bias] = _unmasked_flag(nodes, bias, tag)
        heads = _heads(node)
        constants.setdefault(_heads_shape(heads),
                             helper.make_tensor("", TensorProto.INT64, [4], [0, 0, heads, -1]))
        cond = f"{tag}/cond"
        nodes += [helper.make_node("Shape", [node.input[_PAST_KEY]], [f"{tag}/past_len"], start=2, end=3),
                  helper.make_node("Equal", [f"{tag}/past_len", _ZERO_LEN], [f"{tag}/no_past"]),
                  helper.make_node("And", [f"{tag}/no_past", unmasked[bias]], [cond])]
        nodes.append(helper.make_node("If", [cond], list(node.output), name=f"{tag}/if",
                                      then_branch=_flash_branch(node, tag),
                                      else_branch=_masked_branch(node, tag)))
        wrapped += 1
    for name, tensor in constants.items():
        tensor.name = name
        graph.initializer.append(tensor)
    del graph.node[:]
    graph.node.extend(nodes)
    return wrapped


def _unmasked_flag(nodes: list[onnx.NodeProto], bias: str, tag: str) -> str:
    """Append the nodes that test whether the additive `bias` is all zeros (masks no key, moves no score);
    returns the flag's name."""
    flag = f"{tag}/unmasked"
    nodes += [helper.make_node("ReduceMin", [bias], [f"{tag}/bias_min"], keepdims=0),
              helper.make_node("ReduceMax", [bias], [f"{tag}/bias_max"], keepdims=0),
              helper.make_node("Equal", [f"{tag}/bias_min", _ZERO_SCORE], [f"{tag}/min_zero"]),
              helper.make_node("Equal", [f"{tag}/bias_max", _ZERO_SCORE], [f"{tag}/max_zero"]),
              helper.make_node("And", [f"{tag}/min_zero", f"{tag}/max_zero"], [flag])]
    return flag


def _flash_branch(node: onnx.NodeProto, tag: str) -> onnx.GraphProto:
    """The attention of q, k, v (B, T, H Dh) alone (the flash kernel's form) and, as the present keys and
    values with nothing cached, k and v in (B, H, T, Dh)."""
    q, k, v = node.input[:3]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    y, keys, values = (f"{tag}/{name}" for name in ("y", "keys", "values"))
    split = _heads_shape(_heads(node))
    body = [helper.make_node(MHA, [q, k, v], [y], name=f"{tag}/attention", domain=MS_DOMAIN, **attrs)]
    for new, present in ((k, keys), (v, values)):
        body += [helper.make_node("Reshape", [new, split], [f"{present}/bthd"]),
                 helper.make_node("Transpose", [f"{present}/bthd"], [present], perm=[0, 2, 1, 3])]
    return helper.make_graph(body, f"{tag}/unmasked", [], [_float(y), _float(keys), _float(values)])


def _masked_branch(node: onnx.NodeProto, tag: str) -> onnx.GraphProto:
    """The node as it was, under new output names (a subgraph may not write its parent's values)."""
    inner = onnx.NodeProto()
    inner.CopyFrom(node)
    outputs = [f"{tag}/masked_{i}" for i in range(3)]
    inner.output[:] = outputs
    return helper.make_graph([inner], f"{tag}/masked", [], [_float(o) for o in outputs])


def _heads(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "num_heads")


def _heads_shape(heads: int) -> str:
    """The initializer (0, 0, heads, -1): (B, T, H Dh) -> (B, T, H, Dh)."""
    return f"{_PREFIX}/heads_shape_{heads}"


def _float(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
