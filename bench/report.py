"""The figures, how repeats are summarised and compared, and the table printed on stdout.

`FIGURES` is the one list of per-case figures: the JSON keys, the table rows and the direction of each
runtime-vs-torch ratio all come from it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cosyvoice_graphs import DIT, FLOW_ENCODER, HIFT_DECODER, HIFT_F0, LLM, LLM_DECODE, LLM_PREFILL
from cosyvoice_runtime.runners.ort_settings import CONV_ALGO_SEARCH

from .backend import Figures
from .graph_calls import ANY, DEVICE_COPIES


@dataclass(frozen=True)
class Figure:
    """One per-case figure of a backend."""

    key: str
    label: str
    unit: str
    """As printed; `scale` converts the stored value (seconds, bytes) into it."""
    better: Literal["lower", "higher"] | None
    """Which way is faster; None: a description of the work, with no ratio."""
    scale: float = 1.0


FIGURES: tuple[Figure, ...] = (
    Figure("first_chunk_cold_uncached_s", "first chunk, cold, prompt extracted", "s", "lower"),
    Figure("first_chunk_cold_cached_s", "first chunk, cold, cached prompt", "s", "lower"),
    Figure("first_chunk_warm_uncached_s", "first chunk, warm, prompt extracted", "s", "lower"),
    Figure("first_chunk_warm_cached_s", "first chunk, warm, cached prompt", "s", "lower"),
    Figure("first_chunk_warm_cached_p95_s", "its 95th percentile over the rounds", "s", "lower"),
    Figure("first_chunk_audio_s", "first chunk's audio", "s", None),
    Figure("first_chunk_llm_s", "first chunk (warm, cached): LLM", "s", "lower"),
    Figure("first_chunk_flow_s", "first chunk (warm, cached): flow", "s", "lower"),
    Figure("first_chunk_vocoder_s", "first chunk (warm, cached): vocoder", "s", "lower"),
    Figure("first_chunk_policy_warm_cached_s", "first chunk, warm, cached, --first-chunk-tokens", "s",
           "lower"),
    Figure("first_chunk_policy_audio_s", "its audio (--first-chunk-tokens)", "s", None),
    Figure("first_chunk_policy_llm_s", "its LLM (--first-chunk-tokens)", "s", "lower"),
    Figure("first_chunk_policy_flow_s", "its flow (--first-chunk-tokens)", "s", "lower"),
    Figure("first_chunk_policy_vocoder_s", "its vocoder (--first-chunk-tokens)", "s", "lower"),
    Figure("first_chunk_text_stream_s", "first chunk, text streamed in, from its first word", "s", "lower"),
    Figure("first_chunk_text_stream_words", "words sent by then (one every 75 ms)", "", None),
    Figure("rtf_offline", "RTF offline", "", "lower"),
    Figure("rtf_stream", "RTF streaming", "", "lower"),
    Figure("stream_final_wait_s", "streaming: the final chunk's wait", "s", "lower"),
    Figure("rtf_stream_policy", "RTF streaming, --flow-window", "", "lower"),
    Figure("stream_final_wait_policy_s", "its final chunk's wait (--flow-window)", "s", "lower"),
    Figure("front_end_s", "front end (text)", "ms", "lower", 1e3),
    Figure("prompt_s", "prompt features", "ms", "lower", 1e3),
    Figure("llm_prefill_s", "LLM prefill", "ms", "lower", 1e3),
    Figure("llm_per_token_s", "LLM per token", "ms", "lower", 1e3),
    Figure("llm_tokens_per_s", "LLM tokens/s", "1/s", "higher"),
    Figure("llm_s", "LLM total", "s", "lower"),
    Figure("flow_s", "flow (encoder + ODE)", "s", "lower"),
    Figure("flow_per_step_s", "flow per ODE step", "ms", "lower", 1e3),
    Figure("hift_s", "HiFT", "s", "lower"),
    Figure("llm_prefill_len", "LLM prefill positions", "", None),
    Figure("llm_steps", "LLM steps (pinned)", "", None),
    Figure("speech_tokens", "speech tokens kept", "", None),
    Figure("audio_s", "audio", "s", None),
    Figure("load_s", "open (cold)", "s", "lower"),
    Figure("peak_rss_mib", "peak RSS (fresh process)", "MiB", "lower"),
    Figure("rss_baseline_mib", "fresh process's RSS before opening", "MiB", None),
    Figure("rss_after_mib", "fresh process's RSS after the case", "MiB", "lower"),
    Figure("gpu_memory_peak_mib", "GPU memory peak", "MiB", "lower"),
    Figure("gpu_utilization_mean_pct", "GPU utilisation mean", "%", None),
)
FIGURE_KEYS = tuple(f.key for f in FIGURES)
SCALING_FIGURES = (
    "first_chunk_warm_cached_s", "first_chunk_llm_s", "first_chunk_flow_s", "first_chunk_vocoder_s",
    "first_chunk_policy_warm_cached_s", "first_chunk_policy_llm_s", "first_chunk_policy_flow_s",
    "first_chunk_policy_vocoder_s", "llm_per_token_s", "flow_per_step_s", "hift_s", "rtf_offline",
)
"""The figures of a thread-scaling row: the warm first chunk by stage and the per-stage times."""


PERCENTILES = {"first_chunk_warm_cached_p95_s": ("first_chunk_warm_cached_s", 95)}
"""Figures that are a percentile of another figure over the repeats: key -> (figure, percentile)."""


def summarize(samples: Sequence[Figures]) -> Figures:
    """Every figure's median over the repeats (None where no repeat has it; counts stay integers), and the
    `PERCENTILES` (nearest rank: with 3 rounds the 95th is the slowest)."""
    out: Figures = {}
    for key, (source, q) in PERCENTILES.items():
        ranked = sorted(float(v) for s in samples if (v := s.get(source)) is not None)
        out[key] = ranked[math.ceil(q / 100 * len(ranked)) - 1] if ranked else None
    for key in FIGURE_KEYS:
        if key in PERCENTILES:
            continue
        values = [v for s in samples if (v := s.get(key)) is not None]
        if not values:
            out[key] = None
        elif all(isinstance(v, int) for v in values):
            out[key] = statistics.median_low(values)
        else:
            out[key] = float(statistics.median(values))
    return out


def speedups(runtime: Figures, torch: Figures) -> dict[str, float | None]:
    """How many times faster the runtime is, per figure: torch / runtime for times, runtime / torch for
    rates; None where either side lacks the figure or it describes the work."""
    out: dict[str, float | None] = {}
    for f in FIGURES:
        a, b = runtime.get(f.key), torch.get(f.key)
        if f.better is None or a is None or b is None or a <= 0 or b <= 0:
            out[f.key] = None
        else:
            out[f.key] = b / a if f.better == "lower" else a / b
    return out


# --- the table ---------------------------------------------------------------------------------------


def _num(value: Any, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int) and scale == 1.0:
        return str(value)
    v = float(value) * scale
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    digits = max(0, 3 - int(math.floor(math.log10(abs(v)))) - 1)
    return f"{v:.{min(digits, 6)}f}"


OPTIONAL_COLUMNS = {"dit_streams_per_call": "DiT streams/call",
                   "vocoder_streams_per_call": "vocoder streams/call",
                   "dit_bound_share": "DiT calls bound",
                   "gpu_utilization_mean_pct": "GPU busy %"}
"""The streams a stacked call served, by figure (`--stack-dit`, `--stack-vocoder`), the share of the DiT's
calls that ran in a binding of `dit_graphs` (on a GPU replays from CUDA graphs, but for each binding's first
three), and on a GPU its mean utilisation: columns of the runs that have them."""


def _concurrency(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The concurrency table: each level unbatched, then batched (`decode_batch`, where the bundle batches on
    this provider) and the batched/unbatched ratio of audio per second, with the chunks that ran at once
    (chunk slots), and with `--flow-window` the batched sessions on it and their ratio to the batched
    ones (window); LLM tok/s is decodings alone; with `--stack-dit` or `--stack-vocoder`, the streams a DiT
    or vocoder call served; on a GPU, its mean utilisation during the sessions."""
    batched = any(r.get("batched") for r in rows)
    extra = [key for key in OPTIONAL_COLUMNS if any(key in r for r in rows)]
    header = ["sessions", "length", "shared", "wall s", "audio s/s", "session RTF", "first chunk mean s",
              "p95 s", "LLM tok/s", "outputs match", *(OPTIONAL_COLUMNS[key] for key in extra)]
    if batched:
        header += ["batched audio s/s", "ratio", "chunk slots", "session RTF", "first chunk p95 s",
                   "LLM tok/s", "outputs match", *(OPTIONAL_COLUMNS[key] for key in extra)]
    window = any(r.get("batched_window") for r in rows)
    if window:
        header += ["window audio s/s", "window/batched", "session RTF", "first chunk p95 s", "outputs match"]
    table = []
    for r in rows:
        row = [str(r["level"]), r["length"], _num(r["shared_synthesizer"]), _num(r["wall_s"]),
               _num(r["audio_s_per_s"]), _num(r["session_rtf_mean"]), _num(r["first_chunk_mean_s"]),
               _num(r.get("first_chunk_p95_s")), _num(r.get("llm_tokens_per_s")), _outputs(r),
               *(_num(r.get(key)) for key in extra)]
        if batched:
            b = r.get("batched") or {}
            ratio = b["audio_s_per_s"] / r["audio_s_per_s"] if b else None
            row += [_num(b.get("audio_s_per_s")), _num(ratio), _num(b.get("chunk_slots")),
                    _num(b.get("session_rtf_mean")),
                    _num(b.get("first_chunk_p95_s")), _num(b.get("llm_tokens_per_s")),
                    _outputs(b) if b else "-", *(_num(b.get(key)) for key in extra)]
        if window:
            w, b = r.get("batched_window") or {}, r.get("batched") or {}
            ratio = w["audio_s_per_s"] / b["audio_s_per_s"] if w else None
            row += [_num(w.get("audio_s_per_s")), _num(ratio), _num(w.get("session_rtf_mean")),
                    _num(w.get("first_chunk_p95_s")), _outputs(w) if w else "-"]
        table.append(row)
    title = "concurrency (runtime, streamed sessions in threads, cached prompt" + (
        "; batched: their decodings in one batch" if batched else "") + (
        "; window: batched, on --flow-window, its ratio to batched" if window else "") + ")"
    return [title] + ["  " + line for line in _table(header, table)]


