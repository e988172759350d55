"""Where a call of each hot graph spends its time, by onnxruntime's own profiler: `python -m
cosyvoice_bench.graph_profile --model BUNDLE --provider cuda --json OUT.json`.

Per graph, at the shape of a streamed first chunk's calls (an LLM decode step at a few hundred cached
positions, a DiT call over a first chunk's new frames after a prompt's prefix, the vocoder's window): the
call's wall time (median), and from the profile of the calls after a warm-up, the nodes each execution
provider ran and their time, the copies between host and device onnxruntime inserted (`Memcpy*` nodes:
on a GPU, each is a transfer and a synchronisation inside the call), and the op types that took the most
time. On a GPU this separates kernel time from per-node overhead (wall time minus node time) and names the
nodes left on the CPU. The decode step runs as the runtime runs it: on `llm_decode` (where the CPU runs it)
its caches are written in place, and `--decode-rows N` profiles a step of N batched decodings.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import (
    DIT,
    HIFT_DECODER,
    LLM_DECODE,
    MAX_BATCH,
    SEQLENS_K,
    Case,
    GraphSpec,
    cache_pairs,
    decode_step_case,
    dit_call_case,
    vocoder_case,
)
from cosyvoice_runtime.atomic_files import check_writable, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli_options import THREADS, NonEmptyPath
from cosyvoice_runtime.runners import CPU, CUDA, ORT_PROVIDERS, decode_body
from cosyvoice_runtime.runners.ort_settings import OPTIMIZATION, settings_for
from cosyvoice_runtime.synthesis import check_synthesis

from .errors import BenchError, user_errors
from .gpu import device_session

DECODE_PAST = 300
"""Cached positions of the profiled decode step (a 10 s utterance's middle, after a prompt)."""
DIT_NEW, DIT_PAST = 44, 200
"""The profiled DiT call: a first chunk's new frames after a prompt's prefix of cached frames."""
VOCODER_FRAMES = 57 + 29
"""The profiled vocoder call: a first chunk's frames and the window's left margin."""


def hot_calls(bundle: RuntimeBundle, provider: str, *, decode_rows: int = 1, decode_past: int = DECODE_PAST
              ) -> dict[str, Case]:
    """The graph the pipeline runs on `provider` for each hot call, and the call's case: the decode step of
    `decode_rows` decodings (more than one: on `llm_decode` only, else a `BenchError`) after `decode_past`
    cached positions, in buffers with room for it."""
    decode = decode_body(bundle, provider)
    if decode_rows > 1 and decode != LLM_DECODE:
        raise BenchError(f"--decode-rows {decode_rows}: batched decode steps run on llm_decode, which this "
                         f"bundle's decode steps on {provider} do not (export it with --precision cpu-fast "
                         "or decode=int4/int8/fp32 for the cpu provider, decode=fp16 for cuda)")
    llm = decode_step_case(bundle.specs[decode], decode_past, batch=decode_rows, room=1)
    dit = dit_call_case(DIT_NEW, DIT_PAST, DIT_PAST, bundle.dims.dit_block_frames)
    return {decode: llm, DIT: dit, HIFT_DECODER: vocoder_case(VOCODER_FRAMES)}


def profile_graph(bundle: RuntimeBundle, graph: str, case: Case, provider: str, *, calls: int,
                  threads: int | None) -> dict[str, Any]:
    """`calls` calls of `graph` at `case` after one warm-up, profiled; see the module's docstring."""
    spec: GraphSpec = bundle.specs[graph]
    feeds = spec.sample_inputs(case)
    options = ort.SessionOptions()
    settings = settings_for(bundle.graph_path(graph), graph)
    options.graph_optimization_level = OPTIMIZATION[settings.optimization]
    chosen = threads or settings.threads
    if chosen is not None:
        options.intra_op_num_threads = chosen
    precision = bundle.graph_precision(graph)
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / graph)
        session = device_session(str(bundle.graph_path(graph)), provider, tf32=precision.cuda_tf32,
                                 options=options)
        call = in_place_call(session, spec, feeds, provider) if SEQLENS_K in spec.input_names else (
            lambda: session.run(None, feeds))
        call()
        walls = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            walls.append(time.perf_counter() - start)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[1:]
    first = runs[0]["ts"] if runs else 0
    nodes = [e for e in events if e.get("cat") == "Node" and e["ts"] >= first
             and e.get("name", "").endswith("_kernel_time")]
    per_call = 1 / (1e3 * max(1, len(runs)))  # us summed over the calls -> ms per call
    by_provider: dict[str, dict[str, float]] = defaultdict(lambda: {"nodes": 0, "ms": 0.0})
    by_op: Counter[str] = Counter()
    memcpy = 0
    for e in nodes:
        args = e.get("args", {})
        op, where = args.get("op_name", "?"), args.get("provider", "?")
        by_provider[where]["nodes"] += 1 / max(1, len(runs))
        by_provider[where]["ms"] += e["dur"] * per_call
        by_op[op] += e["dur"]
        memcpy += op.startswith("Memcpy")
    node_ms = sum(e["dur"] for e in nodes) * per_call
    return {
        "graph": graph, "precision": precision.name, "provider": provider, "shape": dict(case.dims),
        "wall_ms": statistics.median(walls) * 1e3, "node_ms": node_ms,
        "providers": {k: {"nodes": round(v["nodes"]), "ms": v["ms"]} for k, v in by_provider.items()},
        "memcpy_nodes": round(memcpy / max(1, len(runs))),
        "top_ops_ms": {op: us * per_call for op, us in by_op.most_common(8)},
    }


