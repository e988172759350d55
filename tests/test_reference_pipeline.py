"""The torch reference synthesis on the tiny bundle: every mode, determinism, lengths, the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import soundfile as sf
import torch
from click.testing import CliRunner

from cosyvoice_export.bundle.layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.cli import main
from cosyvoice_export.reference.frontend import TorchPromptFeatures
from cosyvoice_export.reference.llm_decode import TorchGreedySampler, TorchRasSampler
from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_runtime.synthesis import Mode

TEXT = "Hello there."
MAX_TOKENS = 24  # keeps each run short; the stop rule is tested in test_llm.py


@pytest.fixture(scope="module")
def pipe(tiny_bundle: Path) -> ReferencePipeline:
    return ReferencePipeline(ModelBundle.open(tiny_bundle))


@pytest.fixture(scope="module")
def prompt(pipe: ReferencePipeline, tiny_bundle: Path) -> TorchPromptFeatures:
    return pipe.prompt_features(tiny_bundle / PROMPT_WAV)


@pytest.fixture(scope="module")
def transcript(tiny_bundle: Path) -> str:
    return (tiny_bundle / PROMPT_TEXT).read_text().strip()


def test_prompt_features_are_aligned(prompt: TorchPromptFeatures, pipe: ReferencePipeline) -> None:
    n = prompt.speech_tokens.shape[1]
    assert n > 50  # 4.5 s at 25 Hz, cut to the mel length
    assert prompt.mel.shape == (1, 2 * n, 80)
    assert prompt.embedding.shape == (1, 192)
    assert int(prompt.speech_tokens.min()) >= 0 and int(prompt.speech_tokens.max()) < 6561
    assert len(set(prompt.speech_tokens[0].tolist())) > 5


def test_llm_inputs_per_mode(pipe: ReferencePipeline, prompt: TorchPromptFeatures, transcript: str) -> None:
    enc, eop = pipe.tokenizer.encode, pipe.eop_id
    zs = pipe.llm_inputs(Mode.ZERO_SHOT, TEXT, prompt, prompt_text=transcript)
    assert zs.text_ids == enc(TEXT)
    assert zs.prompt_text_ids == enc("You are a helpful assistant.<|endofprompt|>" + transcript)
    assert zs.prompt_speech_tokens == prompt.speech_tokens[0].tolist()

    cl = pipe.llm_inputs(Mode.CROSS_LINGUAL, TEXT, prompt)
    assert cl.text_ids == enc("You are a helpful assistant.<|endofprompt|>" + TEXT)
    assert cl.prompt_text_ids == [] and cl.prompt_speech_tokens == []
    assert eop in cl.text_ids

    ins = pipe.llm_inputs(Mode.INSTRUCT2, TEXT, prompt, instruct_text="Speak slowly.")
    assert ins.prompt_text_ids == enc("You are a helpful assistant. Speak slowly.<|endofprompt|>")
    assert ins.text_ids == enc(TEXT) and ins.prompt_speech_tokens == []

    # A text that already carries <|endofprompt|> is used verbatim.
    given = "You are a helpful assistant.<|endofprompt|>" + transcript
    assert pipe.llm_inputs(Mode.ZERO_SHOT, TEXT, prompt, prompt_text=given).prompt_text_ids == enc(given)
    with pytest.raises(ValueError, match="transcript"):
        pipe.llm_inputs(Mode.ZERO_SHOT, TEXT, prompt)
    with pytest.raises(ValueError, match="instruction"):
        pipe.llm_inputs(Mode.INSTRUCT2, TEXT, prompt)


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_synthesizes(pipe: ReferencePipeline, prompt: TorchPromptFeatures, transcript: str,
                                mode: Mode) -> None:
    sampler = TorchRasSampler(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(0)))
    out = pipe.synthesize(mode, TEXT, prompt, sampler, prompt_text=transcript, instruct_text="Speak slowly.",
                          max_tokens=MAX_TOKENS)
    n = len(out.speech_tokens)
    assert 0 < n <= MAX_TOKENS
    assert all(0 <= t < 6561 for t in out.speech_tokens)
    assert out.mel.shape == (1, 80, 2 * n)
    assert out.audio.shape == (480 * 2 * n,) and out.audio.dtype == np.float32
    assert np.abs(out.audio).max() <= 0.99 + 1e-7
    assert out.audio.std() > 1e-3  # not silence
    assert out.sample_rate == 24000


def test_seeded_runs_repeat_and_seeds_differ(pipe: ReferencePipeline, prompt: TorchPromptFeatures,
                                             transcript: str) -> None:
    def run(seed: int) -> list[int]:
        sampler = TorchRasSampler(pipe.config.llm.sampling, np.random.Generator(np.random.PCG64(seed)))
        return pipe.synthesize(Mode.ZERO_SHOT, TEXT, prompt, sampler, prompt_text=transcript,
                               max_tokens=MAX_TOKENS).speech_tokens

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_token2wav_is_deterministic_and_speed_scales(pipe: ReferencePipeline, prompt: TorchPromptFeatures
                                                     ) -> None:
    tokens = [5, 17, 300, 4000, 6560, 12, 12, 99, 1000, 2000]
    mel, wav = pipe.token2wav(tokens, prompt)
    mel2, wav2 = pipe.token2wav(tokens, prompt)
    assert torch.equal(mel, mel2) and np.array_equal(wav, wav2)
    fast_mel, fast_wav = pipe.token2wav(tokens, prompt, speed=2.0)
    assert fast_mel.shape[2] == mel.shape[2] // 2 and fast_wav.shape[0] == 480 * (mel.shape[2] // 2)
    with pytest.raises(ValueError, match="no speech tokens"):
        pipe.token2wav([], prompt)


def test_greedy_ignores_the_seed(pipe: ReferencePipeline, prompt: TorchPromptFeatures, transcript: str
                                 ) -> None:
    a = pipe.synthesize(Mode.ZERO_SHOT, TEXT, prompt, TorchGreedySampler(), prompt_text=transcript,
                        max_tokens=8)
    b = pipe.synthesize(Mode.ZERO_SHOT, TEXT, prompt, TorchGreedySampler(), prompt_text=transcript,
                        max_tokens=8)
    assert a.speech_tokens == b.speech_tokens
    assert np.array_equal(a.audio, b.audio)


def test_synth_command_writes_pcm16(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.wav"
    result = CliRunner().invoke(main, ["synth", "--model-dir", str(tiny_bundle), "--text", "Hi.",
                                       "--mode", "cross-lingual", "--out", str(out)])
    assert result.exit_code == 0, result.output
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.subtype == "PCM_16" and info.channels == 1
    assert info.frames > 0 and f"wrote {out}" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["x.wav"]  # no temp file left


def test_demo_uses_model_dir_env(tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSYVOICE_MODEL_DIR", str(tiny_bundle))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--text", "Hi.", "--out", "demo.wav"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "demo.wav").is_file()
    assert (tmp_path / "bundles" / "tiny-runtime" / "manifest.json").is_file()  # exported, then run
    assert not (tmp_path / "bundles" / "tiny").exists()  # the env's bundle was used, none written


@pytest.mark.parametrize(("removed", "note", "mode"), [
    (PROMPT_TEXT, "prompt: {model}/asset/zero_shot_prompt.wav has no transcript: speaking cross-lingual "
                  "(--prompt-text gives zero-shot)", "cross-lingual"),
    ("asset", "prompt: {model} carries none of its own: the embedded demo bundle's synthetic recording, "
              "which is not speech (--prompt-wav gives a voice)", "zero-shot"),
])
def test_demo_speaks_on_a_model_without_a_prompt_or_its_transcript(
        tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        removed: str, note: str, mode: str) -> None:
    """Upstream's release may carry no prompt, or a recording without its transcript: the README's first
    command runs on it all the same, and says how."""
    model = shutil.copytree(tiny_bundle, tmp_path / "release")
    gone = model / removed
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    monkeypatch.setenv("COSYVOICE_MODEL_DIR", str(model))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--text", "Hi.", "--out", "demo.wav"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == note.format(model=model)
    assert f"speech tokens ({mode}, ras, seed 0)" in capfd.readouterr().out  # cosyvoice-run's last line
    assert sf.info(str(tmp_path / "demo.wav")).frames > 0


def test_synth_on_a_missing_bundle_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["synth", "--model-dir", str(tmp_path / "none"), "--text", "Hi.",
                                       "--out", str(tmp_path / "x.wav")])
    assert result.exit_code == 2
    expected = f"error: {tmp_path / 'none'}: does not exist; expected a CosyVoice3 model directory"
    assert result.stderr.strip() == expected
