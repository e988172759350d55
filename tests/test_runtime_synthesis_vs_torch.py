"""The torch-free runtime's synthesis (LLM loop, flow, vocoder, streaming) against the torch reference
pipeline on the tiny bundle."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.nets.cfm import time_grid as torch_time_grid
from cosyvoice_export.onnx.wrappers.hift import sine_phase as torch_sine_phase
from cosyvoice_export.reference.frontend import TorchPromptFeatures
from cosyvoice_export.reference.llm_decode import TorchGreedySampler, TorchRasSampler
from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_graphs import ode_time_grid
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.sampling import make_sampler
from cosyvoice_runtime.synthesis import AudioChunk, Mode, Synthesizer
from cosyvoice_runtime.token2wav import accumulate_phase, interpolate_linear, phase_steps, wrap_phase

TEXT = "Hello there, how are you today?"
RAS_TOKENS = 120  # RAS on the tiny LM rarely stops: bounds the run
STREAM_TOKENS = 230  # 25+pad, 50, 100 and a final chunk

# Runtime vs torch. The flow graphs match torch to ~1e-6; the vocoder's f0 runs in float32 (torch:
# float64), which moves the NSF source slightly, so the waveform gets the L1 bound.
MEL_MAX = 1e-4
AUDIO_MEAN = 2e-3
AUDIO_MAX = 3e-2


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe(tiny_bundle: Path) -> ReferencePipeline:
    return ReferencePipeline(ModelBundle.open(tiny_bundle))


@pytest.fixture(scope="module")
def torch_prompt(pipe: ReferencePipeline, prompt_wav: Path) -> TorchPromptFeatures:
    return pipe.prompt_features(prompt_wav)


@pytest.fixture(scope="module")
def prompt(torch_prompt: TorchPromptFeatures) -> PromptFeatures:
    """The reference's prompt features as numpy: both sides start from the same inputs."""
    return PromptFeatures(torch_prompt.speech_tokens.numpy(), torch_prompt.mel.numpy(),
                          torch_prompt.embedding.numpy())


@pytest.fixture(scope="module")
def synth(runtime_bundle: Path) -> Iterator[Synthesizer]:
    with Synthesizer(RuntimeBundle.open(runtime_bundle)) as s:
        yield s


def _report(name: str, got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    print(f"{name}: max abs {diff.max():.3e}, mean abs {diff.mean():.3e} over {diff.size} values")
    return float(diff.max()), float(diff.mean())


# --- numpy mirrors of torch arithmetic --------------------------------------------------------------


def test_numpy_helpers_equal_torch_bit_for_bit(pipe: ReferencePipeline) -> None:
    assert np.array_equal(ode_time_grid(10), torch_time_grid(10).numpy())
    f0 = torch.rand(1, 700, generator=torch.Generator().manual_seed(0)) * 400  # (1, T)
    cfg = pipe.config.hift
    want = torch_sine_phase(f0, cfg).numpy()
    harmonics = cfg.nb_harmonics + 1
    acc = accumulate_phase(np.zeros(harmonics), phase_steps(f0.numpy(), harmonics, cfg.sampling_rate))
    assert np.array_equal(wrap_phase(acc, cfg.upsample_scale), want)
    mel = torch.randn(1, 80, 137, generator=torch.Generator().manual_seed(1))
    for speed in (0.7, 1.3, 2.0):
        size = int(137 / speed)
        assert np.array_equal(interpolate_linear(mel.numpy(), size),
                              F.interpolate(mel, size=size, mode="linear").numpy())


# --- offline vs the torch reference -----------------------------------------------------------------


@pytest.mark.parametrize("mode", list(Mode))
def test_greedy_offline_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer,
                                             torch_prompt: TorchPromptFeatures, prompt: PromptFeatures,
                                             prompt_text: str, mode: Mode) -> None:
    kw = {"prompt_text": prompt_text, "instruct_text": "Speak slowly."}
    ref = pipe.synthesize(mode, TEXT, torch_prompt, TorchGreedySampler(), max_tokens=RAS_TOKENS, **kw)
    inputs = pipe.llm_inputs(mode, TEXT, torch_prompt, **kw)
    got = synth.synthesize(inputs.text_ids, prompt, sampler=make_sampler("greedy"), mode=mode,
                           prompt_text_ids=inputs.prompt_text_ids, max_tokens=RAS_TOKENS)
    assert got.speech_tokens == ref.speech_tokens and len(got.speech_tokens) > 10
    assert got.audio.shape == ref.audio.shape == (480 * 2 * len(ref.speech_tokens),)
    mel_max, _ = _report(f"greedy {mode} mel", got.mel, ref.mel.numpy())
    audio_max, audio_mean = _report(f"greedy {mode} audio", got.audio, ref.audio)
    assert mel_max < MEL_MAX and audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX


