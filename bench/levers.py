"""CPU speed levers: onnxruntime's graph optimisation level and intra-op threads, measured per graph; and
what the exported graphs already do about the export-side levers (Qwen's unused output layer, the DiT's
attention mask, IOBinding and pre-allocated KV caches)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import (
    DIT,
    LLM_DECODE,
    Case,
    GraphSpec,
    decode_step_case,
    dit_call_case,
    empty_caches,
)
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners import CPU, OPTIMIZATION, OrtRunner, decode_body, on_openvino

LEVER_THREADS = (1, 2)
"""Intra-op thread counts tried per graph and optimisation level."""
DIT_OUTPUTS = ["velocity"]
"""What the runtime's offline flow fetches from the DiT: its caches are never read."""


def onnxruntime_levers(bundle: RuntimeBundle, *, frames: int, past_len: int, runtime_threads: int,
                       repeats: int, on_row: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Median seconds per call of `flow_estimator_cached` (one ODE step over `frames` frames with nothing
    cached, full attention: an offline call) and the decode body the runtime runs on the CPU (`llm_decode`
    where the bundle has it, else `llm`: one decode step after `past_len` cached positions, the caches
    returned grown as `llm`'s are) for every optimisation level and thread count, each in a fresh CPU
    session; the row the runtime uses is marked (none for a graph it runs on OpenVINO: a bf16 graph's rows
    are its float32 on onnxruntime)."""
    body = decode_body(bundle, CPU)
    decode = decode_step_case(bundle.specs[body], past_len)
    points = {DIT: (*_offline_dit_call(bundle.specs[DIT], frames), DIT_OUTPUTS),
              body: (decode, bundle.specs[body].sample_inputs(decode), bundle.specs[body].output_names)}
    rows = []
    for graph, (case, feeds, outputs) in points.items():
        spec = bundle.specs[graph]
        runtime_level = runtime_optimization(bundle, graph, runtime_threads)
        for level in OPTIMIZATION:
            for threads in LEVER_THREADS:
                with OrtRunner(bundle.graph_path(graph), spec, CPU, threads=threads, optimization=level) as r:
                    seconds = _median_call(r, feeds, outputs, repeats)
                used = (level == runtime_level and threads == runtime_threads
                        and not on_openvino(bundle, graph, CPU))
                rows.append({"graph": graph, "shape": dict(case.dims), "optimization": level,
                             "threads": threads, "seconds_per_call": seconds, "runtime_default": used})
                on_row()
    return rows


def runtime_optimization(bundle: RuntimeBundle, graph: str, threads: int) -> str:
    """The optimisation level the runtime opens `graph` with at `threads` threads: asked of a CPU session
    made as the runtime makes it (`OrtRunner` without a level chooses per graph), not assumed."""
    with OrtRunner(bundle.graph_path(graph), bundle.specs[graph], CPU, threads=threads) as runner:
        level = runner.session.get_session_options().graph_optimization_level
    return next(name for name, value in OPTIMIZATION.items() if value == level)


def _offline_dit_call(spec: GraphSpec, frames: int) -> tuple[Case, dict[str, np.ndarray]]:
    """The point and feeds of the DiT's offline call over `frames` frames, as the runtime makes it:
    nothing cached (zero past frames, offset 0, zero conv context), full attention."""
    case = dit_call_case(frames, 0, 0, frames)
    return case, spec.sample_inputs(case) | empty_caches(spec)


def _median_call(runner: OrtRunner, feeds: Mapping[str, np.ndarray], outputs: Sequence[str], repeats: int
                 ) -> float:
    """Median seconds of `repeats` calls fetching `outputs`, after one warm-up call."""
    runner.infer_outputs(feeds, outputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.infer_outputs(feeds, outputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


MASK_FREE_OPS = frozenset({"MatMul", "FusedMatMul", "Softmax"})
"""Ops over (..., T, T) tensors that attention needs without a mask; every other one is the mask's."""


def attention_mask_cost(bundle: RuntimeBundle, *, frames: int, threads: int) -> dict[str, Any]:
    """What the DiT's attention mask costs its offline call (`flow_estimator_cached` over `frames` frames
    with nothing cached, full attention), from an onnxruntime profile of a call after a warm-up: the
    nodes that read or write a (..., T, T) tensor, other than the attention's matmuls and softmax
    (building the mask, turning it into an additive bias and adding that to the scores). With full
    attention none of it changes the result. `unmasked_attention`: whether the call's attention ran
    without the mask (an int8 DiT's flash branch, export/onnx/flash_attention.py)."""
    _, feeds = _offline_dit_call(bundle.specs[DIT], frames)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = OPTIMIZATION[runtime_optimization(bundle, DIT, threads)]
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / DIT)
        session = ort.InferenceSession(str(bundle.graph_path(DIT)), options,
                                       providers=["CPUExecutionProvider"])
        session.run(DIT_OUTPUTS, feeds)
        session.run(DIT_OUTPUTS, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    last = max((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and e["ts"] >= last["ts"]]
    mask_us = sum(e["dur"] for e in nodes if e["args"].get("op_name") not in MASK_FREE_OPS
                  and any(_is_square(shape, frames) for shape in _shapes(e["args"])))
    unmasked = any(e["args"].get("op_name") == "MultiHeadAttention"
                   and not any(_is_square(shape, frames) for shape in _shapes(e["args"])) for e in nodes)
    return {"frames": frames, "threads": threads, "call_s": last["dur"] / 1e6, "mask_s": mask_us / 1e6,
            "share": mask_us / last["dur"], "unmasked_attention": unmasked}


def _shapes(args: Mapping[str, Any]) -> list[list[int]]:
    """The input and output shapes of a profiled node ([{dtype: shape}, ...] each)."""
    return [shape for key in ("input_type_shape", "output_type_shape")
            for entry in args.get(key, []) for shape in entry.values()]


def _is_square(shape: Sequence[int], frames: int) -> bool:
    return len(shape) >= 2 and shape[-1] == shape[-2] == frames


def _kv_buffers_lever(bundle: RuntimeBundle) -> dict[str, Any]:
    if decode_body(bundle, CPU) == LLM_DECODE:
        return {"lever": "pre-allocated KV caches", "status": "done in the export and the runtime",
                "detail": "the decode steps run on llm_decode (GroupQueryAttention), which writes each new "
                          "position into buffers bound as its inputs and outputs (KVBuffers, "
                          "OrtRunner.infer_in_place): no step allocates or copies the cache"}
    return {"lever": "pre-allocated KV caches", "status": "not in this bundle",
            "detail": "the llm graph returns present = concat(past, new) per layer, so every step allocates "
                      "the grown cache; a bundle with llm_decode (--precision cpu-fast, or decode=int4 or "
                      "int8) writes it in place on the CPU"}


def _mask_lever(mask_cost: Mapping[str, Any] | None, measured: str) -> dict[str, Any]:
    guard = ("the NaN guard that a boolean mask brings after every block's softmax (IsNaN + Where over "
             "(2, H, T, T), 17% of a 650-frame call) is gone: the DiT turns its mask into an additive bias "
             "once, and no row is all-masked. The mask itself stays, built in the graph from `offset` and "
             "`block_frames`, because it carries the block-causal streaming pattern")
    if mask_cost is not None and mask_cost["unmasked_attention"]:
        return {"lever": "remove the all-ones attention mask (DiT)", "status": "done in the export",
                "measured": mask_cost,
                "detail": f"{guard}; a call with nothing cached whose mask hides no key (the offline flow, a "
                          "stream's final re-run) runs each block's attention without it, in onnxruntime's "
                          f"flash kernel (an If per block, in an int8 DiT); {measured}"}
    return {"lever": "remove the all-ones attention mask (DiT)", "status": "partly done in the export",
            "measured": mask_cost,
            "detail": f"{guard}, and is added to every block's scores, so offline calls pay for it too; "
                      f"{measured}"}


def export_levers(bundle: RuntimeBundle, mask_cost: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The export-side levers, as our graphs stand (read from their specs and exporters, not re-done);
    `mask_cost` is `attention_mask_cost`'s measurement, None where it was not taken."""
    body = decode_body(bundle, CPU)
    logp_shape = bundle.specs[body].outputs[0].shape
    mask = ("not measured (--provider is not cpu)" if mask_cost is None else
            f"measured: {mask_cost['share']:.1%} of a full-attention call at {mask_cost['frames']} frames "
            f"({mask_cost['mask_s'] * 1e3:.3g} of {mask_cost['call_s'] * 1e3:.3g} ms, onnxruntime profile)")
    return [
        {"lever": "skip Qwen's 151,936-way output layer", "status": "done in the export",
         "detail": f"the {body} graph's only logits are `logp` {tuple(logp_shape)}: llm_decoder over the "
                   f"{bundle.dims.speech_vocab} speech ids at the last position; Qwen's embedding and "
                   "lm_head are not in the graph (embeddings are the runtime's tables)"},
        _mask_lever(mask_cost, mask),
        {"lever": "IOBinding for the KV cache", "status": "done in the runtime",
         "detail": "SpeechTokenLM.step binds present_* as OrtValues left where the session computed them "
                   "and feeds them back as past_* (OrtRunner.infer_kept): no host copy of the cache"},
        _kv_buffers_lever(bundle),
    ]