def in_place_call(session: ort.InferenceSession, spec: GraphSpec, feeds: dict[str, np.ndarray],
                  provider: str = CPU) -> Callable[[], None]:
    """A call of `llm_decode` as the runtime makes it: every `present_*` written into its `past_*` buffer
    (bound to the same memory, on the provider's device), so that no call allocates or copies the
    caches."""
    binding = session.io_binding()
    device = CPU if provider == CPU else CUDA
    buffers = {past: ort.OrtValue.ortvalue_from_numpy(feeds[past], device, 0)
               for past, _ in cache_pairs(spec)}
    for name, value in feeds.items():
        if name in buffers:
            binding.bind_ortvalue_input(name, buffers[name])
        else:
            binding.bind_cpu_input(name, value)
    for past, present in cache_pairs(spec):
        binding.bind_ortvalue_output(present, buffers[past])
    for name in spec.output_names:
        if name not in {present for _, present in cache_pairs(spec)}:
            binding.bind_output(name, CPU)
    return lambda: session.run_with_iobinding(binding)


def render(rows: list[dict[str, Any]]) -> str:
    """The profiles as text: one block per graph."""
    lines = []
    for r in rows:
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        lines.append(f"{r['graph']} ({r['precision']}, {shape}) on {r['provider']}: {r['wall_ms']:.3f} ms a "
                     f"call (median), {r['node_ms']:.3f} ms in its nodes (mean), {r['memcpy_nodes']} "
                     "host/device copies")
        for where, p in sorted(r["providers"].items()):
            lines.append(f"  {where}: {p['nodes']} nodes, {p['ms']:.3f} ms")
        lines.append("  top ops (ms): " + ", ".join(f"{op} {ms:.3f}" for op, ms in r["top_ops_ms"].items()))
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Runtime bundle (cosyvoice-export all).")
@click.option("--provider", type=click.Choice(list(ORT_PROVIDERS)), default=CPU, show_default=True,
              help="onnxruntime's provider to profile on.")
@click.option("--calls", type=click.IntRange(min=1), default=20, show_default=True,
              help="Profiled calls per graph, after one warm-up.")
@click.option("--threads", type=THREADS, default=None,
              help="Intra-op threads on the CPU  [default: the runtime's setting]")
@click.option("--decode-rows", type=click.IntRange(1, MAX_BATCH), default=1, show_default=True,
              help="Decodings in the profiled decode step (a batch, as `--max-batch` runs them; more than "
                   "one needs the bundle's llm_decode: on the cpu provider, or in fp16 on cuda).")
@click.option("--decode-past", type=click.IntRange(min=0), default=DECODE_PAST, show_default=True,
              help="Cached positions of each decoding in the profiled decode step.")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write the profiles as JSON (atomically).")
def main(model: Path, provider: str, calls: int, threads: int | None, decode_rows: int, decode_past: int,
         json_out: Path | None) -> None:
    """Profile the pipeline's hot graph calls (an LLM decode step, a first chunk's DiT call, the vocoder's
    window) with onnxruntime's profiler: time per provider, host/device copies, top op types."""
    with user_errors():
        if json_out is not None:
            check_writable(json_out, "--json")
        bundle = RuntimeBundle.open(model)
        check_synthesis(bundle, provider)  # a provider this machine lacks: one line, before a session
        calls_of = hot_calls(bundle, provider, decode_rows=decode_rows, decode_past=decode_past)
        rows = [profile_graph(bundle, graph, case, provider, calls=calls, threads=threads)
                for graph, case in calls_of.items()]
    if json_out is not None:
        write_json_atomic(json_out, {"provider": provider, "onnxruntime": ort.__version__, "profiles": rows})
    click.echo(render(rows))


if __name__ == "__main__":
    main()
