"""One decode step made several ways, the same steps each, on `llm_decode`: `python -m
cosyvoice_bench.decode_variants --model BUNDLE --provider cuda --rows 1,4,16 --json OUT.json`.

- `runtime`: as the runtime makes it (`OrtRunner.infer_in_place`): a binding and a feed check per call, the
  new position's embeddings and the cache lengths from the host, the log-probs back to it;
- `bound once`: the runtime's batch step for CUDA graphs (`decode_graphs.GraphedSteps`) on a session without
  them: every input and output bound once, to memory on the session's device (the total sequence length,
  which the graph reads on the host, to host memory, at the buffers' length), each step writing only the
  embeddings and `seqlens_k`;
- `cuda graph` (CUDA): that binding on a session with onnxruntime's CUDA graphs on, whose first calls capture
  the step's kernels and later ones replay them (onnxruntime refuses a graph with a node that copies between
  host and device, which it then reports);
- `xqa on` / `xqa off` (CUDA): as `runtime`, on sessions made with ORT_ENABLE_XQA=1 / 0, which turns
  onnxruntime's XQA kernel for a float16 `GroupQueryAttention` decode step on or off (read when a session
  is made).

Every variant starts from the same caches, its rows at different cache lengths, and is fed the same
embeddings. Each step's log-probs are compared with `runtime`'s (the largest difference, the steps whose best
id differs) and each variant's step is timed, the log-probs' copy to the host included: the median of the
steps after the first two (a CUDA graph's capture is in those). A variant the provider cannot run is listed
with the reason.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import (
    LLM_DECODE,
    MAX_BATCH,
    GraphSpec,
    cache_pairs,
    decode_lengths,
    decode_step_case,
)
from cosyvoice_runtime.atomic_files import check_writable, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli_options import NonEmptyPath
from cosyvoice_runtime.decode_graphs import GraphedSteps
from cosyvoice_runtime.runners import CPU, CUDA, OrtRunner, decode_body

from .errors import BenchError, user_errors
from .graph_profile import DECODE_PAST

RUNTIME, BOUND_ONCE, CUDA_GRAPH, XQA_ON, XQA_OFF = "runtime", "bound once", "cuda graph", "xqa on", "xqa off"
VARIANTS = (RUNTIME, BOUND_ONCE, CUDA_GRAPH, XQA_ON, XQA_OFF)
CUDA_ONLY = {CUDA_GRAPH: "onnxruntime's CUDA graphs are a CUDA provider option",
             XQA_ON: "XQA is a kernel of the CUDA provider", XQA_OFF: "XQA is a kernel of the CUDA provider"}
"""The variants only the CUDA provider runs, and why."""
XQA_VARIABLE = "ORT_ENABLE_XQA"
ROW_STAGGER = 7
"""Row r starts at `past` + r·ROW_STAGGER cached positions, so that every row has its own length."""
TIMED_AFTER = 2
"""Steps left out of the timing: a warm-up and, on a CUDA graph, the capture."""


@dataclass(frozen=True)
class Steps:
    """The inputs of the measured steps: the caches the rows start from, and per step the new positions'
    embeddings and each row's cache length."""

    caches: dict[str, np.ndarray]
    embeds: list[np.ndarray]
    lengths: list[np.ndarray]


def make_steps(spec: GraphSpec, rows: int, past: int, steps: int, seed: int = 0) -> Steps:
    """`steps` decode steps of `rows` decodings, row r after `past` + r·ROW_STAGGER cached positions, in
    buffers with room for every step (the spec's sample draws)."""
    starts = past + ROW_STAGGER * np.arange(rows, dtype=np.int64)
    feeds = spec.sample_inputs(decode_step_case(spec, int(starts[-1]), batch=rows, room=steps), seed=seed)
    embeds_spec = next(t for t in spec.inputs if t.name == "inputs_embeds")
    rng = np.random.default_rng(seed + 1)
    return Steps(caches={past_name: feeds[past_name] for past_name, _ in cache_pairs(spec)},
                 embeds=[rng.uniform(embeds_spec.low, embeds_spec.high, size=feeds["inputs_embeds"].shape)
                         .astype(embeds_spec.np_dtype) for _ in range(steps)],
                 lengths=[starts + i for i in range(steps)])


@contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` while inside (None: left as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            os.environ.pop(name)
            if before is not None:
                os.environ[name] = before


def open_variant(bundle: RuntimeBundle, provider: str, variant: str) -> OrtRunner:
    """`llm_decode` as the runtime opens it on `provider`, for `variant`: with CUDA graphs on, or with
    ORT_ENABLE_XQA set while the session is made."""
    xqa = {XQA_ON: "1", XQA_OFF: "0"}.get(variant)
    with _environment(XQA_VARIABLE, xqa):
        return OrtRunner(bundle.graph_path(LLM_DECODE), bundle.specs[LLM_DECODE], provider,
                         cuda_graph=variant == CUDA_GRAPH)


def _placed(array: np.ndarray, device: str) -> ort.OrtValue:
    """A copy of `array` in memory of its own on `device` (on the CPU too: a step writes the caches)."""
    return ort.OrtValue.ortvalue_from_numpy(np.array(array), device, 0)


def runtime_step(runner: OrtRunner, steps: Steps) -> Callable[[int], np.ndarray]:
    """Step i as the runtime makes it (`OrtRunner.infer_in_place`), on caches of its own; returns the
    log-probs."""
    caches = {name: _placed(array, runner.device_type) for name, array in steps.caches.items()}
    written_into = {present: past for past, present in cache_pairs(runner.spec)}
    return lambda i: runner.infer_in_place(
        {"inputs_embeds": steps.embeds[i], **decode_lengths(steps.lengths[i], 1), **caches}, written_into,
        ["logp"])["logp"]


def bound_step(runner: OrtRunner, steps: Steps) -> Callable[[int], np.ndarray]:
    """Step i as the runtime's batch makes it with CUDA graphs (`GraphedSteps`: every input and output bound
    once, the total sequence length in host memory at the buffers' length, only the embeddings and
    `seqlens_k` written per step), on caches of its own; returns the log-probs."""
    caches = {name: _placed(array, runner.device_type) for name, array in steps.caches.items()}
    graphed = GraphedSteps(runner)
    return lambda i: graphed.step(steps.embeds[i], steps.lengths[i], caches)


def run_variant(bundle: RuntimeBundle, provider: str, variant: str, steps: Steps
                ) -> tuple[list[np.ndarray], list[float]]:
    """Every step of `variant` on a session of its own: the log-probs and the seconds of each."""
    runner = open_variant(bundle, provider, variant)
    try:
        make = bound_step if variant in (BOUND_ONCE, CUDA_GRAPH) else runtime_step
        step = make(runner, steps)
        logps, seconds = [], []
        for i in range(len(steps.embeds)):
            start = time.perf_counter()
            logps.append(step(i))
            seconds.append(time.perf_counter() - start)
        return logps, seconds
    finally:
        runner.close()


def measure(bundle: RuntimeBundle, provider: str, rows: int, *, past: int = DECODE_PAST, steps: int = 32
            ) -> dict[str, Any]:
    """Every variant of `steps` decode steps of `rows` decodings (see the module's docstring), one variant
    after another (sessions that keep their CPU workers spinning would slow each other if interleaved): per
    variant its step time and its log-probs against `runtime`'s, or why it did not run. A CUDA-only variant
    that onnxruntime fails is reported as failed (onnxruntime's errors are bare `Exception`s); any other
    failure ends the measurement."""
    if decode_body(bundle, provider) != LLM_DECODE:
        raise BenchError(f"{bundle.root}: its decode steps on {provider} do not run on llm_decode (export "
                         "it with --precision decode=fp16 for cuda, cpu-fast or decode=fp32 for the cpu)")
    if steps <= TIMED_AFTER:
        raise BenchError(f"--steps {steps}: more than {TIMED_AFTER} are needed, the first {TIMED_AFTER} are "
                         "not timed")
    inputs = make_steps(bundle.specs[LLM_DECODE], rows, past, steps)
    reference: list[np.ndarray] = []
    results: dict[str, Any] = {}
    for variant in VARIANTS:  # `runtime` first: the others are compared with it
        if provider != CUDA and variant in CUDA_ONLY:
            results[variant] = {"skipped": f"needs the cuda provider: {CUDA_ONLY[variant]}"}
            continue
        try:
            logps, seconds = run_variant(bundle, provider, variant, inputs)
        except Exception as e:
            if variant not in CUDA_ONLY:
                raise
            results[variant] = {"failed": (str(e).strip().splitlines() or [type(e).__name__])[0]}
            continue
        reference = reference or logps
        pairs = list(zip(logps, reference, strict=True))
        results[variant] = {
            "step_ms": statistics.median(seconds[TIMED_AFTER:]) * 1e3, "first_step_ms": seconds[0] * 1e3,
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in pairs),
            "steps_with_another_best_id": sum(int((a.argmax(-1) != b.argmax(-1)).any()) for a, b in pairs),
        }
    return {"rows": rows, "past": past, "steps": steps, "variants": results}


def render(provider: str, runs: list[dict[str, Any]]) -> str:
    """The measurements as text: a line per variant and row count."""
    lines = [f"llm_decode on {provider}, onnxruntime {ort.__version__}; log-probs against runtime's"]
    for run in runs:
        for variant, r in run["variants"].items():
            head = f"{run['rows']:>3} rows, {variant:<10}"
            if "skipped" in r or "failed" in r:
                lines.append(f"{head} " + (f"skipped: {r['skipped']}" if "skipped" in r else
                                           f"failed: {r['failed']}"))
            else:
                lines.append(f"{head} {r['step_ms']:8.3f} ms a step (first {r['first_step_ms']:.3f}), "
                             f"largest difference {r['max_abs_diff']:.2e}, {r['steps_with_another_best_id']} "
                             f"of {run['steps']} steps with another best id")
    return "\n".join(lines)


def batch_counts(text: str, what: str, option: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]: counts of `what` (rows, streams) in one call, each from 1 to MAX_BATCH; a
    `click.BadParameter` naming `option` otherwise."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= c <= MAX_BATCH for c in counts):
        raise click.BadParameter(f"{text!r}: comma-separated {what} counts from 1 to {MAX_BATCH}",
                                 param_hint=option)
    return counts


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Runtime bundle with an llm_decode (cosyvoice-export all).")
@click.option("--provider", type=click.Choice([CPU, CUDA]), default=CPU, show_default=True,
              help="onnxruntime's provider; the CUDA graph and XQA variants need cuda.")
@click.option("--rows", "rows_text", default="1", show_default=True,
              help="Decodings in a step, comma-separated (e.g. 1,4,16): each count is measured.")
@click.option("--past", type=click.IntRange(min=0), default=DECODE_PAST, show_default=True,
              help=f"Cached positions of the first row at the first step (row r has {ROW_STAGGER}·r more).")
@click.option("--steps", type=click.IntRange(min=TIMED_AFTER + 1), default=32, show_default=True,
              help=f"Steps per variant; the first {TIMED_AFTER} are not timed.")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write the measurements as JSON (atomically).")
def main(model: Path, provider: str, rows_text: str, past: int, steps: int, json_out: Path | None) -> None:
    """Time llm_decode's step as the runtime makes it, bound once, replayed from a CUDA graph, and with
    onnxruntime's XQA kernel on and off, the same steps each; compare each variant's log-probs with the
    runtime's."""
    rows = batch_counts(rows_text, "row", "--rows")
    with user_errors():
        if json_out is not None:
            check_writable(json_out, "--json")
        bundle = RuntimeBundle.open(model)
        runs = [measure(bundle, provider, r, past=past, steps=steps) for r in rows]
    if json_out is not None:
        write_json_atomic(json_out, {"provider": provider, "onnxruntime": ort.__version__,
                                     "precision": bundle.graph_precision(LLM_DECODE).name, "runs": runs})
    click.echo(render(provider, runs))


if __name__ == "__main__":
    main()
