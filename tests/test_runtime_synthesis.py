"""The torch-free runtime's synthesis (sampling, LLM loop, flow, vocoder, streaming, CLI) against the
torch reference pipeline on the tiny bundle."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnxruntime as ort
import soundfile as sf
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from cosyvoice_export.bundle.layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.nets.cfm import time_grid as torch_time_grid
from cosyvoice_export.onnx.wrappers.hift import sine_phase as torch_sine_phase
from cosyvoice_export.reference.frontend import PromptFeatures as TorchPrompt
from cosyvoice_export.reference.llm_decode import GreedySampler as TorchGreedy
from cosyvoice_export.reference.llm_decode import RasSampler as TorchRas
from cosyvoice_export.reference.pipeline import Mode as RefMode
from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli import main
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.sampling import (
    SILENT_TOKENS,
    RasConfig,
    SilentTokenLimiter,
    draw_index,
    make_sampler,
    nucleus_size,
    ras_sample,
    softmax,
)
from cosyvoice_runtime.synthesis import AudioChunk, ChunkPolicy, Mode, Synthesizer, llm_request
from cosyvoice_runtime.token2wav import interpolate_linear, sine_phase, time_grid

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
def torch_prompt(pipe: ReferencePipeline, tiny_bundle: Path) -> TorchPrompt:
    return pipe.prompt_features(tiny_bundle / PROMPT_WAV)


@pytest.fixture(scope="module")
def prompt(torch_prompt: TorchPrompt) -> PromptFeatures:
    """The reference's prompt features as numpy: both sides start from the same inputs."""
    return PromptFeatures(torch_prompt.speech_tokens.numpy(), torch_prompt.mel.numpy(),
                          torch_prompt.embedding.numpy())


@pytest.fixture(scope="module")
def transcript(tiny_bundle: Path) -> str:
    return (tiny_bundle / PROMPT_TEXT).read_text().strip()


@pytest.fixture(scope="module")
def synth(runtime_bundle: Path) -> Iterator[Synthesizer]:
    with Synthesizer(RuntimeBundle.open(runtime_bundle)) as s:
        yield s


