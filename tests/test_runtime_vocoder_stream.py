"""The windowed streaming vocoder (`VocoderStream`) against upstream's full re-run, and its margin.

The margin is derived from the HiFT layout (`HiftLayout.decoder_left_context`); the probes below put NaNs
or noise into everything before a window's first frame and show the derived bound is exact: samples from
it on are bit for bit unchanged, the sample before it is not.

One caveat on comparing with the re-run: onnxruntime's CPU convs round `hift_f0`'s float32 output
differently (in the last ulp) for inputs of 64 frames or fewer, and upstream's float32 phase formula turns
one ulp of f0 into up to ~1e-2 of waveform (fl32(acc) · 2π · 480: one ulp of the running sum is ~1e-3 rad
after a few seconds). The re-run itself moves by that much between chunks whenever its own f0 calls cross
that length (or, on several intra-op threads, between many lengths). Here the graphs run on one thread and
the schedules make every `hift_f0` call that differs between the two paths longer than 64 frames, so both
see the same f0 bit for bit and the comparison measures the windowing alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_export.config import full_size, tiny
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.synthesis import Synthesizer
from cosyvoice_runtime.token2wav import (
    OFFLINE_WINDOW_FRAMES,
    Vocoder,
    VocoderJob,
    VocoderKey,
    VocoderOut,
    accumulate_phase,
    phase_steps,
    wrap_phase,
)

WINDOW_MAX = 1e-5  # measured ~3e-7: the graphs' float rounding on other lengths
U = 480


@pytest.fixture(scope="module")
def synth(runtime_bundle: Path) -> Iterator[Synthesizer]:
    """One intra-op thread: `hift_f0` then rounds alike for every input longer than 64 frames."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def vocoder(synth: Synthesizer) -> Vocoder:
    return synth.vocoder


def _mel(frames: int, seed: int = 0) -> np.ndarray:
    """Log-mel-like frames (1, 80, frames): the tiny predictor gives voiced f0 (~180 Hz) for them."""
    return np.random.default_rng(seed).normal(-4.0, 1.5, (1, 80, frames)).astype(np.float32)


def _phase(f0: np.ndarray, harmonics: int, sample_rate: int) -> np.ndarray:
    """The phase of an utterance's f0 (1, T) from its first frame, in one running sum."""
    return wrap_phase(accumulate_phase(np.zeros(harmonics), phase_steps(f0, harmonics, sample_rate)), U)


def _decoder_inputs(vocoder: Vocoder, mel: np.ndarray) -> dict[str, np.ndarray]:
    f0 = vocoder.f0.infer({"mel": mel})["f0"]
    d = vocoder.dims
    return {"mel": mel, "f0": f0, "phase": _phase(f0, d.harmonics, d.sample_rate),
            "sine_noise": vocoder.sine_noise.window(0, U * mel.shape[2])}


def _spoil_before(feeds: dict[str, np.ndarray], frame: int, value: float | None) -> dict[str, np.ndarray]:
    """`feeds` with every input before mel frame `frame` set to `value` (None: fresh random values)."""
    rng = np.random.default_rng(7)
    out = {k: v.copy() for k, v in feeds.items()}
    for name, arr in out.items():
        t = frame * U if name == "sine_noise" else frame
        part = arr[:, :, :t] if name == "mel" else arr[:, :t]
        part[...] = rng.uniform(0.0, 1.0, part.shape) * 3 if value is None else value
    return out


# --- the margin -------------------------------------------------------------------------------------


def test_the_bundles_layout_is_the_exporters_and_gives_the_documented_margin(vocoder: Vocoder) -> None:
    """The vocoder's layout is the bundle's (its manifest's model.hift), whose yaml settings are the
    exporter's configs', the released model's as the tiny one's (test_hift checks the rest against the
    networks)."""
    layout = vocoder.layout
    for cfg in (full_size().hift, tiny(100).hift):
        for name in ("upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
                     "resblock_dilation_sizes", "source_resblock_kernel_sizes",
                     "source_resblock_dilation_sizes", "istft_n_fft", "istft_hop_len", "conv_pre_look_right"):
            assert getattr(layout, name) == getattr(cfg, name), name
        assert layout.samples_per_frame == cfg.upsample_scale
    assert layout.decoder_left_context() == 13736  # the docstring's arithmetic
    assert layout.window_margin() == 29 and layout.f0_left_context() == 8 and layout.final_lookahead == 8


