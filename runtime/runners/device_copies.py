"""Tensors copied on their device by onnxruntime's own operators, each in a session of its own, so that
streams' caches on a GPU become a call's inputs, and its outputs a stream's caches, without crossing to the
host (onnxruntime's Python API copies whole tensors only): rows of several feeds as one tensor (`RowConcat`),
and tensors with frames added in front, cut from the front or dropped between others (`FramePad`). The
graphs are built with the onnx package when first needed, then kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs.providers import CPU, CUDA

from ..errors import UserError
from .base import Feed
from .capture_gate import on_device
from .ort import bound_inputs, provider_chain

COPY_OPSET = 17


def _onnx_helper() -> Any:
    """onnx's graph helper; a `UserError` (one line) where the onnx package is not installed."""
    try:
        from onnx import helper
    except ImportError as e:
        raise UserError("copying streams' DiT caches on a GPU builds small graphs with the onnx package, "
                        "which is not installed (pip install onnx; the gpu extra has it)") from e
    return helper


def _session(model: Any, provider: str, device_id: int) -> ort.InferenceSession:
    """A session of the copy graph `model` (an onnx `GraphProto`) on one thread of `provider`."""
    helper = _onnx_helper()
    model = helper.make_model(model, opset_imports=[helper.make_opsetid("", COPY_OPSET)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=provider_chain(provider, device_id))


def _run(session: ort.InferenceSession, feeds: Mapping[str, Feed], outputs: Sequence[str], provider: str,
         device_id: int, into: Mapping[str, ort.OrtValue] | None) -> dict[str, ort.OrtValue]:
    """`session` on `feeds`, its `outputs` new tensors on the provider's device or written into `into`'s."""
    with on_device(provider):
        binding = bound_inputs(session, feeds, device_id)
        for name in outputs:
            if into is None:
                binding.bind_output(name, provider, device_id)
            else:
                binding.bind_ortvalue_output(name, into[name])
        session.run_with_iobinding(binding)
    return dict(zip(outputs, binding.get_outputs(), strict=True))


class RowConcat:
    """Concatenates tensors of the given names, dtypes and ranks along their first axis, from any number of
    parts, on onnxruntime's CPU or CUDA provider (a graph per parts count)."""

    def __init__(self, tensors: Mapping[str, tuple[np.dtype[Any], int]], provider: str = CPU,
                 device_id: int = 0) -> None:
        """`tensors`: name -> (dtype, rank); `provider` "cpu" or a GPU provider (the concat runs on CUDA)."""
        self.tensors = dict(tensors)
        self.provider = CPU if provider == CPU else CUDA
        self.device_id = device_id
        self._sessions: dict[int, ort.InferenceSession] = {}

    def __call__(self, parts: Sequence[Mapping[str, Feed]], *, into: Mapping[str, ort.OrtValue] | None = None
                 ) -> dict[str, ort.OrtValue]:
        """Each name's feeds of `parts`, in order, as one tensor on the provider's device: a new one, or
        written into `into`'s (of the result's shape, on that device). Of one part, a copy."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len(parts) not in self._sessions:
            self._sessions[len(parts)] = _session(self._graph(len(parts)), self.provider, self.device_id)
        feeds = {f"{name}.{i}": part[name] for i, part in enumerate(parts) for name in self.tensors}
        return _run(self._sessions[len(parts)], feeds, list(self.tensors), self.provider, self.device_id,
                    into)

    def _graph(self, count: int) -> Any:
        """Per name, `count` inputs `name.i` and their Concat on axis 0 as the output `name`."""
        helper = _onnx_helper()
        inputs, outputs, nodes = [], [], []
        for name, (dtype, rank) in self.tensors.items():
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            shape = [f"{name}_d{axis}" for axis in range(1, rank)]
            parts = [f"{name}.{i}" for i in range(count)]
            inputs += [helper.make_tensor_value_info(p, elem, [f"{p}_rows", *shape]) for p in parts]
            outputs.append(helper.make_tensor_value_info(name, elem, ["rows", *shape]))
            nodes.append(helper.make_node("Concat", parts, [name], axis=0))
        return helper.make_graph(nodes, f"row_concat_{count}", inputs, outputs)


class FramePad:
    """Tensors of the given names, dtypes and ranks with zeros added in front of their `axis` (`pad`),
    their first entries along it cut (`cut`), each name by its own count, or a run of entries dropped
    (`drop`), on onnxruntime's CPU or CUDA provider (`Pad`, `Slice`, `Concat`; the counts host inputs)."""

    def __init__(self, tensors: Mapping[str, tuple[np.dtype[Any], int]], axis: int, provider: str = CPU,
                 device_id: int = 0) -> None:
        """`tensors`: name -> (dtype, rank), each of more than `axis` axes; `provider` "cpu" or a GPU provider
        (the copies run on CUDA)."""
        if any(rank <= axis for _, rank in tensors.values()):
            raise ValueError(f"every tensor needs an axis {axis}: {dict(tensors)}")
        self.tensors, self.axis = dict(tensors), axis
        self.provider = CPU if provider == CPU else CUDA
        self.device_id = device_id
        self._pad: ort.InferenceSession | None = None
        self._cut: ort.InferenceSession | None = None
        self._drop: ort.InferenceSession | None = None

    def pad(self, feeds: Mapping[str, Feed], frames: Mapping[str, int], *, into: Mapping[str, ort.OrtValue]
            ) -> None:
        """Write each name's feed into `into`'s tensor (on the provider's device, `frames[name]` longer along
        the axis) after that many zeros."""
        if self._pad is None:
            self._pad = _session(self._graph("Pad"), self.provider, self.device_id)
        counts = {f"{name}.pads": self._pads(name, frames[name]) for name in self.tensors}
        _run(self._pad, {**{f"{name}.in": feeds[name] for name in self.tensors}, **counts},
             list(self.tensors), self.provider, self.device_id, into)

    def cut(self, values: Mapping[str, Feed], frames: Mapping[str, int]) -> dict[str, ort.OrtValue]:
        """Each name's value without its first `frames[name]` entries along the axis, as a new tensor on the
        provider's device."""
        if self._cut is None:
            self._cut = _session(self._graph("Slice"), self.provider, self.device_id)
        counts = {f"{name}.starts": np.array([frames[name]], dtype=np.int64) for name in self.tensors}
        return _run(self._cut, {**{f"{name}.in": values[name] for name in self.tensors}, **counts},
                    list(self.tensors), self.provider, self.device_id, None)

    def drop(self, values: Mapping[str, Feed], first: int, frames: int) -> dict[str, ort.OrtValue]:
        """Each name's value without its entries `first` to `first + frames` along the axis, as a new tensor
        on the provider's device."""
        if min(first, frames) < 0:
            raise ValueError(f"cannot drop {frames} entries from entry {first}")
        if self._drop is None:
            self._drop = _session(self._graph("Drop"), self.provider, self.device_id)
        counts = {"first": np.array([first], dtype=np.int64),
                  "after": np.array([first + frames], dtype=np.int64)}
        return _run(self._drop, {**{f"{name}.in": values[name] for name in self.tensors}, **counts},
                    list(self.tensors), self.provider, self.device_id, None)

    def _pads(self, name: str, frames: int) -> np.ndarray:
        pads = np.zeros(2 * self.tensors[name][1], dtype=np.int64)
        pads[self.axis] = frames
        return pads

    def _graph(self, op: str) -> Any:
        """Per name, the input `name.in` and the output `name`, which is along the axis: Pad (zeros in front,
        as many as the input `name.pads` says), Slice (from the input `name.starts` to the end) or Drop (the
        entries before the input `first` and from the input `after` on, concatenated)."""
        helper = _onnx_helper()
        TensorProto = helper.TensorProto  # noqa: N806

        inputs, outputs, nodes, initializers = [], [], [], []
        if op in ("Slice", "Drop"):
            initializers = [helper.make_tensor("ends", TensorProto.INT64, [1], [np.iinfo(np.int64).max]),
                            helper.make_tensor("axes", TensorProto.INT64, [1], [self.axis])]
        if op == "Drop":
            initializers.append(helper.make_tensor("zero", TensorProto.INT64, [1], [0]))
            inputs += [helper.make_tensor_value_info(count, TensorProto.INT64, [1])
                       for count in ("first", "after")]
        for name, (dtype, rank) in self.tensors.items():
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            shape = [f"{name}_d{axis}" for axis in range(rank)]
            inputs.append(helper.make_tensor_value_info(f"{name}.in", elem, shape))
            out_shape = [f"{name}_o{axis}" if axis == self.axis else dim for axis, dim in enumerate(shape)]
            outputs.append(helper.make_tensor_value_info(name, elem, out_shape))
            if op == "Pad":
                inputs.append(helper.make_tensor_value_info(f"{name}.pads", TensorProto.INT64, [2 * rank]))
                nodes.append(helper.make_node("Pad", [f"{name}.in", f"{name}.pads"], [name]))
            elif op == "Drop":
                kept = [f"{name}.before", f"{name}.after"]
                nodes += [helper.make_node("Slice", [f"{name}.in", "zero", "first", "axes"], [kept[0]]),
                          helper.make_node("Slice", [f"{name}.in", "after", "ends", "axes"], [kept[1]]),
                          helper.make_node("Concat", kept, [name], axis=self.axis)]
            else:
                inputs.append(helper.make_tensor_value_info(f"{name}.starts", TensorProto.INT64, [1]))
                nodes.append(helper.make_node("Slice", [f"{name}.in", f"{name}.starts", "ends", "axes"],
                                              [name]))
        return helper.make_graph(nodes, f"frame_{op.lower()}", inputs, outputs, initializer=initializers)
