"""The benchmark run: returns the JSON-ready result that `report.render` prints.

Order: every case's peak RSS, each backend in a fresh process of its own (`peak_rss`); every case cold on
fresh pipelines, one pipeline in the process at a time; then each backend opened once and warmed up, and
per case `repeat` rounds in which the runtime and the torch reference run the same work back to back;
concurrency (runtime); the runtime again at each other thread count of the thread scaling (longest case);
with the pipelines closed, the onnxruntime levers (CPU provider) and last the machine's bandwidth and
matmul speeds, at every thread count measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cosyvoice_graphs.bundle_layout import FORMAT_VERSION
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli_options import EVERY_BLOCK
from cosyvoice_runtime.runners import CPU, CPU_PROVIDERS, CUDA, OPTIMIZATION
from cosyvoice_runtime.runners.ort_settings import CONV_ALGO_SEARCHES
from cosyvoice_runtime.synthesis import dit_replays

from .backend import Backend, Figures, FirstChunk, StreamRun
from .bounds import (
    ModelShapes,
    dit_matmul_shape,
    llm_weight_count,
    needs_bf16_rate,
    needs_int8_rate,
    stage_bounds,
)
from .cases import Case
from .gpu import conv_search_levers, describe_gpu, gpu_rates
from .levers import LEVER_THREADS, attention_mask_cost, export_levers, onnxruntime_levers
from .machine import Rates, describe, measure_rates
from .measure import GpuSampler, GpuUsage
from .peak_rss import PeakJob, cold_run, fresh_peak
from .report import SCALING_FIGURES, speedups, summarize
from .runtime_runs import RuntimeBackend

SCHEMA = "cosyvoice-bench/1"
Step = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """One benchmark run, as the command line gave it."""

    model: Path
    """The runtime bundle."""
    prompt_wav: Path
    prompt_text: str
    cases: list[Case]
    concurrency: list[int]
    threads: int
    provider: str
    repeat: int
    quick: bool
    seed: int = 0
    model_dir: Path | None = None
    """The torch reference's model directory (`--vs-torch`), None for the runtime alone."""
    latency_policy: ChunkPolicy | None = None
    """A chunk policy of the runtime's: its first chunk (`--first-chunk-tokens`) and its stream
    (`--flow-window`) measured beside upstream's schedule's and flow's; None: upstream's alone."""
    thread_scaling: bool = False
    """Also run the runtime at each of `thread_levels` (longest case) and measure the rates there."""
    chunk_slots: int | None = None
    """The batched sessions' chunks that run their flow and vocoder at once (`Synthesizer.set_max_batch`);
    None: the runtime's default for the provider and threads."""
    cuda_graphs: bool = False
    """The runtime's decode steps replay from CUDA graphs (`--cuda-graphs`)."""
    stack_dit: bool = False
    """The runtime runs concurrent streams' DiT calls stacked (`--stack-dit`)."""
    stack_vocoder: bool = False
    """The runtime runs concurrent streams' vocoder calls stacked (`--stack-vocoder`)."""


def thread_levels(threads: int) -> list[int]:
    """The thread counts of the thread scaling: 1, 2 and `threads`, none above `threads`."""
    return sorted({t for t in (1, 2, threads) if t <= threads})


@dataclass
class _Warm:
    """What the warm phase leaves for the report."""

    figures: dict[str, dict[str, list[Figures]]]
    """backend -> case -> one figures dict per repeat."""
    tokens: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """backend -> case -> the offline speech tokens of the first repeat."""
    streams: dict[str, StreamRun] = field(default_factory=dict)
    """case -> the runtime's streamed run (first repeat)."""
    policy_streams: dict[str, StreamRun] = field(default_factory=dict)
    """case -> the runtime's stream on `--flow-window` (first repeat)."""
    prompt_frames: int = 0
    prompt_tokens: int = 0
    concurrency: list[dict[str, Any]] = field(default_factory=list)