@pytest.mark.parametrize("value", [np.nan, None], ids=["nan", "noise"])
def test_hift_f0_reads_exactly_its_left_context(vocoder: Vocoder, value: float | None) -> None:
    mel, frame, ctx = _mel(160), 70, vocoder.layout.f0_left_context()
    want = vocoder.f0.infer({"mel": mel})["f0"]
    got = vocoder.f0.infer({"mel": _spoil_before({"mel": mel}, frame, value)["mel"]})["f0"]
    assert np.array_equal(got[:, frame + ctx:], want[:, frame + ctx:])
    assert got[0, frame + ctx - 1] != want[0, frame + ctx - 1]  # one frame less is not enough


def test_decoder_left_context_is_exact(vocoder: Vocoder) -> None:
    """Everything before frame 40 NaN: the samples from the derived bound on are untouched, the one before
    is not; so a margin of `window_margin()` frames suffices and one frame less does not."""
    feeds, frame = _decoder_inputs(vocoder, _mel(120)), 40
    want = vocoder.decoder.infer(feeds)["waveform"][0]
    got = vocoder.decoder.infer(_spoil_before(feeds, frame, np.nan))["waveform"][0]
    first = frame * U + vocoder.layout.decoder_left_context()
    assert np.array_equal(got[first:], want[first:])
    assert np.isnan(got[first - 1])
    margin = vocoder.layout.window_margin()
    assert np.isnan(got[(frame + margin - 1) * U:(frame + margin) * U]).any()


def test_perturbing_the_frames_before_the_window_leaves_the_kept_samples(vocoder: Vocoder) -> None:
    feeds, frame, margin = _decoder_inputs(vocoder, _mel(120)), 40, vocoder.layout.window_margin()
    want = vocoder.decoder.infer(feeds)["waveform"][0]
    got = vocoder.decoder.infer(_spoil_before(feeds, frame, None))["waveform"][0]
    assert np.array_equal(got[(frame + margin) * U:], want[(frame + margin) * U:])
    diff = np.abs(got - want)
    changed = np.nonzero(diff)[0].max() / U - frame
    print(f"noise before the window changes samples up to {changed:.2f} frames into it (bound {margin})")
    assert diff[(frame + 2) * U:(frame + 3) * U].max() > 1e-3  # a tiny margin would not do


# --- the phase accumulator --------------------------------------------------------------------------


def test_phase_accumulator_continues_one_running_sum_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    f0 = rng.uniform(60.0, 420.0, (1, 3000)).astype(np.float32)  # 60 s: the running sums reach ~1e4
    f0[:, 500:700] = 0.0  # unvoiced stretch
    want = _phase(f0, 9, 24000)
    acc, pieces, t = np.zeros(9), [], 0
    for n in [1, 2, 37, 400, 1, 1000, 59, 1500]:
        run = accumulate_phase(acc, phase_steps(f0[:, t:t + n], 9, 24000))
        pieces.append(wrap_phase(run, U))
        acc, t = run[0, -1], t + n
    assert t == 3000 and np.array_equal(np.concatenate(pieces, axis=1), want)


# --- windowed streaming vs the re-run ---------------------------------------------------------------


def _rerun(vocoder: Vocoder, mel: np.ndarray, schedule: list[int]) -> Iterator[np.ndarray]:
    """Upstream: the whole accumulated mel vocoded again per chunk, the new samples kept."""
    frames = emitted = 0
    for i, n in enumerate(schedule):
        frames += n
        wav = vocoder(mel[:, :, :frames], finalize=i == len(schedule) - 1)
        yield wav[emitted:]
        emitted = len(wav)