def _report(name: str, got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    print(f"{name}: max abs {diff.max():.3e}, mean abs {diff.mean():.3e} over {diff.size} values")
    return float(diff.max()), float(diff.mean())


# --- sampling ---------------------------------------------------------------------------------------


class _Uniforms:
    """A stand-in generator that hands out scripted uniforms and counts them."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.used = 0

    def random(self) -> float:
        self.used += 1
        return self.values[self.used - 1]


def _logp(probs: dict[int, float], vocab: int = 40) -> np.ndarray:
    rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
    p = np.full(vocab, rest)
    for i, v in probs.items():
        p[i] = v
    return np.log(p).astype(np.float32)


def test_draw_index_is_the_inverse_cdf_of_unnormalised_weights() -> None:
    w = np.array([0.5, 0.0, 0.2, 0.15], dtype=np.float32)  # total 0.85
    assert draw_index(w, 0.0) == 0
    assert draw_index(w, 0.5 / 0.85 - 1e-6) == 0
    assert draw_index(w, 0.5 / 0.85 + 1e-6) == 2  # a zero weight is never drawn
    assert draw_index(w, 0.7 / 0.85 + 1e-6) == 3
    assert draw_index(w, 1 - 1e-12) == 3
    assert draw_index(np.array([0.3, 0.7, 0.0], dtype=np.float32), np.nextafter(1.0, 0.0)) == 1


def test_nucleus_keeps_the_crossing_token_and_a_draw_is_one_uniform() -> None:
    logp = _logp({17: 0.5, 3: 0.2, 30: 0.15, 8: 0.1})  # nucleus 17, 3, 30 (crosses 0.8)
    probs = softmax(logp)
    assert nucleus_size(np.sort(probs)[::-1], 0.8, 25) == 3
    cfg = RasConfig()
    for u, want in [(0.0, 17), (0.58, 17), (0.6, 3), (0.82, 3), (0.83, 30), (0.999, 30)]:
        gen = _Uniforms(u)
        assert ras_sample(logp, [], cfg, gen) == want, u  # type: ignore[arg-type]
        assert gen.used == 1
    # top_k caps the nucleus before top_p does
    assert ras_sample(logp, [], RasConfig(top_k=2), _Uniforms(0.999)) == 3  # type: ignore[arg-type]


def test_a_recent_repeat_is_redrawn_from_the_full_softmax_with_a_second_uniform() -> None:
    logp = _logp({7: 0.9, 3: 0.09})  # nucleus = {7}
    cfg = RasConfig()
    masked = logp.copy()
    masked[7] = -np.inf
    full = softmax(masked)
    for u in (0.0, 0.5, 0.95, 0.999):
        gen = _Uniforms(0.3, u)
        token = ras_sample(logp, [7] + [0] * 9, cfg, gen)  # type: ignore[arg-type]
        assert gen.used == 2 and token == draw_index(full, u) and token != 7
    gen = _Uniforms(0.3, 0.5)
    assert ras_sample(logp, [7] + [0] * 10, cfg, gen) == 7  # type: ignore[arg-type]  # 7 left the window
    assert gen.used == 1
    # the redraw is not re-checked: 3 is in the history and still the likeliest redraw
    assert ras_sample(logp, [3, 7], cfg, _Uniforms(0.3, 0.5)) == 3  # type: ignore[arg-type]


def test_seeded_samplers_repeat() -> None:
    logp = np.log(softmax(np.random.default_rng(4).normal(size=6761).astype(np.float32) * 3))

    def draws(seed: int) -> list[int]:
        sampler = make_sampler("ras", seed)
        return [sampler(logp, []) for _ in range(30)]

    assert draws(5) == draws(5) != draws(6)
    assert make_sampler("greedy")(np.array([-3.0, -0.5, -0.5], dtype=np.float32), [1, 1]) == 1
    with pytest.raises(ValueError, match="unknown sampling"):
        make_sampler("top-k")


def test_silent_limiter_keeps_five_per_run() -> None:
    assert SILENT_TOKENS == {1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323}
    limiter = SilentTokenLimiter()
    tokens = [1, 2, 28, 29, 55, 248, 494, 1, 100, 2, 2, 2, 2, 2, 2, 7, 1]
    assert [t for t in tokens if limiter.keep(t)] == [1, 2, 28, 29, 55, 100, 2, 2, 2, 2, 2, 7, 1]


# --- numpy mirrors of torch arithmetic ---------------------------------------------------------------


def test_numpy_helpers_equal_torch_bit_for_bit(pipe: ReferencePipeline) -> None:
    assert np.array_equal(time_grid(10), torch_time_grid(10).numpy())
    f0 = torch.rand(1, 700, generator=torch.Generator().manual_seed(0)) * 400  # (1, T)
    cfg = pipe.config.hift
    want = torch_sine_phase(f0, cfg).numpy()
    assert np.array_equal(sine_phase(f0.numpy(), cfg.nb_harmonics + 1, cfg.sampling_rate, cfg.upsample_scale),
                          want)
    mel = torch.randn(1, 80, 137, generator=torch.Generator().manual_seed(1))
    for speed in (0.7, 1.3, 2.0):
        size = int(137 / speed)
        assert np.array_equal(interpolate_linear(mel.numpy(), size),
                              F.interpolate(mel, size=size, mode="linear").numpy())


# --- offline vs the torch reference -----------------------------------------------------------------


@pytest.mark.parametrize("mode", list(RefMode))
def test_greedy_offline_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer,
                                             torch_prompt: TorchPrompt, prompt: PromptFeatures,
                                             transcript: str, mode: RefMode) -> None:
    kw = {"prompt_text": transcript, "instruct_text": "Speak slowly."}
    ref = pipe.synthesize(mode, TEXT, torch_prompt, TorchGreedy(), max_tokens=RAS_TOKENS, **kw)
    inputs = pipe.llm_inputs(mode, TEXT, torch_prompt, **kw)
    got = synth.synthesize(inputs.text_ids, prompt, sampler=make_sampler("greedy"), mode=Mode(mode.value),
                           prompt_text_ids=inputs.prompt_text_ids, max_tokens=RAS_TOKENS)
    assert got.speech_tokens == ref.speech_tokens and len(got.speech_tokens) > 10
    assert got.audio.shape == ref.audio.shape == (480 * 2 * len(ref.speech_tokens),)
    mel_max, _ = _report(f"greedy {mode} mel", got.mel, ref.mel.numpy())
    audio_max, audio_mean = _report(f"greedy {mode} audio", got.audio, ref.audio)
    assert mel_max < MEL_MAX and audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX


def test_seeded_ras_offline_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer,
                                                 torch_prompt: TorchPrompt, prompt: PromptFeatures,
                                                 transcript: str) -> None:
    inputs = pipe.llm_inputs(RefMode.ZERO_SHOT, TEXT, torch_prompt, prompt_text=transcript)
    for seed in (0, 7):
        torch_sampler = TorchRas(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(seed)))
        ref = pipe.synthesize(RefMode.ZERO_SHOT, TEXT, torch_prompt, torch_sampler, prompt_text=transcript,
                              max_tokens=RAS_TOKENS)
        got = synth.synthesize(inputs.text_ids, prompt, sampler=make_sampler("ras", seed),
                               prompt_text_ids=inputs.prompt_text_ids, max_tokens=RAS_TOKENS)
        assert got.speech_tokens == ref.speech_tokens and len(set(got.speech_tokens)) > 20
        mel_max, _ = _report(f"ras seed {seed} mel", got.mel, ref.mel.numpy())
        audio_max, audio_mean = _report(f"ras seed {seed} audio", got.audio, ref.audio)
        assert mel_max < MEL_MAX and audio_mean < AUDIO_MEAN and audio_max < AUDIO_MAX


def test_llm_state_is_explicit(synth: Synthesizer, prompt: PromptFeatures) -> None:
    dims = synth.dims
    request = llm_request(Mode.ZERO_SHOT, [5, 6, synth.bundle.endofprompt_id], prompt, [7, 8])
    decoding = synth.lm.decode(request, make_sampler("ras", 1), max_tokens=9, ignore_stop=True)
    prefill = 1 + 5 + 1 + prompt.speech_tokens.shape[1]
    tokens = decoding.run()
    assert decoding.steps == 9 and len(decoding.history) == 9 and decoding.stop_id is None
    limiter = SilentTokenLimiter()
    assert tokens == decoding.tokens == [t for t in decoding.history if limiter.keep(t)]
    names = {f"past_{kv}_{i}" for i in range(dims.llm_layers) for kv in ("key", "value")}
    assert set(decoding.cache) == names
    # the last sampled id was never fed back: prefill + 8 single steps; onnxruntime keeps the cache
    # where it computed it (IOBinding), as OrtValues
    cache = decoding.cache["past_key_0"]
    assert isinstance(cache, ort.OrtValue)
    assert tuple(cache.shape()) == (1, dims.llm_kv_heads, prefill + 8, dims.llm_head_dim)
    with pytest.raises(ValueError, match="endofprompt"):
        synth.lm.decode(llm_request(Mode.CROSS_LINGUAL, [5, 6], prompt), make_sampler("greedy"))


def test_speed_equals_the_reference(pipe: ReferencePipeline, synth: Synthesizer, torch_prompt: TorchPrompt,
                                    prompt: PromptFeatures) -> None:
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


def _torch_stream(pipe: ReferencePipeline, tokens: list[int], prompt: TorchPrompt) -> list[np.ndarray]:
    """Upstream's CosyVoice3 streaming over the torch networks, on upstream's hops written out here."""
    hops = _upstream_hops(prompt.speech_tokens.shape[1], len(tokens))
    return [samples for _, samples in pipe.token2wav_stream(tokens, prompt, hops, lookahead=3)[0]]


@pytest.fixture(scope="module")
def stream_tokens(pipe: ReferencePipeline, torch_prompt: TorchPrompt, transcript: str) -> list[int]:
    sampler = TorchRas(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(3)))
    tokens = pipe.synthesize(RefMode.ZERO_SHOT, TEXT, torch_prompt, sampler, prompt_text=transcript,
                             max_tokens=STREAM_TOKENS).speech_tokens
    assert len(tokens) > 200
    return tokens


def _chunks(synth: Synthesizer, pipe: ReferencePipeline, torch_prompt: TorchPrompt, prompt: PromptFeatures,
            transcript: str) -> list[AudioChunk]:
    inputs = pipe.llm_inputs(RefMode.ZERO_SHOT, TEXT, torch_prompt, prompt_text=transcript)
    return list(synth.stream(inputs.text_ids, prompt, sampler=make_sampler("ras", 3),
                             prompt_text_ids=inputs.prompt_text_ids, max_tokens=STREAM_TOKENS))


def test_chunk_policy_schedule() -> None:
    policy = ChunkPolicy()
    hops = policy.hops(63)
    assert policy.first_pad(63) == 12 and [next(hops) for _ in range(5)] == [37, 50, 100, 100, 100]
    assert policy.first_pad(75) == 0 and next(policy.hops(75)) == 25
    for p in (1, 24, 25, 26, 99):
        assert (p + next(policy.hops(p))) % 25 == 0


def test_stream_equals_torch_streaming_and_repeats(pipe: ReferencePipeline, synth: Synthesizer,
                                                   torch_prompt: TorchPrompt, prompt: PromptFeatures,
                                                   transcript: str, stream_tokens: list[int]) -> None:
    chunks = _chunks(synth, pipe, torch_prompt, prompt, transcript)
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
    again = _chunks(synth, pipe, torch_prompt, prompt, transcript)
    digest = [hashlib.sha256(c.samples.tobytes()).hexdigest() for c in chunks]
    assert digest == [hashlib.sha256(c.samples.tobytes()).hexdigest() for c in again]
    assert [c.token_range for c in again] == [c.token_range for c in chunks]


def test_stream_of_few_tokens_is_one_final_chunk(synth: Synthesizer, prompt: PromptFeatures,
                                                 pipe: ReferencePipeline, torch_prompt: TorchPrompt) -> None:
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 6561, 20)]
    chunks = list(synth.stream_tokens(tokens, prompt))
    assert len(chunks) == 1 and chunks[0].is_final and chunks[0].token_range == (0, 20)
    _, ref_audio = pipe.token2wav(tokens, torch_prompt)
    assert _report("one-chunk stream", chunks[0].samples, ref_audio)[1] < AUDIO_MEAN


# --- torch-free process and the CLI -----------------------------------------------------------------

_BLOCK_TORCH = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cosyvoice_export", "torchaudio", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _Block())
"""


def test_offline_synthesis_runs_without_torch(runtime_bundle: Path, tiny_bundle: Path, tmp_path: Path
                                              ) -> None:
    out = tmp_path / "out.wav"
    script = _BLOCK_TORCH + textwrap.dedent(f"""
        from cosyvoice_runtime.cli import main
        try:
            main([
                "--bundle", {str(runtime_bundle)!r}, "--text", "Hello there.",
                "--prompt-wav", {str(tiny_bundle / PROMPT_WAV)!r},
                "--prompt-text", {(tiny_bundle / PROMPT_TEXT).read_text().strip()!r},
                "--sampling", "greedy", "--out", {str(out)!r},
            ])
        finally:
            leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cosyvoice_export"))
            assert not leaked, leaked
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.channels == 1 and info.subtype == "PCM_16"
    assert info.frames > 0 and info.frames % 960 == 0


@pytest.mark.parametrize("stream", [False, True])
def test_cli_writes_a_24khz_pcm16_wav(runtime_bundle: Path, tiny_bundle: Path, tmp_path: Path,
                                      stream: bool) -> None:
    out = tmp_path / "out.wav"
    args = ["--bundle", str(runtime_bundle), "--text", "Hello there. How are you?",
            "--prompt-wav", str(tiny_bundle / PROMPT_WAV),
            "--prompt-text", (tiny_bundle / PROMPT_TEXT).read_text().strip(), "--seed", "3",
            "--tokens-out", str(tmp_path / "tokens.json"), "--out", str(out)]
    if stream:
        args += ["--stream", "--chunks-out", str(tmp_path / "chunks.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    audio, sr = sf.read(str(out), dtype="float32")
    info = sf.info(str(out))
    assert sr == 24000 and info.subtype == "PCM_16" and audio.ndim == 1 and audio.std() > 1e-3
    assert "RTF" in result.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left


@pytest.mark.parametrize("change, message", [
    ({"--text": "   "}, "--text is empty"),
    ({"--prompt-text": ""}, "--prompt-text"),
    ({"--bundle": "{tmp}"}, "manifest.json"),
    ({"--prompt-wav": "{tmp}/not-audio.wav"}, "not-audio.wav"),
    ({"--speed": "1.5", "--stream": None}, "offline only"),
])
def test_cli_user_errors_exit_2_with_one_line(runtime_bundle: Path, tiny_bundle: Path, tmp_path: Path,
                                              change: dict[str, str | None], message: str) -> None:
    (tmp_path / "not-audio.wav").write_text("hello")
    opts: dict[str, str | None] = {
        "--bundle": str(runtime_bundle), "--text": "Hello there.",
        "--prompt-wav": str(tiny_bundle / PROMPT_WAV),
        "--prompt-text": (tiny_bundle / PROMPT_TEXT).read_text().strip(), "--out": str(tmp_path / "o.wav"),
    }
    opts.update({k: v.format(tmp=tmp_path) if v else v for k, v in change.items()})
    args = [x for k, v in opts.items() for x in ([k] if v is None else [k, v])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not (tmp_path / "o.wav").exists()
