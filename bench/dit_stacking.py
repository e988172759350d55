"""Several streams' DiT calls as one: `python -m cosyvoice_bench.dit_stacking --model BUNDLE --provider cuda
--streams 1,4,16 --json OUT.json`.

`flow_estimator_cached` takes the CFG pairs of several streams at the same ODE step and frames in one call
(its `batch`). Per stream count and call shape (new frames after cached ones), this times the streams' calls
made one after another, as the runtime makes them, against one call of all their pairs stacked, and compares
each stream's rows of the stacked call with its call alone. Both ways the caches are where the runtime keeps
them (on the session's device, the presents left there: `infer_kept`); the stacked call's caches are stacked
once beforehand, so its time leaves out what stacking the streams' caches would cost. The calls alternate,
separate then stacked, and each figure is the median over the rounds after a warm-up.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import DIT, GraphSpec, cache_pairs, dit_call_case
from cosyvoice_runtime.atomic_files import check_writable, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli_options import THREADS, NonEmptyPath
from cosyvoice_runtime.dit_stack import row_inputs, stacked_feeds
from cosyvoice_runtime.runners import CPU, CUDA, Feed, OrtRunner, Runner, open_runner

from .decode_variants import batch_counts
from .errors import user_errors
from .graph_profile import DIT_NEW, DIT_PAST
from .measure import timed

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SHAPES = f"{DIT_NEW}:{DIT_PAST},50:400"
"""A first chunk after a prompt's prefix (graph_profile's call) and a later chunk further on."""


def stream_feeds(spec: GraphSpec, new: int, past: int, block: int, streams: int
                 ) -> list[dict[str, np.ndarray]]:
    """Each stream's feeds of a call over `new` frames after `past` cached ones (the spec's sample draws, a
    seed per stream), the inputs without rows (which a call's streams share) stream 0's."""
    case = dit_call_case(new, past, past, block)
    feeds = [spec.sample_inputs(case, seed=s) for s in range(streams)]
    rows = row_inputs(spec)
    return [{**f, **{name: feeds[0][name] for name in f if name not in rows}} for f in feeds]


def _placed(feeds: dict[str, np.ndarray], runner: Runner, caches: set[str]) -> dict[str, Feed]:
    """`feeds` with the caches on the runner's device, as the runtime keeps them between calls."""
    if not isinstance(runner, OrtRunner) or runner.device_type == CPU:
        return dict(feeds)
    return {name: ort.OrtValue.ortvalue_from_numpy(value, runner.device_type, runner.device_id)
            if name in caches else value for name, value in feeds.items()}


def _host(value: Feed) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)


def measure(runner: Runner, block: int, streams: int, new: int, past: int, *, rounds: int) -> dict[str, Any]:
    """`streams` streams' calls over `new` frames after `past` cached ones, separately and stacked (see the
    module's docstring): the median time of each way, and the largest difference between a stream's rows of
    the stacked call and its call alone, over every output."""
    spec = runner.spec
    pairs = cache_pairs(spec)
    presents = [present for _, present in pairs]
    caches = {past_name for past_name, _ in pairs}
    alone = [_placed(f, runner, caches) for f in stream_feeds(spec, new, past, block, streams)]
    on_host = [{k: _host(v) for k, v in f.items()} for f in alone]
    together = _placed(stacked_feeds(spec, on_host), runner, caches)

    def call(feeds: dict[str, Feed]) -> dict[str, Feed]:
        out, kept = runner.infer_kept(feeds, keep=presents)
        return out | kept

    separate_outs = [call(f) for f in alone]  # the warm-up; compared below
    stacked_out = call(together)
    largest = 0.0
    for s, out in enumerate(separate_outs):
        for name in spec.output_names:
            rows = _host(stacked_out[name])[2 * s:2 * s + 2]
            largest = max(largest, float(np.abs(rows - _host(out[name])).max()))
    separate, together_s = [], []
    for _ in range(rounds):
        separate.append(timed(lambda: [call(f) for f in alone]))
        together_s.append(timed(lambda: call(together)))
    separate_ms, stacked_ms = statistics.median(separate) * 1e3, statistics.median(together_s) * 1e3
    return {"streams": streams, "new_frames": new, "past_frames": past, "rounds": rounds,
            "separate_ms": separate_ms, "stacked_ms": stacked_ms, "speedup": separate_ms / stacked_ms,
            "max_abs_diff": largest}