SCHEDULES = {
    # mel frames per chunk, the last one final
    "short-first": [10, 6, 12, 50, 30, 25, 41],  # windows start at frame 0 until 37 frames are out
    "upstream": [74, 100, 200, 200, 37],  # 2 · (25 + 12), 2 · 50, 2 · 100, ...
    "final-only": [90],
    "long-20": [66, *[24, 31, 40, 27] * 4, 35, 28, 28],  # 20 chunks, 645 frames
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_window_stream_equals_the_rerun(vocoder: Vocoder, name: str) -> None:
    schedule = SCHEDULES[name]
    mel = _mel(sum(schedule), seed=len(schedule))
    f0 = vocoder.f0.infer({"mel": mel})["f0"]
    d = vocoder.dims
    committed = accumulate_phase(np.zeros(d.harmonics), phase_steps(f0, d.harmonics, d.sample_rate))
    stream, frames, worst = vocoder.stream(), 0, 0.0
    times: list[tuple[float, float]] = []
    want_chunks = _rerun(vocoder, mel, schedule)
    for i, n in enumerate(schedule):
        final, from_start = i == len(schedule) - 1, stream.start == 0
        before = time.perf_counter()
        got = stream.push(mel[:, :, frames:frames + n], finalize=final)
        mid = time.perf_counter()
        want = next(want_chunks)
        times.append((mid - before, time.perf_counter() - mid))
        frames += n
        # the same boundaries and sample counts: U (frames - 8) in all, U frames when final
        assert len(got) == len(want) and stream.samples == U * (frames if final else frames - 8)
        if from_start:  # a window from frame 0 is the re-run's very call
            assert np.array_equal(got, want)
        worst = max(worst, float(np.abs(got - want).max(initial=0.0)))
        # explicit, bounded state: the next window's frames only, the phase sums of every frame before it
        assert stream.frames == frames and stream.mel_start == max(0, stream.start - 8)
        assert stream.start == max(0, stream.samples // U - vocoder.layout.window_margin())
        if stream.start and not final:
            assert np.array_equal(stream.acc, committed[0, stream.start - 1])
    print(f"{name}: {len(schedule)} chunks, window vs re-run max abs {worst:.2e}; vocoder s/chunk "
          "(window, re-run): " + ", ".join(f"({w:.3f}, {r:.3f})" for w, r in times))
    assert worst < WINDOW_MAX


def _repeating(vocoder: Vocoder) -> tuple[Vocoder, list[VocoderKey]]:
    """A twin of `vocoder` that keeps to lengths it has had (`repeat_shapes`, a GPU's way), and the keys of
    its calls."""
    twin = Vocoder(vocoder.f0, vocoder.decoder, vocoder.sine_noise, vocoder.dims, vocoder.layout,
                   repeat_shapes=True)
    keys: list[VocoderKey] = []
    run = twin.run

    def logged(key: VocoderKey, jobs: list[VocoderJob]) -> list[VocoderOut]:
        keys.append(key)
        return run(key, jobs)

    twin.run = logged  # type: ignore[method-assign]
    return twin, keys


@pytest.mark.parametrize("name", ["upstream", "long-20"])
def test_a_final_window_takes_the_previous_ones_length(vocoder: Vocoder, name: str) -> None:
    """Where a new length costs, a final push shorter than the previous window starts inside it, at the
    frame that gives it that length (the phase sums of that window's frames kept): the same samples as the
    re-run, the decoder's length repeated."""
    schedule = SCHEDULES[name]
    mel = _mel(sum(schedule), seed=len(schedule))
    twin, keys = _repeating(vocoder)
    stream, frames, worst = twin.stream(), 0, 0.0
    for i, (want, n) in enumerate(zip(_rerun(vocoder, mel, schedule), schedule, strict=True)):
        final = i == len(schedule) - 1
        got = stream.push(mel[:, :, frames:frames + n], finalize=final)
        frames += n
        assert len(got) == len(want)
        worst = max(worst, float(np.abs(got - want).max()))
    lengths = [key.frames - key.skip for key in keys]
    assert lengths[-1] == lengths[-2] and keys[-1].first_frame < keys[-2].first_frame + lengths[-2]
    assert worst < WINDOW_MAX


def test_a_long_final_call_runs_in_windows_of_one_length(vocoder: Vocoder) -> None:
    """Where a new length costs, a final call over 645 frames runs as a stream whose every decoder call is
    `OFFLINE_WINDOW_FRAMES` long: its samples those of the one call; a call of that many frames or fewer
    stays one call. A CPU's vocoder makes one call (its lengths cost nothing)."""
    mel = _mel(645, seed=11)
    twin, keys = _repeating(vocoder)
    want = vocoder(mel, finalize=True)
    got = twin(mel, finalize=True)
    assert len(got) == len(want) == 645 * U
    assert float(np.abs(got - want).max()) < WINDOW_MAX
    assert {key.frames - key.skip for key in keys} == {OFFLINE_WINDOW_FRAMES}
    assert len({key.frames for key in keys}) == 2  # hift_f0's: the first window's, then with its context
    keys.clear()
    short = mel[:, :, :OFFLINE_WINDOW_FRAMES]
    assert np.array_equal(twin(short, finalize=True), vocoder(short, finalize=True)) and len(keys) == 1
    assert not vocoder.repeat_shapes


def test_a_margin_too_small_breaks_the_equality(vocoder: Vocoder) -> None:
    schedule = SCHEDULES["upstream"]
    mel = _mel(sum(schedule), seed=5)
    stream, frames, worst = vocoder.stream(margin=2), 0, 0.0
    for i, (want, n) in enumerate(zip(_rerun(vocoder, mel, schedule), schedule, strict=True)):
        got = stream.push(mel[:, :, frames:frames + n], finalize=i == len(schedule) - 1)
        frames += n
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst > 1e-3


def test_push_checks_its_input(vocoder: Vocoder) -> None:
    stream = vocoder.stream()
    with pytest.raises(ValueError, match="more than 8 frames"):
        stream.push(_mel(8), finalize=False)
    stream.push(_mel(12), finalize=True)
    with pytest.raises(ValueError, match="finalized"):
        stream.push(_mel(12), finalize=True)
    with pytest.raises(ValueError, match="margin"):
        vocoder.stream(margin=-1)
    with pytest.raises(ValueError, match="vocoder"):
        ChunkPolicy(vocoder="cached")  # type: ignore[arg-type]


# --- through the synthesizer ------------------------------------------------------------------------


def test_a_stream_whose_vocoder_repeats_shapes_speaks_as_the_window_stream(
        synth: Synthesizer, runtime_bundle: Path, prompt: PromptFeatures) -> None:
    """Through the synthesizer, its vocoder's calls stacked (each chunk announcing its call's key, the final
    one's shifted window too) and keeping to lengths it has had: the window stream's samples."""
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 6561, 240)]
    want = np.concatenate([c.samples for c in synth.stream_tokens(tokens, prompt)])
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1, stack_vocoder=True) as repeating:
        repeating.vocoder.repeat_shapes = True
        got = np.concatenate([c.samples for c in repeating.stream_tokens(tokens, prompt)])
    assert len(got) == len(want) and float(np.abs(got - want).max()) < WINDOW_MAX


def test_synthesizer_stream_window_equals_rerun(synth: Synthesizer, prompt: PromptFeatures) -> None:
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 6561, 240)]
    window = list(synth.stream_tokens(tokens, prompt))
    rerun = list(synth.stream_tokens(tokens, prompt, policy=ChunkPolicy(vocoder="rerun")))
    assert len(window) == len(rerun) >= 4
    for w, r in zip(window, rerun, strict=True):
        assert (w.index, w.is_final, w.token_range, w.sample_range) == \
            (r.index, r.is_final, r.token_range, r.sample_range)
    diff = np.abs(np.concatenate([c.samples for c in window]) - np.concatenate([c.samples for c in rerun]))
    times = [(round(w.timings.vocoder, 3), round(r.timings.vocoder, 3))
             for w, r in zip(window, rerun, strict=True)]
    print(f"synthesizer stream: {len(window)} chunks, window vs re-run max abs {diff.max():.2e}; "
          f"vocoder s (window, re-run): {times}")
    assert diff.max() < WINDOW_MAX

