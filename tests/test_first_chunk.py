"""`ChunkPolicy.first_chunk_tokens`: an earlier first chunk, a deviation from upstream's schedule (off by
default).

On the demo bundle with greedy tokens: the default stays what it was chunk for chunk; with the policy the
first chunk comes after fewer tokens, every later boundary is upstream's, and its seams are no worse than
upstream's (the waveform's jump at each seam against its own jumps nearby; the streamed-vs-offline error
near the seams against away from them; the mel's step at the seam against its steps nearby). The figures
are printed for the README.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cosyvoice_golden.run import cpu_signature
from cosyvoice_graphs import ODE_STEPS
from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle, StreamConstants
from cosyvoice_runtime.bundle_source import PlannedExport
from cosyvoice_runtime.chunk_policy import ChunkPolicy, check_policy
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.dit_stack import DitResult, Presents
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners import Feed, feed_shape
from cosyvoice_runtime.synthesis import AudioChunk, Mode

TEXT = "Hello there, this is a test of the streaming seams."
TOKENS = 150
"""Greedy speech tokens taken from the demo model: chunks (0, 38), (38, 88), (88, 150) on upstream's
schedule."""
FIRST = 10
UPSTREAM_DIGESTS = {
    "avx512f": ["29489237b32fae6f", "8a363f04d1af9dfa", "c5821f4ac8bfc327"],  # Zen 4, Zen 5, AMX Xeon alike
    "avx2": ["277d743ebba82e03", "2282d59dcf37ba23", "5a3847c15df86f29"],  # an AVX2-only AMD EPYC
}
"""The chunks' sha256 prefixes on upstream's schedule (flow "cache", vocoder "window"), as made by the
default path alone (recorded again whenever the demo bundle's graphs change), per family of onnxruntime's
float32 CPU kernels: AVX-512's and AVX2's round differently, so each gives its own bits."""
NEAR = 3
"""Samples either side of a seam where a click would show."""
AROUND = 480
"""Samples (20 ms) either side of a seam that its jump is compared with."""
ROUNDING = 1.02
"""Slack on "no worse": the later seams' audio moves by float rounding once the first chunk's frames
differ."""


@pytest.fixture(scope="module")
def voice() -> Iterator[CosyVoice3]:
    """One intra-op thread: the graphs round alike run after run."""
    with CosyVoice3(DEMO_BUNDLE, sampling="greedy", threads=1) as v:
        yield v


@pytest.fixture(scope="module")
def case(voice: CosyVoice3) -> tuple[list[int], PromptFeatures]:
    default = voice.bundle.default_prompt()
    assert default is not None
    prompt = voice.prompt_features(default[0])
    piece = voice.segments(Mode.ZERO_SHOT, TEXT, prompt_text=default[1])[0]
    speech = voice.speak(piece, prompt, Mode.ZERO_SHOT, max_tokens=TOKENS)
    list(speech)
    assert len(speech.speech_tokens) == TOKENS
    return list(speech.speech_tokens), prompt


def _digests(chunks: list[AudioChunk]) -> list[str]:
    return [hashlib.sha256(c.samples.tobytes()).hexdigest()[:16] for c in chunks]


def _kernel_family() -> str | None:
    """The family of onnxruntime's float32 CPU kernels this machine runs: the first of `UPSTREAM_DIGESTS`'
    keys among its CPU features (an AVX-512 CPU has AVX2 too), or None where no digest was recorded for its
    kind."""
    features = cpu_signature().split()
    return next((family for family in UPSTREAM_DIGESTS if family in features), None)


def _one_error_line(stderr: str, why: str) -> bool:
    """The error is stderr's last line, alone (a `model:` line naming the default bundle may come first)."""
    errors = [line for line in stderr.splitlines() if not line.startswith("model: ")]
    return len(errors) == 1 and errors[0].startswith("error: ") and why in errors[0]


def _seams(chunks: list[AudioChunk], offline: np.ndarray) -> dict[str, Any]:
    """Per seam: the largest sample-to-sample jump within `NEAR` samples over the largest within `AROUND`
    outside them (a click exceeds 1), and the mel's step into the chunk's first frame over the median
    step of the 40 frames around; the streamed-vs-offline error within `AROUND` of any seam over that
    away from them."""
    audio = np.concatenate([c.samples for c in chunks])
    jumps = np.abs(np.diff(audio))
    mel = np.concatenate([c.mel for c in chunks], axis=2)[0]  # (80, frames)
    steps = np.abs(np.diff(mel, axis=1)).mean(axis=0)
    frame_seams = np.cumsum([c.mel.shape[2] for c in chunks])[:-1]
    audio_ratio, mel_ratio = [], []
    near_seams = np.zeros(len(audio), dtype=bool)
    for chunk, frame in zip(chunks[1:], frame_seams, strict=True):
        b = chunk.sample_range[0]
        around = np.r_[jumps[b - AROUND:b - NEAR], jumps[b + NEAR:b + AROUND]]
        audio_ratio.append(float(jumps[b - NEAR:b + NEAR].max() / around.max()))
        mel_ratio.append(float(steps[frame - 1] / np.median(steps[max(0, frame - 20):frame + 20])))
        near_seams[max(0, b - AROUND):b + AROUND] = True
    error = np.abs(audio - offline)
    return {"audio": audio_ratio, "mel": mel_ratio,
            "error": float(error[near_seams].max() / error[~near_seams].max())}


def test_the_default_is_upstreams_schedule_unchanged(voice: CosyVoice3, case: tuple[list[int], PromptFeatures]
                                                     ) -> None:
    tokens, prompt = case
    default = list(voice.synth.stream_tokens(tokens, prompt))
    assert [c.token_range for c in default] == [(0, 38), (38, 88), (88, 150)]
    off = ChunkPolicy(lookahead=voice.synth.dims.pre_lookahead_len, first_chunk_tokens=None)
    assert _digests(list(voice.synth.stream_tokens(tokens, prompt, policy=off))) == _digests(default)
    family = _kernel_family()
    if family is None:  # the golden's streamed cases still judge the default schedule here, within bounds
        pytest.skip(f"no digests recorded for this CPU's float32 kernels ({cpu_signature()})")
    assert _digests(default) == UPSTREAM_DIGESTS[family]


@pytest.mark.parametrize("flow", ["cache", "rerun", "window"])
def test_the_first_chunk_comes_sooner_with_seams_no_worse_than_upstreams(
        voice: CosyVoice3, case: tuple[list[int], PromptFeatures], flow: str) -> None:
    tokens, prompt = case
    synth = voice.synth
    offline = synth.synthesize_tokens(tokens, prompt).audio
    upstream = list(synth.stream_tokens(tokens, prompt, policy=ChunkPolicy(flow=flow)))  # type: ignore[arg-type]
    early = list(synth.stream_tokens(tokens, prompt, policy=ChunkPolicy(flow=flow,  # type: ignore[arg-type]
                                                                        first_chunk_tokens=FIRST)))
    assert early[0].token_range == (0, FIRST) and upstream[0].token_range[1] > FIRST
    assert [c.token_range[1] for c in early[1:]] == [c.token_range[1] for c in upstream]  # upstream's after
    assert sum(len(c.samples) for c in early) == len(offline)
    ours, theirs = _seams(early, offline), _seams(upstream, offline)
    print(f"flow {flow}: first chunk after {FIRST} + 3 tokens instead of {upstream[0].token_range[1]} + 3; "
          f"seam jump / nearby jumps: {[round(r, 3) for r in ours['audio']]} "
          f"(upstream {[round(r, 3) for r in theirs['audio']]}); mel step / nearby median: "
          f"{[round(r, 3) for r in ours['mel']]} (upstream {[round(r, 3) for r in theirs['mel']]}); "
          f"streamed-vs-offline error near seams / away: {ours['error']:.3f} "
          f"(upstream {theirs['error']:.3f})")
    assert max(ours["audio"]) <= max(theirs["audio"]) * ROUNDING < 1  # no seam jumps out of its signal
    assert ours["error"] <= theirs["error"] * ROUNDING
    assert ours["mel"][0] <= 1.5 * max(theirs["mel"])  # the cut block's step, within half upstream's


def test_cache_gives_reruns_samples_with_a_cut_first_chunk(voice: CosyVoice3,
                                                           case: tuple[list[int], PromptFeatures]) -> None:
    """The cut first chunk runs its frames after the prompt's flow prefix only, as a first chunk on
    upstream's schedule does, and gives the re-run's mel to float rounding."""
    tokens, prompt = case
    flow = voice.synth.flow
    prefix = flow.prefix(prompt).frames
    assert prefix > 0
    call, frames_run = flow.call, []

    def recording(feeds: Mapping[str, Feed], *, presents: Presents) -> DitResult:
        frames_run.append(feed_shape(feeds["x"])[2])
        return call(feeds, presents=presents)

    policies = [ChunkPolicy(flow=flow, first_chunk_tokens=FIRST) for flow in ("cache", "rerun")]  # type: ignore[arg-type]
    try:
        flow.call = recording
        cached = voice.synth.stream_tokens(tokens, prompt, policy=policies[0])
        first = next(cached)
        calls = list(frames_run)
        runs = [[first, *cached], list(voice.synth.stream_tokens(tokens, prompt, policy=policies[1]))]
    finally:
        flow.call = call
    end = prompt.mel.shape[1] + flow.dims.token_mel_ratio * FIRST
    assert calls == [end - prefix] * ODE_STEPS
    assert np.abs(runs[0][0].mel - runs[1][0].mel).max() < 1e-4
    got, want = (np.concatenate([c.samples for c in run]) for run in runs)
    assert np.abs(got - want).mean() < 2e-3  # the vocoder's tolerance, as test_flow_stream_cache


def test_a_first_chunk_the_graphs_cannot_make_is_refused_in_one_line(voice: CosyVoice3,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, 4):
        with pytest.raises(UserError, match=r"^first_chunk_tokens must be >= 5 \(the vocoder holds back 8"):
            check_policy(ChunkPolicy(first_chunk_tokens=bad), voice.bundle)
    assert check_policy(ChunkPolicy(first_chunk_tokens=5), voice.bundle).first_chunk_tokens == 5
    monkeypatch.setattr("cosyvoice_runtime.synthesis.open_runner", None)  # refused before a graph opens
    with pytest.raises(UserError, match="first_chunk_tokens must be >= 5"):
        CosyVoice3(voice.bundle, chunk_policy=ChunkPolicy(first_chunk_tokens=4), verify=False)
    default = voice.bundle.default_prompt()
    assert default is not None
    piece = voice.segments(Mode.ZERO_SHOT, "Hi.", prompt_text=default[1])[0]
    prompt = voice.prompt_features(default[0])
    with pytest.raises(UserError, match="first_chunk_tokens must be >= 5"):  # before the LLM runs
        voice.speak(piece, prompt, Mode.ZERO_SHOT, stream=True, policy=ChunkPolicy(first_chunk_tokens=2))


@pytest.mark.torch
def test_a_model_bundle_is_held_against_the_released_models_streaming_constants() -> None:
    """Before a model bundle is exported, a policy is held against the embedded bundle's streaming
    constants (`PlannedExport`): those of the released model's size, which its export records."""
    pytest.importorskip("torch", reason="needs torch (the export extra): the vocoder's layout is its net's")
    from cosyvoice_export.config import full_size
    from cosyvoice_export.nets.hift import hift_layout
    from cosyvoice_export.onnx.dims import model_dims

    full = full_size()
    dims = model_dims(full)
    released = StreamConstants(dims.pre_lookahead_len, dims.dit_block_frames, dims.token_mel_ratio,
                               hift_layout(full.hift).final_lookahead)
    assert released == StreamConstants(3, 50, 2, 8)
    assert PlannedExport.of(DEMO_BUNDLE, "fp32").stream_constants == released


def test_upstreams_methods_stream_on_the_voices_policy_with_upstreams_signatures(voice: CosyVoice3) -> None:
    default = voice.bundle.default_prompt()
    assert default is not None
    for method in (CosyVoice3.inference_zero_shot, CosyVoice3.inference_cross_lingual,
                   CosyVoice3.inference_instruct2):
        assert "first_chunk_tokens" not in inspect.signature(method).parameters
    assert voice.chunk_policy.first_chunk_tokens is None
    with CosyVoice3(voice.bundle, sampling="greedy", threads=1,
                    chunk_policy=ChunkPolicy(first_chunk_tokens=FIRST)) as early:
        assert early.chunk_policy.first_chunk_tokens == FIRST
        first = next(iter(early.inference_cross_lingual("Hi there.", default[0], stream=True)))
        theirs = next(iter(voice.inference_cross_lingual("Hi there.", default[0], stream=True)))
    spf = voice.bundle.dims.samples_per_frame
    assert first["tts_speech"].shape[1] < theirs["tts_speech"].shape[1]
    assert first["tts_speech"].shape[1] % spf == 0


def test_cosyvoice_run_streams_with_it_and_refuses_a_bad_one(tmp_path: Path) -> None:
    base = ["--text", "Hi.", "--sampling", "greedy", "--stream", "--out", str(tmp_path / "out.wav")]
    ok = CliRunner().invoke(run_main, [*base, "--first-chunk-tokens", str(FIRST),
                                       "--chunks-out", str(tmp_path / "chunks.json")])
    assert ok.exit_code == 0, ok.output
    chunks = json.loads((tmp_path / "chunks.json").read_text())
    assert chunks[0]["token_range"] == [0, FIRST]
    for bad in ("0", "4"):
        result = CliRunner().invoke(run_main, [*base, "--first-chunk-tokens", bad])
        assert result.exit_code == 2 and _one_error_line(result.stderr, "must be >= 5")
    result = CliRunner().invoke(run_main, [*base[:-3], "--out", str(tmp_path / "o.wav"),
                                           "--first-chunk-tokens", "10"])
    assert result.exit_code == 2 and result.stderr == "error: --first-chunk-tokens needs --stream\n"


def test_the_server_applies_it_to_every_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from fastapi.testclient import TestClient

    from cosyvoice_serve import Engine, ServerSettings, create_app

    policy = ChunkPolicy(first_chunk_tokens=FIRST)
    settings = ServerSettings(speakers_dir=tmp_path / "speakers", sampling="greedy", chunk_policy=policy)
    engine = Engine(RuntimeBundle.open(DEMO_BUNDLE), "the demo bundle", chunk_policy=settings.chunk_policy)
    try:
        seen: list[ChunkPolicy] = []
        stream_tokens = engine.synth.stream_tokens

        def spy(tokens: Any, prompt: PromptFeatures, *, policy: ChunkPolicy | None = None,
                decoding: Any = None) -> Iterator[AudioChunk]:
            seen.append(policy or engine.synth.chunk_policy)
            return stream_tokens(tokens, prompt, policy=policy, decoding=decoding)

        monkeypatch.setattr(engine.synth, "stream_tokens", spy)
        with TestClient(create_app(engine, settings)) as client:
            for _ in range(2):
                response = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy",
                                                                 "response_format": "pcm"})
                assert response.status_code == 200, response.text
    finally:
        engine.close()
    assert seen == [policy, policy]


def test_cosyvoice_serve_refuses_a_bad_one_at_start_in_one_line() -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from cosyvoice_serve.cli import serve

    for bad in ("0", "3"):
        result = CliRunner().invoke(serve, ["--first-chunk-tokens", bad])
        assert result.exit_code == 2 and _one_error_line(result.stderr, "must be >= 5")


def test_cosyvoice_serve_opens_its_engine_with_the_flow_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--flow-window` and `--first-chunk-tokens` reach the engine as one policy (stopped there)."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from cosyvoice_serve import Engine
    from cosyvoice_serve.cli import serve

    opened: list[ChunkPolicy | None] = []

    def open_engine(model: Path | None, **options: Any) -> Engine:
        opened.append(options["chunk_policy"])
        raise UserError("stopped before opening")

    monkeypatch.setattr(Engine, "open", open_engine)
    result = CliRunner().invoke(serve, ["--flow-window", "2", "--first-chunk-tokens", str(FIRST)])
    assert result.exit_code == 2 and _one_error_line(result.stderr, "stopped before opening")
    assert opened == [ChunkPolicy(first_chunk_tokens=FIRST, flow="window", flow_window=2)]