def run(s: Settings, *, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark of `s` and return its result (the `--json` document)."""
    bundle = RuntimeBundle.open(s.model)
    shapes = ModelShapes.of(bundle, s.provider)
    on_gpu = s.provider not in CPU_PROVIDERS
    def runtime_at(threads: int) -> Callable[[], Backend]:
        return lambda: RuntimeBackend(bundle, provider=s.provider, threads=threads, prompt_text=s.prompt_text,
                                      seed=s.seed, latency_policy=s.latency_policy, chunk_slots=s.chunk_slots,
                                      cuda_graphs=s.cuda_graphs, stack_dit=s.stack_dit,
                                      stack_vocoder=s.stack_vocoder)

    factories = {"runtime": runtime_at(s.threads)}
    jobs = {"runtime": PeakJob("runtime", s.model, s.prompt_wav, s.prompt_text, s.threads, s.provider,
                               s.seed, s.cuda_graphs)}
    torch_version = None
    if s.model_dir is not None:
        import torch

        from .torch_runs import TorchBackend

        torch_version = torch.__version__
        model_dir = s.model_dir
        llm = bundle.manifest.llm_checkpoint  # a bundle of `--llm rl` is compared with that LLM
        factories["torch"] = lambda: TorchBackend(model_dir, llm, threads=s.threads,
                                                  prompt_text=s.prompt_text, seed=s.seed)
        jobs["torch"] = PeakJob("torch", model_dir, s.prompt_wav, s.prompt_text, s.threads, seed=s.seed,
                                llm_checkpoint=llm)
    measure_levers = s.provider == CPU
    measure_conv_search = s.provider == CUDA
    int8, bf16 = needs_int8_rate(shapes), needs_bf16_rate(shapes)
    other_levels = [t for t in thread_levels(s.threads) if t != s.threads] if s.thread_scaling else []
    steps = (1 + len(s.cases) * len(factories) * (3 + s.repeat) + len(factories) + len(s.concurrency)
             + (2 * len(OPTIMIZATION) * len(LEVER_THREADS) if measure_levers else 0) + 2 + len(s.cases)
             + (len(CONV_ALGO_SEARCHES) if measure_conv_search else 0)
             + len(other_levels) * (s.repeat + 2))
    with tqdm(total=steps, desc="cosyvoice-bench", unit="step", disable=not progress, leave=False) as bar:
        def step(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        peaks = {name: {c.name: _peak(job, c, step) for c in s.cases} for name, job in jobs.items()}
        first_use = {name: _first_use(f, s.cases[0], s.prompt_wav) for name, f in factories.items()}
        step("first use in the process")
        cold = {name: {c.name: {**_cold(f, c, s.prompt_wav, step), **peaks[name][c.name]} for c in s.cases}
                for name, f in factories.items()}
        gpu = GpuSampler() if on_gpu else None
        warm = _warm_phase(s, factories, gpu, step)
        summary = {name: {c.name: {**summarize(warm.figures[name][c.name]), **cold[name][c.name]}
                          for c in s.cases} for name in factories}
        ratio = bundle.dims.token_mel_ratio
        frames = {c.name: warm.prompt_frames + ratio * int(summary["runtime"][c.name]["speech_tokens"] or 0)
                  for c in s.cases}
        decode_past = {c.name: int(summary["runtime"][c.name]["llm_prefill_len"] or 0) + c.tokens // 2
                       for c in s.cases}
        longest_case = max(s.cases, key=lambda c: c.tokens)
        longest = longest_case.name
        scaled = {t: _scaling_run(runtime_at(t), longest_case, s.prompt_wav, s.repeat, step)
                  for t in other_levels}
        ort_levers = (onnxruntime_levers(bundle, frames=frames[longest], past_len=decode_past[longest],
                                         runtime_threads=s.threads, repeats=1 if s.quick else 3,
                                         on_row=lambda: step("onnxruntime levers"))
                      if measure_levers else None)
        mask_cost = (attention_mask_cost(bundle, frames=frames[longest], threads=s.threads)
                     if measure_levers else None)
        step("attention mask cost")
        conv_search = (conv_search_levers(bundle, s.provider, on_row=lambda: step("cuDNN search levers"))
                       if measure_conv_search else None)
        rates: dict[str, Rates] = {}
        bandwidth = None
        for case in s.cases:
            shape = dit_matmul_shape(shapes.dit, frames[case.name])
            rates[case.name] = (gpu_rates(shape, quick=s.quick) if on_gpu else measure_rates(
                s.threads, shape, int8=int8, quick=s.quick, bandwidth_gbs=bandwidth, bf16=bf16))
            bandwidth = rates[case.name].bandwidth_gbs
            step(f"rates {case.name}")
        step("memory bandwidth")
        machine = {**describe(s.threads, torch_version), "memory_bandwidth_gbs": bandwidth,
                   "gpu": describe_gpu() if on_gpu else None}

        def bounds(case: str, threads_rates: Rates, rt: Figures, th: Figures | None) -> dict[str, Any]:
            vocoded = ratio * int(rt["speech_tokens"] or 0)
            return stage_bounds(shapes, frames[case], vocoded, decode_past[case], threads_rates, rt, th)

        cases = []
        for case in s.cases:
            rt, th = summary["runtime"][case.name], summary.get("torch", {}).get(case.name)
            cases.append({
                "length": case.name, "text": case.text, "pinned_tokens": case.tokens,
                "cpu_class": machine["cpu_class"],
                "runtime": rt, "torch": th, "speedup": speedups(rt, th) if th is not None else None,
                "same_speech_tokens": (warm.tokens["runtime"][case.name] == warm.tokens["torch"][case.name]
                                       if th is not None else None),
                "bounds": bounds(case.name, rates[case.name], rt, th),
            })
        scaling = []
        for t in thread_levels(s.threads) if s.thread_scaling else []:
            if t == s.threads:
                figures, at = summary["runtime"][longest], rates[longest]
            else:
                figures = scaled[t]
                at = measure_rates(t, rates[longest].matmul_shape, int8=int8, quick=s.quick, bf16=bf16)
                step(f"rates at {t} threads")
            scaling.append({"threads": t, **{k: figures[k] for k in SCALING_FIGURES},
                            "bounds": bounds(longest, at, figures, None)})
    return {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": {
            "model": str(s.model), "model_dir": str(s.model_dir) if s.model_dir else None,
            "prompt_wav": str(s.prompt_wav), "prompt_text": s.prompt_text, "mode": "zero-shot",
            "sampling": "ras", "seed": s.seed, "threads": s.threads, "provider": s.provider,
            "lengths": [c.name for c in s.cases], "concurrency": s.concurrency, "repeat": s.repeat,
            "quick": s.quick,
            "first_chunk_tokens": s.latency_policy.first_chunk_tokens if s.latency_policy else None,
            "flow_window": _flow_window(s.latency_policy),
            "thread_scaling": s.thread_scaling, "chunk_slots": s.chunk_slots, "cuda_graphs": s.cuda_graphs,
            "dit_graphs": s.cuda_graphs and dit_replays(bundle), "stack_dit": s.stack_dit,
            "stack_vocoder": s.stack_vocoder,
        },
        "machine": machine,
        "cpu_class": machine["cpu_class"],
        "bundle": {
            "path": str(s.model), "precision": bundle.manifest.precision,
            "graph_precisions": {name: bundle.graph_precision(name).name for name in bundle.specs},
            "format_version": FORMAT_VERSION, "dims": asdict(bundle.dims),
            "llm_weights": llm_weight_count(shapes.qwen, shapes.speech_vocab), "dit": asdict(shapes.dit),
        },
        "prompt": {"wav": str(s.prompt_wav), "speech_tokens": warm.prompt_tokens,
                   "seconds": warm.prompt_frames * bundle.dims.samples_per_frame / bundle.dims.sample_rate},
        "first_use": first_use,
        "cases": cases,
        "concurrency": warm.concurrency,
        "thread_scaling": ({"length": longest, "cpu_class": machine["cpu_class"], "rows": scaling}
                           if s.thread_scaling else None),
        "levers": {"onnxruntime": ort_levers, "cudnn_search": conv_search,
                   "export": export_levers(bundle, mask_cost)},
        "notes": _notes(s, gpu),
    }


def _first_use(factory: Callable[[], Backend], case: Case, wav: Path) -> dict[str, float]:
    """The first pipeline of the process, up to its first chunk with the prompt extracted: it also pays
    what a process loads once (the text normaliser's grammars, libraries' first calls), which the
    cold figures then leave out."""
    backend = factory()
    try:
        start = time.perf_counter()
        prompt = backend.prompt_features(wav)
        prompt_s = time.perf_counter() - start
        first = backend.first_chunk(case, prompt)
        return {"load_s": backend.load_s, "first_chunk_s": prompt_s + first.seconds}
    finally:
        backend.close()


def _peak(job: PeakJob, case: Case, step: Step) -> Figures:
    """The peak RSS of `case`'s cold run in a fresh process, and that process's RSS before it opened and
    after the case."""
    peak = fresh_peak(job, case)
    step(f"{job.backend} peak RSS {case.name}")
    return {"peak_rss_mib": peak.peak_rss_mib, "rss_baseline_mib": peak.rss_before_open_mib,
            "rss_after_mib": peak.rss_after_mib}


def _cold(factory: Callable[[], Backend], case: Case, wav: Path, step: Step) -> Figures:
    """Two fresh pipelines, each alone in the process, after `_first_use`. The first extracts the prompt
    inside the timed region and synthesises the whole case (`cold_run`); the second starts from the prompt
    the first extracted."""
    backend = factory()
    try:
        run = cold_run(backend, case, wav)
        load_s = backend.load_s
    finally:
        backend.close()
    step(f"{backend.name} cold {case.name}")
    backend = factory()
    try:
        cached = backend.first_chunk(case, run.prompt)
    finally:
        backend.close()
    step(f"{backend.name} cold {case.name}, cached prompt")
    return {"first_chunk_cold_uncached_s": run.prompt_s + run.first.seconds,
            "first_chunk_cold_cached_s": cached.seconds, "load_s": load_s}


def _warm_phase(s: Settings, factories: dict[str, Callable[[], Backend]], gpu: GpuSampler | None,
                step: Step) -> _Warm:
    """Open every backend, warm each up on the first case, run the rounds, then the concurrency levels."""
    backends: dict[str, Backend] = {}
    try:
        for name, factory in factories.items():
            backends[name] = factory()
        prompts = {name: b.prompt_features(s.prompt_wav) for name, b in backends.items()}
        for name, b in backends.items():
            b.first_chunk(s.cases[0], prompts[name])
            b.offline(s.cases[0], prompts[name])
            step(f"{name} warm-up")
        warm = _Warm({name: {c.name: [] for c in s.cases} for name in backends},
                     {name: {} for name in backends})
        for case in s.cases:
            for r in range(s.repeat):
                for name, b in backends.items():
                    figures, streamed, policy_stream, tokens = _warm(b, case, s.prompt_wav, prompts[name],
                                                                     gpu if name == "runtime" else None)
                    warm.figures[name][case.name].append(figures)
                    warm.tokens[name].setdefault(case.name, tokens)
                    if streamed is not None and name == "runtime":
                        warm.streams.setdefault(case.name, streamed)
                    if policy_stream is not None:
                        warm.policy_streams.setdefault(case.name, policy_stream)
                    step(f"{name} {case.name} {r + 1}/{s.repeat}")
        runtime = backends["runtime"]
        assert isinstance(runtime, RuntimeBackend)
        prompt = prompts["runtime"]
        warm.prompt_frames, warm.prompt_tokens = prompt.mel.shape[1], prompt.speech_tokens.shape[1]
        longest = max(s.cases, key=lambda c: c.tokens)
        for level in s.concurrency:
            warm.concurrency.append(runtime.concurrent(longest, prompt, level, warm.streams[longest.name],
                                                       gpu, warm.policy_streams.get(longest.name)))
            step(f"concurrency {level}")
        return warm
    finally:
        for b in backends.values():
            b.close()


def _warm(b: Backend, case: Case, wav: Path, prompt: Any, gpu: GpuSampler | None
          ) -> tuple[Figures, StreamRun | None, StreamRun | None, list[int]]:
    """One warm round of `case`: the first chunk with the prompt extracted in the timed region; streamed
    with the cached prompt (just the first chunk where the backend cannot stream), and on `--flow-window`;
    offline with stage timings. Returns the figures, the streamed runs and the offline speech tokens."""
    none: Callable[[], GpuUsage | None] = lambda: None  # noqa: E731
    with gpu.sample() if gpu is not None else nullcontext(none) as usage:
        start = time.perf_counter()
        fresh = b.prompt_features(wav)
        prompt_s = time.perf_counter() - start
        b.forget_prompts()  # nothing derived from the prompt is kept either (the flow's prefix)
        uncached = b.first_chunk(case, fresh)
        streamed = b.stream(case, prompt)
        cached = streamed.first if streamed is not None else b.first_chunk(case, prompt)
        policy = b.policy_first_chunk(case, prompt) if isinstance(b, RuntimeBackend) else None
        policy_stream = b.policy_stream(case, prompt) if isinstance(b, RuntimeBackend) else None
        text_stream = b.text_stream_first_chunk(case, prompt) if isinstance(b, RuntimeBackend) else None
        offline = b.offline(case, prompt)
    gpu_usage = usage()
    figures: Figures = {
        "prompt_s": prompt_s,
        "first_chunk_warm_uncached_s": prompt_s + uncached.seconds,
        "first_chunk_warm_cached_s": cached.seconds,
        "first_chunk_audio_s": cached.audio_s,
        "first_chunk_llm_s": cached.llm_s,
        "first_chunk_flow_s": cached.flow_s,
        "first_chunk_vocoder_s": cached.vocoder_s,
        **_policy_figures(policy),
        "first_chunk_text_stream_s": text_stream.seconds if text_stream else None,
        "first_chunk_text_stream_words": text_stream.words if text_stream else None,
        "rtf_stream": streamed.seconds / streamed.audio_s if streamed is not None else None,
        "stream_final_wait_s": streamed.final_wait_s if streamed is not None else None,
        "rtf_stream_policy": policy_stream.seconds / policy_stream.audio_s if policy_stream else None,
        "stream_final_wait_policy_s": policy_stream.final_wait_s if policy_stream else None,
        **offline.figures,
        "gpu_memory_peak_mib": gpu_usage.memory_peak_mib if gpu_usage else None,
        "gpu_utilization_mean_pct": gpu_usage.utilization_mean_pct if gpu_usage else None,
    }
    return figures, streamed, policy_stream, offline.speech_tokens


def _flow_window(policy: ChunkPolicy | None) -> str | int | None:
    """`--flow-window` as given (`EVERY_BLOCK` or the blocks), None without it."""
    if policy is None or policy.flow != "window":
        return None
    return EVERY_BLOCK if policy.flow_window is None else policy.flow_window


def _policy_figures(policy: FirstChunk | None) -> Figures:
    """The latency policy's first chunk, split by stage; None each without the policy."""
    return {"first_chunk_policy_warm_cached_s": policy.seconds if policy else None,
            "first_chunk_policy_audio_s": policy.audio_s if policy else None,
            "first_chunk_policy_llm_s": policy.llm_s if policy else None,
            "first_chunk_policy_flow_s": policy.flow_s if policy else None,
            "first_chunk_policy_vocoder_s": policy.vocoder_s if policy else None}


def _scaling_run(factory: Callable[[], Backend], case: Case, wav: Path, repeat: int, step: Step) -> Figures:
    """The runtime at another thread count: opened and warmed up on `case`, then `repeat` rounds of its
    first chunk (cached prompt; with the latency policy too where set) and its offline synthesis with stage
    timings; the medians of `SCALING_FIGURES`."""
    backend = factory()
    assert isinstance(backend, RuntimeBackend)
    try:
        prompt = backend.prompt_features(wav)
        backend.first_chunk(case, prompt)
        backend.offline(case, prompt)
        step(f"warm-up at {backend.threads} threads")
        rounds: list[Figures] = []
        for r in range(repeat):
            first = backend.first_chunk(case, prompt)
            policy = backend.policy_first_chunk(case, prompt)
            rounds.append({"first_chunk_warm_cached_s": first.seconds, "first_chunk_llm_s": first.llm_s,
                           "first_chunk_flow_s": first.flow_s, "first_chunk_vocoder_s": first.vocoder_s,
                           **_policy_figures(policy), **backend.offline(case, prompt).figures})
            step(f"{backend.threads} threads {r + 1}/{repeat}")
    finally:
        backend.close()
    return summarize(rounds)


def _notes(s: Settings, gpu: GpuSampler | None) -> dict[str, str]:
    """What the figures mean where the table cannot say it, and why some are null."""
    notes = {
        "first_use": "the process's first pipeline, opened and run to its first chunk (prompt extracted, "
                     f"{s.cases[0].name} case) before the cold runs: it also pays the process's one-time "
                     "loads (e.g. the text normaliser's grammars)",
        "first_chunk": "from the request (text, before its front end) to the first chunk's samples; "
                       "'prompt extracted' adds the prompt's feature extraction and derives everything "
                       "from it, 'cached prompt' starts from features extracted before and, warm, from "
                       "what the pipeline keeps per prompt (the runtime's flow prefix: the DiT's caches "
                       "of the prompt's leading blocks); cold = the first synthesis of a freshly opened "
                       "pipeline, warm = after a warm-up",
        "llm_per_token": "(LLM time - prefill call) / (steps - 1): a decode step with its embedding lookup "
                         "and sampling; tokens/s = steps / LLM time, prefill included",
        "rtf": "wall time from the request (text front end included, prompt cached) to the last sample, "
               "divided by the audio's duration; a stream's final chunk's wait: from the chunk before it to "
               "it (upstream's final chunk re-runs the flow over every frame)",
        "peak_rss": "peak RSS (VmHWM) of a fresh process of its own (python -m cosyvoice_bench.peak_rss) "
                    "that opened the pipeline, extracted the prompt and synthesised the case cold (streamed "
                    "where the backend can), nothing else loaded: the interpreter and the backend's "
                    "libraries included (torch for the reference), nothing the benchmark's process holds; "
                    "rss_baseline: that process's RSS before the pipeline opened; rss_after: its RSS once "
                    "the case ended, the pipeline still open (what a server holds between requests)",
        "bounds": "of bound = bound / measured (1 = at the hardware bound), for this CPU (cpu_class) and "
                  "the precision each graph ran at; LLM: weights (the exported graph's, from the bundle's "
                  "dims, at its precision's bytes per weight) plus the KV cache at the mean decode "
                  "position, read once per token, over the copy bandwidth; DiT: one ODE step (both CFG "
                  "rows, full attention) over the case's frames at the float32 MatMul rate, an int8 DiT's "
                  "blocks' weight matmuls at the int8 DynamicQuantizeMatMul rate; HiFT: its convolutions "
                  "over the generated frames at the float32 rate (its Snake activations' sines, "
                  "single-threaded in onnxruntime, come on top); a bf16 DiT or HiFT at OpenVINO's bf16 "
                  "MatMul rate; torch's fractions are of the float32 bounds",
        "cpu_class": "the CPU's vector class (AVX2 / AVX-512, VNNI, BF16, AMX): figures from different "
                     "classes are not comparable as equals",
    }
    if s.latency_policy is not None and s.latency_policy.flow == "window":
        window = s.latency_policy.flow_window
        notes["stream_policy"] = (
            f"--flow-window {_flow_window(s.latency_policy)}: a deviation from upstream's flow: each case "
            "also streamed with its final chunk run against the earlier chunks' caches instead of upstream's "
            "re-run over every frame, attention kept to the prompt and "
            + ("every block" if window is None else f"the last {window} 1-s blocks")
            + ", on upstream's chunk schedule, warm with the cached prompt; runtime only; where the bundle "
            "batches, each concurrency level's batched sessions again on it (batched_window)")
    if s.latency_policy is not None and s.latency_policy.first_chunk_tokens is not None:
        notes["first_chunk_policy"] = (
            f"--first-chunk-tokens {s.latency_policy.first_chunk_tokens}: the runtime's latency policy (a "
            "deviation from upstream's chunk schedule): the first chunk after that many tokens plus the "
            "flow's look-ahead, measured warm with the cached prompt beside upstream's schedule's; runtime "
            "only")
    if s.thread_scaling:
        notes["thread_scaling"] = (
            "the runtime on the longest case at each thread count (at --threads: the warm rounds' figures; "
            "otherwise its own pipeline, warmed up, the same rounds' median); the bounds use the rates "
            "measured at that thread count")
    if s.concurrency:
        notes["concurrency"] = ("runtime only: sessions start from tokenised text and a cached prompt; each "
                                "level above 1 is measured after an unmeasured round of it (warm_up: the "
                                "first time a process runs that many sessions it pays for their memory); "
                                "outputs match = every session's audio equals a single stream's (where "
                                "not, max: the largest sample difference, and whether their speech tokens "
                                "differ: a sampled draw that another rounding moved)")
    if s.model_dir is not None:
        notes["torch"] = ("eager float32 on the CPU, torch.set_num_threads = --threads; no streaming path, "
                          "so its first chunk is the first hop + look-ahead decoded, the block-causal "
                          "flow and the non-final HiFT back to back, and its streaming RTF is not "
                          "measured; its front end tokenises only (no text normalisation)")
    if gpu is None:
        notes["gpu"] = f"provider {s.provider}: no GPU in use, GPU figures are null"
    elif not gpu.available:
        notes["gpu"] = "nvidia-smi not found: GPU figures are null"
    if s.provider != CPU:
        notes["levers"] = f"onnxruntime's CPU levers are measured with --provider {CPU} only"
    if s.provider not in CPU_PROVIDERS:
        notes["gpu_bounds"] = (
            "on a GPU the bounds' rates are the GPU's, measured through onnxruntime's CUDA provider with "
            "every tensor on the device: memory bandwidth (a 1 GiB float32 array read and written) for the "
            "LLM; MatMul at the DiT's shape in the math of each graph's precision (float32 with TF32 off, "
            "TF32, float16) for the DiT and HiFT; what a stage takes beyond its bound there is time the "
            "bound does not count (kernel launches, host work between calls)")
    if s.provider == CUDA:
        notes["cudnn_search"] = (
            "cuDNN's convolution algorithm search, per mode: the vocoder graph opened fresh, its first call "
            "at each new frame count (which pays the search) and its fastest warm call; then a call at each "
            "count right after one at another (onnxruntime's CUDA Conv keeps its last shape's plans only: "
            "the runtime gives the vocoder a session per window length, ShapePool); the runtime uses "
            "cosyvoice_runtime.runners.ort_settings.CONV_ALGO_SEARCH")
    return notes