def test_seeded_ras_offline_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer,
                                                 torch_prompt: TorchPromptFeatures, prompt: PromptFeatures,
                                                 prompt_text: str) -> None:
    inputs = pipe.llm_inputs(Mode.ZERO_SHOT, TEXT, torch_prompt, prompt_text=prompt_text)
    for seed in (0, 7):
        torch_sampler = TorchRasSampler(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(seed)))
        ref = pipe.synthesize(Mode.ZERO_SHOT, TEXT, torch_prompt, torch_sampler, prompt_text=prompt_text,
                              max_tokens=RAS_TOKENS)
        got = synth.synthesize(inputs.text_ids, prompt, sampler=make_sampler("ras", seed),
                               prompt_text_ids=inputs.prompt_text_ids, max_tokens=RAS_TOKENS)
        assert got.speech_tokens == ref.speech_tokens and len(set(got.speech_tokens)) > 20
        mel_max, _ = _report(f"ras seed {seed} mel", got.mel, ref.mel.numpy())
        audio_max, audio_mean = _report(f"ras seed {seed} audio", got.audio, ref.audio)
        assert mel_max < MEL_MAX and audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX


def test_speed_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer,
                                    torch_prompt: TorchPromptFeatures, prompt: PromptFeatures) -> None:
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 6561, 40)]
    for speed in (0.8, 1.25):
        ref_mel, ref_audio = pipe.token2wav(tokens, torch_prompt, speed=speed)
        mel, audio, _ = synth.token2wav(tokens, prompt, speed=speed)
        assert mel.shape == ref_mel.shape == (1, 80, int(80 / speed))
        assert _report(f"speed {speed} mel", mel, ref_mel.numpy())[0] < MEL_MAX
        assert _report(f"speed {speed} audio", audio, ref_audio)[1] < AUDIO_MEAN


# --- streaming --------------------------------------------------------------------------------------


def _upstream_hops(prompt_tokens: int, n_tokens: int) -> list[int]:
    """Chunk hops as upstream's `tts` loop fires them for a first request (written out independently)."""
    token_hop_len, pad = 25, math.ceil(prompt_tokens / 25) * 25 - prompt_tokens
    hops, offset = [], 0
    while True:
        this_hop = token_hop_len + pad if offset == 0 else token_hop_len
        if n_tokens - offset < this_hop + 3:
            return hops
        hops.append(this_hop)
        offset += this_hop
        token_hop_len = min(100, token_hop_len * 2)


def _torch_stream(pipe: ReferencePipeline, tokens: list[int], prompt: TorchPromptFeatures
                  ) -> list[np.ndarray]:
    """Upstream's CosyVoice3 streaming over the torch networks, on upstream's hops written out here."""
    hops = _upstream_hops(prompt.speech_tokens.shape[1], len(tokens))
    return [samples for _, samples in pipe.token2wav_stream(tokens, prompt, hops, lookahead=3)[0]]


@pytest.fixture(scope="module")
def stream_tokens(pipe: ReferencePipeline, torch_prompt: TorchPromptFeatures, prompt_text: str) -> list[int]:
    sampler = TorchRasSampler(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(3)))
    tokens = pipe.synthesize(Mode.ZERO_SHOT, TEXT, torch_prompt, sampler, prompt_text=prompt_text,
                             max_tokens=STREAM_TOKENS).speech_tokens
    assert len(tokens) > 200
    return tokens


def _chunks(synth: Synthesizer, pipe: ReferencePipeline, torch_prompt: TorchPromptFeatures,
            prompt: PromptFeatures, prompt_text: str) -> list[AudioChunk]:
    inputs = pipe.llm_inputs(Mode.ZERO_SHOT, TEXT, torch_prompt, prompt_text=prompt_text)
    return list(synth.stream(inputs.text_ids, prompt, sampler=make_sampler("ras", 3),
                             prompt_text_ids=inputs.prompt_text_ids, max_tokens=STREAM_TOKENS))


