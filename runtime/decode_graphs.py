"""`llm_decode`'s batch steps replayed from CUDA graphs (onnxruntime's CUDA provider, `enable_cuda_graph`).

A decode step is a few hundred kernels of microseconds each; on a GPU, launching them one by one from the
host takes longer than running them (docs/performance.md, the H200's LLM step). onnxruntime can capture a
call's kernels into a CUDA graph and replay them with one launch, provided every input and output is bound at
the device address it had at the capture, with the same shape, and no node of the graph copies between host
and device (`llm_decode` takes its lengths as inputs for that). `GraphedSteps` keeps one such binding per
shape of a batch step, its rows and its buffers' length (a graph id each): the embeddings and `seqlens_k` in
device memory of their own, written before every step; `total_sequence_length` in host memory at the buffers'
length, which does not change between the steps of a shape; the log-probs in device memory, copied to the host
after the step. The runner's other calls (prefills, of any shape) run outside the graphs
(`OrtRunner.run_options`). A capture holds the GPU alone (`capture_gate`): onnxruntime captures in CUDA's
global mode, which another thread's use of the GPU breaks.

On a runner without CUDA graphs (the CPU's, in tests) the same bindings run as ordinary calls: the step is the
same function of the same inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import SEQLENS_K, TOTAL_SEQUENCE_LENGTH, cache_pairs, decode_lengths

from .runners import CPU, BufferView, OrtRunner
from .runners.capture_gate import GATE, on_device
from .runners.ort import GPU_GRAPH_ID

CAPTURE_RUNS = 3
"""A graph id's calls until onnxruntime has captured its graph: regular runs first (two in onnxruntime 1.31,
so that the capture allocates nothing), then the capture. They run with the GPU held alone (`GATE`)."""


@dataclass(frozen=True)
class _Graph:
    """One shape's binding and the device memory bound in it."""

    id: int
    binding: ort.IOBinding
    run_options: ort.RunOptions
    embeds: ort.OrtValue
    seqlens_k: ort.OrtValue
    total: ort.OrtValue
    logp: ort.OrtValue


class GraphedSteps:
    """Decode steps of `runner` (`llm_decode`) over a batch's buffers, each shape replayed from its CUDA graph
    where the runner captures them (`OrtRunner(cuda_graph=True)`). Steps over other buffers than the last
    step's (a batch's buffers replaced by longer ones) release the graphs bound to the old."""

    def __init__(self, runner: OrtRunner) -> None:
        if SEQLENS_K not in runner.spec.input_names:
            raise ValueError(f"steps replayed from CUDA graphs run on llm_decode, not {runner.spec.name}")
        self.runner = runner
        self._graphs: dict[int, _Graph] = {}
        """Rows -> the binding of a step of that many, over the buffers at `_buffers`."""
        self._buffers: tuple[int, ...] = ()
        """Where the bound buffers are: their length in positions, then their addresses."""
        self._given: Mapping[str, ort.OrtValue | BufferView] | None = None
        self._views: dict[str, BufferView] = {}
        """The last step's `buffers`, as views: a mapping given again is taken for the same buffers."""
        self._next_id = 1  # onnxruntime keeps 0, its default, to itself (and -1 runs outside the graphs)
        self._runs: dict[int, int] = {}
        """A graph id's steps so far."""
        self._pairs = cache_pairs(runner.spec)
        self._embeds = next(t for t in runner.spec.inputs if t.name == "inputs_embeds")
        self._logp = next(t for t in runner.spec.outputs if t.name == "logp")

    @property
    def graphs(self) -> int:
        """Shapes bound so far (each a CUDA graph once captured)."""
        return len(self._graphs)

    def step(self, embeds: np.ndarray, lengths: np.ndarray,
             buffers: Mapping[str, ort.OrtValue | BufferView]) -> np.ndarray:
        """One decode step of B = len(lengths) rows: embeds (B, 1, C), row b's cache the first `lengths[b]`
        positions of row b of `buffers` (`past_*` -> B rows of a buffer on the runner's device, or its first B
        rows, with room for one more position); returns logp (B, V)."""
        rows = len(lengths)
        if buffers is not self._given:
            views = {past: v if isinstance(v, BufferView) else BufferView(v, 0, rows)
                     for past, v in buffers.items()}
            at = (next(iter(views.values())).shape[2], *(v.address for v in views.values()))
            if at != self._buffers:  # other buffers: the graphs of the ones before are of no more use
                self.release()
            self._given, self._views, self._buffers = buffers, views, at
        capacity = self._buffers[0]
        graph = self._graphs.get(rows)
        if graph is None:
            with on_device(self.runner.device_type):  # device memory of its own
                graph = self._graphs[rows] = self._bind(rows, capacity, self._views)
        runs = self._runs[graph.id] = self._runs.get(graph.id, 0) + 1
        held = GATE.capture() if self.runner.cuda_graph and runs <= CAPTURE_RUNS else \
            on_device(self.runner.device_type)
        with held:
            graph.embeds.update_inplace(np.ascontiguousarray(embeds, dtype=self._embeds.np_dtype))
            graph.seqlens_k.update_inplace(decode_lengths(lengths, 1, capacity)[SEQLENS_K])
            self.runner.session.run_with_iobinding(graph.binding, graph.run_options)
            return np.array(graph.logp.numpy())  # a copy: on the CPU `numpy()` is what the next step writes

    def release(self) -> None:
        """Forget every shape's binding and graph, and the buffers: later steps bind and capture anew, under
        new graph ids."""
        with on_device(self.runner.device_type):
            for graph in self._graphs.values():
                self.runner.session.release_captured_graph(graph.id)
        self._graphs.clear()
        self._runs.clear()
        self._given, self._views, self._buffers = None, {}, ()

    def _bind(self, rows: int, capacity: int, buffers: Mapping[str, BufferView]) -> _Graph:
        runner = self.runner
        device, device_id = runner.device_type, runner.device_id
        lengths = decode_lengths(np.zeros(rows, dtype=np.int64), 1, capacity)
        graph = _Graph(
            id=self._next_id, binding=runner.session.io_binding(), run_options=ort.RunOptions(),
            embeds=ort.OrtValue.ortvalue_from_shape_and_type([rows, 1, self._embeds.shape[-1]],
                                                            self._embeds.np_dtype, device, device_id),
            seqlens_k=ort.OrtValue.ortvalue_from_numpy(lengths[SEQLENS_K], device, device_id),
            # read on the host by the attention: bound in host memory, where a step would not update a copy
            total=ort.OrtValue.ortvalue_from_numpy(lengths[TOTAL_SEQUENCE_LENGTH], CPU),
            logp=ort.OrtValue.ortvalue_from_shape_and_type([rows, self._logp.shape[-1]], self._logp.np_dtype,
                                                          device, device_id))
        self._next_id += 1
        graph.run_options.add_run_config_entry(GPU_GRAPH_ID, str(graph.id))
        binding = graph.binding
        binding.bind_ortvalue_input("inputs_embeds", graph.embeds)
        binding.bind_ortvalue_input(SEQLENS_K, graph.seqlens_k)
        binding.bind_ortvalue_input(TOTAL_SEQUENCE_LENGTH, graph.total)
        binding.bind_ortvalue_output("logp", graph.logp)
        for past, present in self._pairs:
            view = buffers[past]
            where = (view.device, device_id if view.device != CPU else 0, view.dtype, list(view.shape),
                     view.address)
            binding.bind_input(past, *where)
            binding.bind_output(present, *where)
        return graph