GRAPH_ORDER = (LLM_PREFILL, LLM, LLM_DECODE, FLOW_ENCODER, DIT, HIFT_F0, HIFT_DECODER, DEVICE_COPIES)
"""The pipeline's order, the columns of the graphs' table (a graph not listed comes after, by name)."""


def _graph_time(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where each concurrency run's wall went: per graph, the share of the wall during which at least one of
    its calls ran, its calls and their mean ms (`graph_calls.in_flight`); `any`: some graph ran, the rest
    being the host's own work and waits. Empty where no run recorded its graphs."""
    runs = [(str(r["level"]), mode, run["graphs"]) for r in rows
            for mode, run in (("unbatched", r), ("batched", r.get("batched")),
                              ("window", r.get("batched_window")))
            if run and run.get("graphs")]
    if not runs:
        return []
    seen = {graph for *_, graphs in runs for graph in graphs if graph != ANY}
    columns = [g for g in GRAPH_ORDER if g in seen] + sorted(seen - set(GRAPH_ORDER))

    def cell(f: dict[str, Any] | None) -> str:
        if not f or not f["calls"]:
            return "-"
        return f"{100 * f['share']:.0f}% ({f['calls']} x {_num(f['call_ms_mean'])} ms)"

    table = [[level, mode, cell(graphs[ANY]), *(cell(graphs.get(g)) for g in columns)]
             for level, mode, graphs in runs]
    title = ("where the sessions' wall went (each graph: the share of the wall with one of its calls running "
             "(calls x mean ms); any: some graph running, the rest the host's work and waits)")
    return [title] + ["  " + line for line in _table(["sessions", "run", ANY, *columns], table)]


def _outputs(row: dict[str, Any]) -> str:
    """Whether every session's audio equals a single stream's, and by how much it differs where not."""
    if row["outputs_match"]:
        return "yes"
    diff = row.get("outputs_max_diff")
    tokens = "" if row.get("tokens_match", True) else "; tokens differ"
    return f"NO (max {_num(diff)}{tokens})" if diff is not None else f"NO (lengths{tokens})"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    rows = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def render(result: dict[str, Any]) -> str:
    """The benchmark's JSON result as text tables."""
    m, s = result["machine"], result["settings"]
    lines = [
        f"cosyvoice-bench on {m['cpu']} ({m['usable_cpus']} usable CPUs, {m['memory_gib']} GiB), "
        f"provider {s['provider']}, {s['threads']} threads, onnxruntime {m['onnxruntime']}"
        + (f", OpenVINO {m['openvino']}" if m.get("openvino") else "")
        + (f", torch {m['torch']}" if m["torch"] else ""),
        f"bundle {result['bundle']['path']} ({result['bundle']['precision']}), prompt "
        f"{result['prompt']['seconds']:.2f} s / {result['prompt']['speech_tokens']} tokens, "
        f"{s['repeat']} warm repeat(s), median shown",
        f"CPU class {m['cpu_class']}: " + ", ".join(
            f"{name} {'yes' if present else 'no'}" for name, present in m["vector_features"].items())
        + f" (flags: {' '.join(m['cpu_flags']) or 'none listed'})",
        "graph precisions: " + ", ".join(f"{g} {p}" for g, p in result["bundle"]["graph_precisions"].items()),
        (f"GPU {g['name']} ({_num(g['memory_mib'] / 1024)} GiB, driver {g['driver']}, compute capability "
         f"{g['compute_capability']}); its memory bandwidth {_num(m['memory_bandwidth_gbs'])} GB/s "
         "(onnxruntime CUDA, on the device)" if (g := m.get("gpu")) else
         f"memory bandwidth {_num(m['memory_bandwidth_gbs'])} GB/s (numpy copy, {s['threads']} threads)"),
        "first pipeline of the process: " + "; ".join(
            f"{name} opened in {_num(f['load_s'])} s, first chunk after {_num(f['first_chunk_s'])} s"
            for name, f in result["first_use"].items()),
        "",
    ]
    vs_torch = any(c["torch"] is not None for c in result["cases"])
    if vs_torch:
        lines[-1:-1] = ["runtime ×: how many times faster (smaller) the runtime is: torch ÷ runtime for "
                        "times and memory, runtime ÷ torch for tokens/s"]
    for case in result["cases"]:
        lines.append(f"{case['length']}: {case['pinned_tokens']} LLM steps pinned; text: {case['text']!r}")
        header = ["figure", "unit", "runtime"] + (["torch", "runtime ×"] if vs_torch else [])
        rows = []
        for f in FIGURES:
            rt, th = case["runtime"][f.key], (case["torch"] or {}).get(f.key)
            if rt is None and th is None:
                continue
            row = [f.label, f.unit, _num(rt, f.scale)]
            if vs_torch:
                row += [_num(th, f.scale), _num((case["speedup"] or {}).get(f.key))]
            rows.append(row)
        lines += ["  " + line for line in _table(header, rows)]
        if vs_torch:
            lines.append(f"  same speech tokens as torch: {_num(case['same_speech_tokens'])}")
        lines += ["  " + line for line in _bounds(case["bounds"], vs_torch)] + [""]
    if result["concurrency"]:
        lines += _concurrency(result["concurrency"]) + [""]
        graphs = _graph_time(result["concurrency"])
        lines += graphs + [""] if graphs else []
    if result["thread_scaling"]:
        lines += _scaling(result["thread_scaling"]) + [""]
    levers = result["levers"]
    if levers["onnxruntime"]:
        lines.append("onnxruntime levers (CPU, ms per call, median; * = what the runtime uses)")
        lines += ["  " + line for line in _table(
            ["graph", "shape", "optimization", "threads", "ms"],
            ([r["graph"], ", ".join(f"{k}={v}" for k, v in r["shape"].items()), r["optimization"],
              str(r["threads"]), _num(r["seconds_per_call"], 1e3) + (" *" if r["runtime_default"] else "")]
             for r in levers["onnxruntime"]))]
        lines.append("")
    if levers.get("cudnn_search"):
        lines.append("cuDNN convolution algorithm search (ms per call; * = what the runtime uses)")
        lines += ["  " + line for line in _table(
            ["graph", "search", "frames", "first call ms", "warm call ms", "after another shape ms"],
            ([r["graph"], r["conv_algo_search"] + (" *" if r["conv_algo_search"] == CONV_ALGO_SEARCH else ""),
              str(r["frames"]), _num(r["first_call_ms"]), _num(r["warm_call_ms"]),
              _num(r.get("back_call_ms"))]
             for r in levers["cudnn_search"]))]
        lines.append("")
    lines.append("export levers")
    lines += [f"  {e['lever']}: {e['status']}. {e['detail']}" for e in levers["export"]]
    if result["notes"]:
        lines += ["", "notes"] + [f"  {k}: {v}" for k, v in result["notes"].items()]
    return "\n".join(lines)


def _bounds(b: dict[str, Any], vs_torch: bool) -> list[str]:
    m, k, n = b["matmul_shape"]
    torch_llm = f", torch {_num(b['llm_fraction_torch'])} (fp32 bound)" if vs_torch else ""
    torch_dit = f", torch {_num(b['dit_fraction_torch'])} (fp32 bound)" if vs_torch else ""
    torch_hift = f", torch {_num(b['hift_fraction_torch'])}" if vs_torch else ""
    int8 = (f", int8 {_num(b['int8_matmul_gflops'])} GFLOP/s for {_num(b['dit_int8_flops_per_step'], 1e-9)} "
            "GFLOP of it" if b["int8_matmul_gflops"] is not None else "")
    return [
        f"bound LLM ({b['llm_precision']}, {b['llm_weight_bytes']:g} B/weight): "
        f"{_num(b['llm_bytes_per_token'], 1e-6)} MB read per token / {_num(b['memory_bandwidth_gbs'])} GB/s "
        "= "
        f"{_num(b['llm_bound_s_per_token'], 1e3)} ms per token; of bound: runtime "
        f"{_num(b['llm_fraction_runtime'])}{torch_llm}",
        f"bound DiT ({b['dit_precision']}: {b['dit_rate']}): {_num(b['dit_flops_per_step'], 1e-9)} GFLOP per "
        f"ODE step at {b['frames']} frames / {_num(b['dit_gflops'])} GFLOP/s{int8} "
        f"(MatMul ({m}, {k}) x ({k}, {n})) = {_num(b['dit_bound_s_per_step'], 1e3)} ms per step; of bound: "
        f"runtime {_num(b['dit_fraction_runtime'])}{torch_dit}",
        f"bound HiFT ({b['hift_precision']}): {_num(b['hift_flops'], 1e-9)} GFLOP of convolutions over "
        f"{b['hift_frames']} frames / {_num(b['hift_gflops'])} GFLOP/s {b['hift_rate']} = "
        f"{_num(b['hift_bound_s'])} s; "
        f"of bound: runtime {_num(b['hift_fraction_runtime'])}{torch_hift}",
    ]


def _scaling(scaling: dict[str, Any]) -> list[str]:
    """The thread-scaling table: per thread count, the warm first chunk by stage and each stage's time
    with its fraction of the bound at that thread count."""
    rows = scaling["rows"]
    policy = any(r["first_chunk_policy_warm_cached_s"] is not None for r in rows)
    header = ["threads", "first chunk s", "LLM s", "flow s", "vocoder s"]
    header += ["policy first chunk s"] if policy else []
    header += ["LLM ms/token", "of bound", "DiT ms/step", "of bound", "HiFT s", "of bound", "RTF offline"]
    body = []
    for r in rows:
        b = r["bounds"]
        row = [str(r["threads"]), _num(r["first_chunk_warm_cached_s"]), _num(r["first_chunk_llm_s"]),
               _num(r["first_chunk_flow_s"]), _num(r["first_chunk_vocoder_s"])]
        row += [_num(r["first_chunk_policy_warm_cached_s"])] if policy else []
        row += [_num(r["llm_per_token_s"], 1e3), _num(b["llm_fraction_runtime"]),
                _num(r["flow_per_step_s"], 1e3), _num(b["dit_fraction_runtime"]), _num(r["hift_s"]),
                _num(b["hift_fraction_runtime"]), _num(r["rtf_offline"])]
        body.append(row)
    return ([f"thread scaling (runtime, {scaling['length']} case, warm, cached prompt; "
             f"{scaling['cpu_class']}; bounds measured at each thread count)"]
            + ["  " + line for line in _table(header, body)])