def test_stream_equals_torch_streaming_and_repeats(pipe: ReferencePipeline, synth: Synthesizer,
                                                   torch_prompt: TorchPromptFeatures, prompt: PromptFeatures,
                                                   prompt_text: str, stream_tokens: list[int]) -> None:
    chunks = _chunks(synth, pipe, torch_prompt, prompt, prompt_text)
    p, n = prompt.speech_tokens.shape[1], len(stream_tokens)
    hops = _upstream_hops(p, n)
    assert len(hops) >= 3 and hops[1:3] == [50, 100] and (p + hops[0]) % 25 == 0
    # boundaries, indices and ranges
    assert [c.index for c in chunks] == list(range(len(hops) + 1))
    assert [c.is_final for c in chunks] == [False] * len(hops) + [True]
    ends = np.cumsum([0, *hops, n - sum(hops)])
    assert [c.token_range for c in chunks] == list(zip(ends[:-1].tolist(), ends[1:].tolist(), strict=True))
    starts = [c.sample_range[0] for c in chunks]
    assert starts == [0, *[c.sample_range[1] for c in chunks[:-1]]]
    assert all(c.sample_range[1] - c.sample_range[0] == len(c.samples) > 0 for c in chunks)
    assert all(c.sample_rate == 24000 and c.samples.dtype == np.float32 for c in chunks)
    # first chunk: 480 (2 hop_0 - 8) samples, the total: 480 * 2n
    assert len(chunks[0].samples) == 480 * (2 * hops[0] - 8)
    audio = np.concatenate([c.samples for c in chunks])
    assert audio.shape == (480 * 2 * n,)

    # the same tokens through upstream's streaming algorithm on the torch networks
    want = _torch_stream(pipe, stream_tokens, torch_prompt)
    assert [len(w) for w in want] == [len(c.samples) for c in chunks]
    audio_max, audio_mean = _report("stream audio", audio, np.concatenate(want))
    assert audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX

    # streaming differs from offline only by the block-causal chunks (same tokens, same noise)
    offline = synth.token2wav(stream_tokens, prompt)[1]
    assert offline.shape == audio.shape and not np.array_equal(offline, audio)

    # a second run gives the same chunks, byte for byte
    again = _chunks(synth, pipe, torch_prompt, prompt, prompt_text)
    digest = [hashlib.sha256(c.samples.tobytes()).hexdigest() for c in chunks]
    assert digest == [hashlib.sha256(c.samples.tobytes()).hexdigest() for c in again]
    assert [c.token_range for c in again] == [c.token_range for c in chunks]


@pytest.mark.parametrize("flow", ["cache", "rerun"])
@pytest.mark.parametrize("lag", [1, 2])
def test_a_prompt_short_of_its_tokens_streams_as_upstreams_voice_conversion(
        pipe: ReferencePipeline, synth: Synthesizer, torch_prompt: TorchPromptFeatures,
        stream_tokens: list[int], lag: int, flow: str) -> None:
    """Upstream's voice conversion leaves the prompt's mel `lag` frames short of its tokens' (uncut): its
    generated frames start `lag` frames early and each later chunk starts again `lag` frames before the
    last one ended. The runtime's streams (cached and re-run flow) and offline path give upstream's
    algorithm's samples on the torch networks."""
    short = TorchPromptFeatures(torch_prompt.speech_tokens, torch_prompt.mel[:, :-lag],
                                torch_prompt.embedding)
    prompt = PromptFeatures(short.speech_tokens.numpy(), short.mel.numpy(), short.embedding.numpy())
    assert synth.flow.prompt_lag(prompt) == lag
    policy = ChunkPolicy(flow=flow)  # type: ignore[arg-type]
    chunks = list(synth.stream_tokens(stream_tokens, prompt, policy=policy))
    want = _torch_stream(pipe, stream_tokens, short)
    n = len(stream_tokens)
    assert len(chunks) == len(want) >= 4
    assert [len(c.samples) for c in chunks] == [len(w) for w in want]
    audio = np.concatenate([c.samples for c in chunks])
    assert audio.shape == (480 * (2 * n + lag * len(chunks)),)  # each chunk's first `lag` frames again
    audio_max, audio_mean = _report(f"stream, prompt {lag} short, {flow}", audio, np.concatenate(want))
    assert audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX

    mel, offline, _ = synth.token2wav(stream_tokens, prompt)
    ref_mel, ref_audio = pipe.token2wav(stream_tokens, short)
    assert mel.shape == ref_mel.shape == (1, 80, 2 * n + lag)
    assert _report(f"offline mel, prompt {lag} short", mel, ref_mel.numpy())[0] < MEL_MAX
    assert _report(f"offline audio, prompt {lag} short", offline, ref_audio)[1] < AUDIO_MEAN


def test_stream_of_few_tokens_is_one_final_chunk(synth: Synthesizer, prompt: PromptFeatures,
                                                 pipe: ReferencePipeline,
                                                 torch_prompt: TorchPromptFeatures) -> None:
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 6561, 20)]
    chunks = list(synth.stream_tokens(tokens, prompt))
    assert len(chunks) == 1 and chunks[0].is_final and chunks[0].token_range == (0, 20)
    _, ref_audio = pipe.token2wav(tokens, torch_prompt)
    assert _report("one-chunk stream", chunks[0].samples, ref_audio)[1] < AUDIO_MEAN