def render(provider: str, precision: str, runs: list[dict[str, Any]]) -> str:
    """The measurements as text: a line per stream count and call shape."""
    lines = [f"{DIT} ({precision}) on {provider}, onnxruntime {ort.__version__}: the streams' calls one "
             "after another against one stacked call"]
    for r in runs:
        lines.append(f"{r['streams']:>3} streams, {r['new_frames']:>4} new frames after "
                     f"{r['past_frames']:>4}: separate {r['separate_ms']:9.2f} ms, "
                     f"stacked {r['stacked_ms']:9.2f} ms "
                     f"({r['speedup']:.2f}x); rows against alone: largest difference {r['max_abs_diff']:.2e}")
    return "\n".join(lines)


def frame_pairs(text: str, meaning: str, example: str, option: str) -> list[tuple[int, int]]:
    """'50:200,44:400' -> [(50, 200), (44, 400)]: new frames (at least 1) and frames before them, each pair
    as `meaning` says (a `click.BadParameter` naming `option`, `meaning` and `example` otherwise)."""
    pairs = []
    for part in text.split(","):
        new, _, before = part.partition(":")
        if not (new.isdigit() and before.isdigit() and int(new) >= 1):
            raise click.BadParameter(f"{part!r}: {meaning}, e.g. {example}", param_hint=option)
        pairs.append((int(new), int(before)))
    return pairs


def stacking_command(shapes: Callable[[F], F]) -> Callable[[Callable[..., Any]], click.Command]:
    """A stacking benchmark's command: its options, `shapes` (the calls' shapes) among them."""
    options: list[Callable[[Any], Any]] = [
        click.command(context_settings={"help_option_names": ["-h", "--help"]}),
        click.option("--model", required=True, type=NonEmptyPath(file_okay=False, path_type=Path),
                     help="Runtime bundle (cosyvoice-export all)."),
        click.option("--provider", type=click.Choice([CPU, CUDA]), default=CPU, show_default=True,
                     help="onnxruntime's provider."),
        click.option("--streams", "streams_text", default="1,4,16", show_default=True,
                     help="Streams in a call, comma-separated: each count is measured."),
        shapes,
        click.option("--rounds", type=click.IntRange(min=1), default=10, show_default=True,
                     help="Timed rounds per count and shape, after a warm-up."),
        click.option("--threads", type=THREADS, default=None,
                     help="onnxruntime's intra-op threads (default: the runtime's)."),
        click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path),
                     help="Also write the measurements as JSON (atomically).")]

    def decorate(function: Callable[..., Any]) -> click.Command:
        command: Any = function
        for option in reversed(options):
            command = option(command)
        assert isinstance(command, click.Command)
        return command
    return decorate


@stacking_command(click.option("--shapes", "shapes_text", default=DEFAULT_SHAPES, show_default=True,
                               help="Call shapes NEW:PAST (new frames after cached ones), comma-separated."))
def main(model: Path, provider: str, streams_text: str, shapes_text: str, rounds: int, threads: int | None,
         json_out: Path | None) -> None:
    """Time several streams' DiT calls made one after another against one call of their CFG pairs stacked,
    and compare each stream's rows of the stacked call with its call alone."""
    counts = batch_counts(streams_text, "stream", "--streams")
    shapes = frame_pairs(shapes_text, "NEW:PAST, new frames (at least 1) after cached ones", DEFAULT_SHAPES,
                         "--shapes")
    with user_errors():
        if json_out is not None:
            check_writable(json_out, "--json")
        bundle = RuntimeBundle.open(model)
        precision = bundle.graph_precision(DIT).name
        runner = open_runner(bundle, DIT, provider, threads=threads)
        try:
            runs = [measure(runner, bundle.dims.dit_block_frames, s, new, past, rounds=rounds)
                    for new, past in shapes for s in counts]
        finally:
            runner.close()
    if json_out is not None:
        write_json_atomic(json_out, {"provider": provider, "onnxruntime": ort.__version__,
                                     "precision": precision, "runs": runs})
    click.echo(render(provider, precision, runs))


if __name__ == "__main__":
    main()
