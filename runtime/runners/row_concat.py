"""Several feeds' rows as one tensor on their device: onnxruntime's Concat in a session of its own, so that
streams' caches on a GPU become one call's inputs without crossing to the host (onnxruntime's Python API
copies whole tensors only)."""

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

CONCAT_OPSET = 17


class RowConcat:
    """Concatenates tensors of the given names, dtypes and ranks along their first axis, from any number of
    parts, on onnxruntime's CPU or CUDA provider. The graph of each parts count is built (with onnx) and
    opened when first needed, then kept."""

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
        with on_device(self.provider):
            session = self._session(len(parts))
            binding = bound_inputs(session, {f"{name}.{i}": part[name] for i, part in enumerate(parts)
                                             for name in self.tensors}, self.device_id)
            for name in self.tensors:
                if into is None:
                    binding.bind_output(name, self.provider, self.device_id)
                else:
                    binding.bind_ortvalue_output(name, into[name])
            session.run_with_iobinding(binding)
        return dict(zip(self.tensors, binding.get_outputs(), strict=True))

    def _session(self, count: int) -> ort.InferenceSession:
        if count not in self._sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            providers = provider_chain(self.provider, self.device_id)
            self._sessions[count] = ort.InferenceSession(self._model(count), options, providers=providers)
        return self._sessions[count]

    def _model(self, count: int) -> bytes:
        """The graph: per name, `count` inputs `name.i` and their Concat on axis 0 as the output `name`."""
        try:
            from onnx import helper
        except ImportError as e:
            raise UserError("stacking streams' DiT caches on a GPU builds a Concat graph with the onnx "
                            "package, which is not installed (pip install onnx; the gpu extra has it)") from e
        inputs, outputs, nodes = [], [], []
        for name, (dtype, rank) in self.tensors.items():
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            shape = [f"{name}_d{axis}" for axis in range(1, rank)]
            parts = [f"{name}.{i}" for i in range(count)]
            inputs += [helper.make_tensor_value_info(p, elem, [f"{p}_rows", *shape]) for p in parts]
            outputs.append(helper.make_tensor_value_info(name, elem, ["rows", *shape]))
            nodes.append(helper.make_node("Concat", parts, [name], axis=0))
        graph = helper.make_graph(nodes, f"row_concat_{count}", inputs, outputs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", CONCAT_OPSET)])
        model.ir_version = 8
        return model.SerializeToString()
