"""The torch-free runtime's synthesis: sampling, the LLM loop's state, the chunk schedule, a process without
torch and the CLI (test_runtime_synthesis_vs_torch compares its output with the torch reference pipeline)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_runtime import synthesis
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli import main
from cosyvoice_runtime.errors import SynthesisError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.sampling import (
    SILENT_TOKENS,
    RasConfig,
    SilentTokenLimiter,
    draw_indices,
    make_sampler,
    nucleus_sizes,
    ras_sample,
    softmax,
)
from cosyvoice_runtime.synthesis import Mode, Synthesizer, closing_after, llm_request

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


def draw_index(weights: np.ndarray, u: float) -> int:
    """`draw_indices` over one row's weights, all of them."""
    return int(draw_indices(weights[None], np.array([weights.shape[0]]), np.array([u]))[0])


def test_draw_index_is_the_inverse_cdf_of_unnormalised_weights() -> None:
    w = np.array([0.5, 0.0, 0.2, 0.15], dtype=np.float32)  # total 0.85
    assert draw_index(w, 0.0) == 0
    assert draw_index(w, 0.5 / 0.85 - 1e-6) == 0
    assert draw_index(w, 0.5 / 0.85 + 1e-6) == 2  # a zero weight is never drawn
    assert draw_index(w, 0.7 / 0.85 + 1e-6) == 3
    assert draw_index(w, 1 - 1e-12) == 3
    assert draw_index(np.array([0.3, 0.7, 0.0], dtype=np.float32), np.nextafter(1.0, 0.0)) == 1


def test_draw_indices_read_each_rows_first_counts_weights_alone() -> None:
    """Rows drawn together, each over its first `counts[r]` weights: the weights after them (the rest of a
    row's top k, outside its nucleus) are never drawn, even at a uniform whose product rounds to the total."""
    weights = np.array([[0.5, 0.0, 0.2, 0.15], [0.3, 0.7, 0.5, 0.5], [0.2, 0.0, 0.6, 0.2]], dtype=np.float32)
    counts = np.array([4, 2, 2])
    for u in (0.0, 0.3, 0.59, 0.61, 0.9, np.nextafter(1.0, 0.0)):
        drawn = draw_indices(weights, counts, np.full(3, u))
        assert drawn.tolist() == [draw_index(w[:n], u) for w, n in zip(weights, counts, strict=True)], u
        assert drawn[1] < 2 and drawn[2] == 0  # a zero weight is never drawn, nor one past the count

def test_nucleus_keeps_the_crossing_token_and_a_draw_is_one_uniform() -> None:
    logp = _logp({17: 0.5, 3: 0.2, 30: 0.15, 8: 0.1})  # nucleus 17, 3, 30 (crosses 0.8)
    probs = softmax(logp)
    assert nucleus_sizes(np.sort(probs)[None, ::-1], 0.8, 25).tolist() == [3]
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


# --- the LLM loop -----------------------------------------------------------------------------------


def test_llm_state_is_explicit(runtime_bundle: Path, prompt: PromptFeatures) -> None:
    with Synthesizer(RuntimeBundle.open(runtime_bundle)) as synth:
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


def test_a_decoding_ends_past_what_the_flow_holds(runtime_bundle: Path, prompt: PromptFeatures) -> None:
    """Ids past the flow's noise table fail at the flow, as upstream's: the decoding ends at the first one
    rather than decoding the rest first."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle)) as synth:
        ratio, frames = synth.dims.token_mel_ratio, synth.flow.noise.shape[2]
        room = 4  # a prompt that leaves the flow room for 4 generated tokens
        tokens = frames // ratio - room
        long_prompt = PromptFeatures(np.resize(prompt.speech_tokens, (1, tokens)),
                                     np.resize(prompt.mel, (1, ratio * tokens, prompt.mel.shape[2])),
                                     prompt.embedding)
        assert synth.flow.max_tokens(long_prompt) == room
        text = [5, 6, synth.bundle.endofprompt_id]
        request = llm_request(Mode.CROSS_LINGUAL, text, long_prompt)
        decoding = synth.decode(request, make_sampler("ras", 1), max_tokens=60, ignore_stop=True,
                                prompt=long_prompt)
        assert len(decoding.run()) == room + 1 and decoding.steps < 60
        with pytest.raises(SynthesisError, match="exceed the flow noise table"):
            synth.synthesize(text, long_prompt, sampler=make_sampler("ras", 1), mode=Mode.CROSS_LINGUAL,
                             max_tokens=60, ignore_stop=True)
        unbounded = synth.lm.decode(request, make_sampler("ras", 1), max_tokens=60, ignore_stop=True)
        assert len(unbounded.run()) > room + 1  # the same ids run on without the flow's bound


# --- streaming --------------------------------------------------------------------------------------


def test_chunk_policy_schedule() -> None:
    policy = ChunkPolicy()
    hops = policy.hops(63)
    assert policy.first_pad(63) == 12 and [next(hops) for _ in range(5)] == [37, 50, 100, 100, 100]
    assert policy.first_pad(75) == 0 and next(policy.hops(75)) == 25
    for p in (1, 24, 25, 26, 99):
        assert (p + next(policy.hops(p))) % 25 == 0


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


def test_offline_synthesis_runs_without_torch(runtime_bundle: Path, prompt_wav: Path, prompt_text: str,
                                              tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    script = _BLOCK_TORCH + textwrap.dedent(f"""
        from cosyvoice_runtime.cli import main
        try:
            main([
                "--bundle", {str(runtime_bundle)!r}, "--text", "Hello there.",
                "--prompt-wav", {str(prompt_wav)!r}, "--prompt-text", {prompt_text!r},
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
def test_cli_writes_a_24khz_pcm16_wav(runtime_bundle: Path, prompt_wav: Path, prompt_text: str,
                                      tmp_path: Path, stream: bool) -> None:
    out = tmp_path / "out.wav"
    args = ["--bundle", str(runtime_bundle), "--text", "Hello there. How are you?",
            "--prompt-wav", str(prompt_wav), "--prompt-text", prompt_text, "--seed", "3",
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
def test_cli_user_errors_exit_2_with_one_line(runtime_bundle: Path, prompt_wav: Path, prompt_text: str,
                                              tmp_path: Path, change: dict[str, str | None], message: str
                                              ) -> None:
    (tmp_path / "not-audio.wav").write_text("hello")
    opts: dict[str, str | None] = {
        "--bundle": str(runtime_bundle), "--text": "Hello there.",
        "--prompt-wav": str(prompt_wav), "--prompt-text": prompt_text, "--out": str(tmp_path / "o.wav"),
    }
    opts.update({k: v.format(tmp=tmp_path) if v else v for k, v in change.items()})
    args = [x for k, v in opts.items() for x in ([k] if v is None else [k, v])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("ends", ["exhausted", "dropped"])
def test_a_segment_gives_the_c_heap_back_after_its_decoding_closes(monkeypatch: pytest.MonkeyPatch,
                                                                   ends: str) -> None:
    events: list[str] = []
    def release() -> bool:
        events.append("released")
        return True

    monkeypatch.setattr(synthesis, "release_free_heap", release)
    chunks = closing_after(iter(["first", "last"]), lambda: events.append("closed"))
    assert next(chunks) == "first" and events == []  # nothing given back while the segment runs
    if ends == "exhausted":
        assert list(chunks) == ["last"]
    else:
        chunks.close()
    assert events == ["closed", "released"]
