"""Several streams' vocoder calls as one: `python -m cosyvoice_bench.vocoder_stacking --model BUNDLE
--provider cuda --streams 1,4,16 --json OUT.json`.

`hift_decoder` takes the windows of several streams over the same frames in one call (its `batch`). Per
stream count and window (new frames after those pushed before), this times the streams' windows
(`Vocoder.run`: `hift_f0` per stream, the phase, the decoder) run one after another against their windows
stacked in one decoder call, and compares each stream's samples and phase sums with its window alone. The
calls alternate, separate then stacked, and each figure is the median over the rounds after a warm-up.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import click
import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import HIFT_DECODER, HIFT_F0
from cosyvoice_graphs.bundle_layout import SINE_NOISE
from cosyvoice_runtime.atomic_files import check_writable, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners import open_runner
from cosyvoice_runtime.token2wav import Vocoder, VocoderJob, VocoderKey

from .decode_variants import batch_counts
from .dit_stacking import frame_pairs, stacking_command
from .errors import BenchError, user_errors
from .measure import timed

DEFAULT_WINDOWS = "100:0,50:100"
"""A first chunk's window, and a later chunk's (its new frames after a first chunk's)."""


def stream_jobs(vocoder: Vocoder, new: int, before: int, streams: int) -> tuple[VocoderKey, list[VocoderJob]]:
    """Each stream's window of `new` frames after `before` pushed already (random mel, a seed per stream;
    the earlier frames through the stream as the runtime pushes them), and their common key."""
    jobs, keys = [], set()
    for s in range(streams):
        rng = np.random.default_rng(s)
        stream, bins = vocoder.stream(), vocoder.dims.mel_bins
        if before:
            stream.push(rng.uniform(-8, 1, (1, bins, before)).astype(np.float32), finalize=False)
        mel = rng.uniform(-8, 1, (1, bins, new)).astype(np.float32)
        keys.add(stream.key(new))
        jobs.append(VocoderJob(np.concatenate([stream.mel, mel], axis=2), stream.acc))
    (key,) = keys
    return key, jobs


def measure(vocoder: Vocoder, streams: int, new: int, before: int, *, rounds: int) -> dict[str, Any]:
    """`streams` streams' windows of `new` frames after `before`, separately and stacked (see the module's
    docstring): the median time of each way, and the largest differences between a stream's samples and
    phase sums stacked and alone."""
    key, jobs = stream_jobs(vocoder, new, before, streams)

    alone = [vocoder.run(key, [job])[0] for job in jobs]  # the warm-up; compared below
    stacked = vocoder.run(key, jobs)
    waveform = max(float(np.abs(a.waveform - b.waveform).max()) for a, b in zip(stacked, alone, strict=True))
    acc = max(float(np.abs(a.acc - b.acc).max()) for a, b in zip(stacked, alone, strict=True))
    separate, together = [], []
    for _ in range(rounds):
        separate.append(timed(lambda: [vocoder.run(key, [job]) for job in jobs]))
        together.append(timed(lambda: vocoder.run(key, jobs)))
    separate_ms, stacked_ms = statistics.median(separate) * 1e3, statistics.median(together) * 1e3
    return {"streams": streams, "new_frames": new, "frames_before": before, "window_frames": key.frames,
            "rounds": rounds, "separate_ms": separate_ms, "stacked_ms": stacked_ms,
            "speedup": separate_ms / stacked_ms, "waveform_max_abs_diff": waveform,
            "phase_sum_max_abs_diff": acc}


def render(provider: str, precisions: str, runs: list[dict[str, Any]]) -> str:
    """The measurements as text: a line per stream count and window."""
    lines = [f"vocoder ({precisions}) on {provider}, onnxruntime {ort.__version__}: the streams' windows one "
             "after another against one stacked call"]
    for r in runs:
        lines.append(f"{r['streams']:>3} streams, {r['new_frames']:>4} new frames after "
                     f"{r['frames_before']:>4} ({r['window_frames']} a window): separate "
                     f"{r['separate_ms']:9.2f} ms, stacked {r['stacked_ms']:9.2f} ms ({r['speedup']:.2f}x); "
                     f"against alone: samples {r['waveform_max_abs_diff']:.2e}, "
                     f"phase sums {r['phase_sum_max_abs_diff']:.2e}")
    return "\n".join(lines)


@stacking_command(click.option("--windows", "windows_text", default=DEFAULT_WINDOWS, show_default=True,
                               help="Windows NEW:BEFORE (new frames after frames pushed before), "
                                    "comma-separated."))
def main(model: Path, provider: str, streams_text: str, windows_text: str, rounds: int, threads: int | None,
         json_out: Path | None) -> None:
    """Time several streams' vocoder windows run one after another against one decoder call over them stacked,
    and compare each stream's samples with its window alone."""
    counts = batch_counts(streams_text, "stream", "--streams")
    windows = frame_pairs(windows_text, "NEW:BEFORE, new frames (at least 1) after frames pushed before",
                          DEFAULT_WINDOWS, "--windows")
    with user_errors():
        if json_out is not None:
            check_writable(json_out, "--json")
        bundle = RuntimeBundle.open(model)
        lookahead = bundle.manifest.model.hift.final_lookahead
        for new, before in windows:
            if 0 < before <= lookahead:
                raise BenchError(f"--windows {new}:{before}: the frames pushed before a window are 0 or more "
                                 f"than the vocoder's look-ahead ({lookahead}), as a stream's first chunk")
        precisions = ", ".join(f"{name} {bundle.graph_precision(name).name}"
                               for name in (HIFT_F0, HIFT_DECODER))
        with open_runner(bundle, HIFT_F0, provider, threads=threads) as f0, \
                open_runner(bundle, HIFT_DECODER, provider, threads=threads) as decoder:
            vocoder = Vocoder(f0, decoder, bundle.uniform_noise(SINE_NOISE), bundle.dims,
                              bundle.manifest.model.hift)
            runs = [measure(vocoder, s, new, before, rounds=rounds)
                    for new, before in windows for s in counts]
    if json_out is not None:
        write_json_atomic(json_out, {"provider": provider, "onnxruntime": ort.__version__,
                                     "precisions": precisions, "runs": runs})
    click.echo(render(provider, precisions, runs))


if __name__ == "__main__":
    main()
