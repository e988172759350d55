"""`cosyvoice_runtime.CosyVoice3`: upstream's usage pattern, torch-free, giving `cosyvoice-run`'s samples."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import soundfile as sf
from click.testing import CliRunner

import cosyvoice_runtime.cosyvoice3
from cosyvoice_graphs.bundle_layout import MODEL_YAML
from cosyvoice_runtime import AutoModel, CosyVoice3, bundle_source, runners, save_wav
from cosyvoice_runtime.audio_files import WAV, write_audio_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import ProviderError, UserError
from cosyvoice_runtime.frontend import (
    PromptAudio,
    PromptFeatures,
    check_prompt_audio,
    extract_prompt,
    open_session,
    read_prompt_audio,
    source_speech_tokens,
)
from cosyvoice_runtime.speakers import REGISTRY, SPEAKERS_DIR_ENV, SpeakerRegistry, frontend_fingerprint

PROMPT_WAV = DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav"
TRANSCRIPT = (DEMO_BUNDLE / "asset" / "zero_shot_prompt.txt").read_text(encoding="utf-8").strip()
TEXT = "Hello there. How are you?"


@pytest.fixture(scope="module")
def cosyvoice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CosyVoice3]:
    with CosyVoice3(DEMO_BUNDLE, speakers_dir=tmp_path_factory.mktemp("speakers")) as voice:
        yield voice


def _pcm16(samples: np.ndarray, rate: int, folder: Path) -> np.ndarray:
    """`samples` as `cosyvoice-run` stores them (16-bit PCM WAV)."""
    write_audio_atomic(folder / "object.wav", samples, rate, WAV)
    return sf.read(folder / "object.wav", dtype="int16")[0]


def _cli(folder: Path, *args: str, text: str = TEXT) -> tuple[np.ndarray, int]:
    """`cosyvoice-run`'s samples for the demo prompt and `text`, and how many pieces it made (chunks when
    streaming, segments offline)."""
    out, pieces = folder / "cli.wav", folder / "pieces.json"
    record = ["--chunks-out" if "--stream" in args else "--tokens-out", str(pieces)]
    result = CliRunner().invoke(run_main, ["--model", str(DEMO_BUNDLE), "--text", text, "--prompt-wav",
                                           str(PROMPT_WAV), *args, *record, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return sf.read(out, dtype="int16")[0], len(json.loads(pieces.read_text()))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["zero-shot", "cross-lingual", "instruct2"])
def test_upstream_usage_gives_cosyvoice_runs_samples(cosyvoice: CosyVoice3, tmp_path: Path, mode: str,
                                                      stream: bool) -> None:
    if mode == "zero-shot":
        outputs = cosyvoice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV), stream=stream)
        args = ["--prompt-text", TRANSCRIPT]
    elif mode == "cross-lingual":
        outputs = cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), stream=stream)
        args = ["--mode", mode]
    else:
        outputs = cosyvoice.inference_instruct2(TEXT, "Speak slowly.", str(PROMPT_WAV), stream=stream)
        args = ["--mode", mode, "--instruct", "Speak slowly."]
    speech = [out["tts_speech"] for out in outputs]
    assert all(s.dtype == np.float32 and s.ndim == 2 and s.shape[0] == 1 for s in speech)
    got = _pcm16(np.concatenate(speech, axis=1)[0], cosyvoice.sample_rate, tmp_path)
    want, pieces = _cli(tmp_path, *args, *(["--stream"] if stream else []))
    np.testing.assert_array_equal(got, want)
    assert len(speech) == pieces  # one output per chunk when streaming, per segment offline


def test_a_registered_speaker_speaks_as_its_prompt(cosyvoice: CosyVoice3) -> None:
    assert cosyvoice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "my_zero_shot_spk") is True
    assert cosyvoice.list_available_spks() == ["my_zero_shot_spk"]
    by_id = [o["tts_speech"] for o in cosyvoice.inference_zero_shot(TEXT, "", "",
                                                                    zero_shot_spk_id="my_zero_shot_spk")]
    by_wav = [o["tts_speech"] for o in cosyvoice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV))]
    assert len(by_id) == len(by_wav)
    for a, b in zip(by_id, by_wav, strict=True):
        np.testing.assert_array_equal(a, b)


def test_speakers_are_kept_in_the_object_until_saved(tmp_path: Path) -> None:
    folder = tmp_path / "speakers"
    with CosyVoice3(DEMO_BUNDLE, speakers_dir=folder) as voice:
        assert voice.list_available_spks() == []
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "b")
        voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "a")
        assert voice.list_available_spks() == ["b", "a"] and not folder.exists()  # nothing written yet
        voice.save_spkinfo()
        assert voice.list_available_spks() == ["a", "b"] and (folder / REGISTRY).is_file()
        want = voice.speakers.get("a")
    with CosyVoice3(DEMO_BUNDLE, speakers_dir=str(folder)) as again:  # a str, as model_dir may be
        assert again.list_available_spks() == ["a", "b"]
        got = again.speakers.get("a")
        assert got is not None and want is not None and got.prompt_text == TRANSCRIPT
        np.testing.assert_array_equal(got.features.mel, want.features.mel)
        with pytest.raises(ValueError, match="a speaker name is 1 to 64 printable characters"):
            again.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "x" * 65)


def test_prompt_wav_as_path_file_or_array(cosyvoice: CosyVoice3) -> None:
    want = cosyvoice.prompt_features(PROMPT_WAV)
    samples, rate = sf.read(PROMPT_WAV, dtype="float32")
    stereo = np.stack([samples, samples], axis=1)
    with open(PROMPT_WAV, "rb") as f:
        given = [cosyvoice.prompt_features(f), cosyvoice.prompt_features((samples, rate)),
                 cosyvoice.prompt_features((stereo, rate)), cosyvoice.prompt_features(str(PROMPT_WAV))]
    for got in given:
        np.testing.assert_array_equal(got.speech_tokens, want.speech_tokens)
        np.testing.assert_array_equal(got.mel, want.mel)
        np.testing.assert_array_equal(got.embedding, want.embedding)


def test_the_prompt_front_end_opens_on_first_use(tmp_path: Path) -> None:
    """A registered speaker speaks without the front end's models; the first prompt opens them, later ones
    reuse them, and the features are those of sessions opened directly."""
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    campplus, tokenizer = (open_session(bundle.frontend_path(n)) for n in ("campplus", "speech_tokenizer"))
    want = extract_prompt(PROMPT_WAV, campplus, tokenizer, bundle.dims.token_mel_ratio)
    SpeakerRegistry(tmp_path, frontend_fingerprint(bundle)).add("saved", TRANSCRIPT, want)
    with CosyVoice3(DEMO_BUNDLE, speakers_dir=tmp_path) as voice:
        assert voice._prompt_sessions is None
        speech = list(voice.inference_zero_shot(TEXT, "", "", zero_shot_spk_id="saved"))
        assert speech and voice._prompt_sessions is None
        got = voice.prompt_features(PROMPT_WAV)
        sessions = voice._prompt_sessions
        assert sessions is not None
        again = voice.prompt_features(str(PROMPT_WAV))
        assert voice._prompt_sessions is sessions
        for features in (got, again):
            np.testing.assert_array_equal(features.speech_tokens, want.speech_tokens)
            np.testing.assert_array_equal(features.mel, want.mel)
            np.testing.assert_array_equal(features.embedding, want.embedding)
    assert voice._prompt_sessions is None  # close released them


def test_concurrent_first_prompts_open_the_front_end_once(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Path] = []

    def slow_open(path: Path) -> onnxruntime.InferenceSession:
        opened.append(path)
        time.sleep(0.2)  # widens the window in which an unlocked second caller would open them again
        return open_session(path)

    monkeypatch.setattr(cosyvoice_runtime.cosyvoice3, "open_session", slow_open)
    start = threading.Barrier(4)
    with CosyVoice3(DEMO_BUNDLE) as voice, ThreadPoolExecutor(4) as pool:

        def first_prompt(_: int) -> PromptFeatures:
            start.wait()
            return voice.prompt_features(PROMPT_WAV)

        results = list(pool.map(first_prompt, range(4)))  # a thread's error is raised here
    assert len(results) == 4
    assert opened == [voice.bundle.frontend_path("campplus"), voice.bundle.frontend_path("speech_tokenizer")]


def test_bad_input_is_refused_before_synthesis(cosyvoice: CosyVoice3) -> None:
    with open(PROMPT_WAV, "rb") as closed:
        pass
    text_mode = open(PROMPT_WAV)  # noqa: SIM115  (open for the call below)
    cases = [
        (lambda: cosyvoice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV), speed=float("nan")),
         "speed is nan; expected a number from 0.25 to 4"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), speed=0),
         "speed is 0; expected a number from 0.25 to 4"),
        # no mel frame left for the vocoder (an onnxruntime error), or hours of audio
        (lambda: cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), speed=1000), "speed is 1000; "),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), speed=1e-4), r"speed is 0.0001; "),
        (lambda: cosyvoice.inference_zero_shot(TEXT, None, str(PROMPT_WAV)),
         "prompt_text is NoneType; expected a str"),
        (lambda: cosyvoice.inference_instruct2(TEXT, None, str(PROMPT_WAV)),
         "instruct_text is NoneType; expected a str"),
        (lambda: cosyvoice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), 5),
         "zero_shot_spk_id is int; expected a str"),
        (lambda: cosyvoice.add_zero_shot_spk(None, str(PROMPT_WAV), "nobody"),
         "prompt_text is NoneType; expected a str"),
        # stored stripped, it would be unknown under the name given
        (lambda: cosyvoice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), " alice "),
         "zero_shot_spk_id: a speaker name has no leading or trailing blanks; got ' alice '"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.zeros(24000, np.float32),)),
         r"prompt_wav is a tuple of 1; expected \(samples, sample rate\)"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.full((2, 48000), 0.1, np.float32), 24000)),
         r"prompt_wav is \(\(2, 48000\) array, 24000\); expected \(samples \(N,\) or \(N, channels\)"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.full(24000, 3000, np.int16), 24000)),
         r"prompt_wav holds int16 samples; expected floats in \[-1, 1\]"),  # not samples of 3000
        (lambda: cosyvoice.inference_vc((np.full(150, 0.1, np.float32), 16000), str(PROMPT_WAV)),
         "source_wav lasts 9.38 ms; the speech tokenizer needs more than 12.5 ms"),
        (lambda: list(cosyvoice.inference_zero_shot(iter(["", ""]), TRANSCRIPT, str(PROMPT_WAV))),
         "tts_text: the streamed pieces held no text"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, closed), "the file is closed"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, text_mode), "opened in text mode; open it in "),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, ""),
         "prompt_wav is empty; expected a recording's path"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, 5), "prompt_wav is int; expected a path"),
        (lambda: cosyvoice.inference_cross_lingual(None, str(PROMPT_WAV)),
         "tts_text is NoneType; expected a str"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, "", zero_shot_spk_id="nobody"),
         "zero_shot_spk_id: unknown speaker 'nobody'"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.zeros(8000, np.float32), 8000)),
         "prompt_wav has sample rate 8000 Hz; the minimum is 16000 Hz"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.full(500001, 0.1, np.float32), 500001)),
         "prompt_wav has sample rate 500001 Hz; the maximum is 384000 Hz"),
        (lambda: cosyvoice.inference_cross_lingual(TEXT, (np.zeros(24000, np.float32), 24000)),
         "prompt_wav is silent or nearly so"),
        (lambda: cosyvoice.inference_cross_lingual("  ", str(PROMPT_WAV)), "tts_text is empty"),
        (lambda: cosyvoice.inference_zero_shot(TEXT, "", str(PROMPT_WAV)), "zero-shot needs"),
        (lambda: cosyvoice.synthesize_many("Hey", str(PROMPT_WAV), mode="cross_lingual"),
         "texts is str; expected a list of str"),  # not three texts of a letter each
        (lambda: cosyvoice.synthesize_many([TEXT, None], str(PROMPT_WAV), mode="cross_lingual"),
         r"texts\[1\] is NoneType; expected a str"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):  # UserError and FrontendError are ValueErrors
            call()
    text_mode.close()
    assert issubclass(UserError, ValueError)
    assert "nobody" not in cosyvoice.list_available_spks()
    with pytest.raises(UserError, match="sampling is 'beam'"):
        CosyVoice3(DEMO_BUNDLE, sampling="beam")
    for seed in (1.5, "7", None, True):
        with pytest.raises(UserError, match=f"seed is {seed!r}; expected an integer from 0 to "):
            CosyVoice3(DEMO_BUNDLE, seed=seed)
    cpus = len(os.sched_getaffinity(0))
    for threads, why in ((0, "0 is not a count"), (1.5, "1.5 is not a count"),
                         (cpus + 1, f"{cpus + 1} is more than the {cpus} CPUs")):
        with pytest.raises(UserError, match=f"threads: {why}"):
            CosyVoice3(DEMO_BUNDLE, threads=threads)
    with pytest.raises(UserError, match="model_dir is NoneType; expected a bundle's path"):
        CosyVoice3(None)
    with pytest.raises(ValueError, match=r"nowhere \(model_dir\): does not exist$"):  # not the CLI's --model
        CosyVoice3("nowhere")
    with pytest.raises(ValueError, match=r"\(model_dir\): does not exist; a model hub id\? `cosyvoice-export "
                                         r"download` fetches"):  # what upstream's AutoModel would download
        CosyVoice3("FunAudioLLM/Fun-CosyVoice3-0.5B-2512")


def test_a_speaker_added_without_a_transcript_is_refused_zero_shot_saying_why() -> None:
    """As upstream, it speaks cross-lingual and instruct2; zero-shot needs the transcript it lacks, which a
    prompt_text given beside the speaker (unused) does not change."""
    with CosyVoice3(DEMO_BUNDLE) as voice:
        assert voice.add_zero_shot_spk("", str(PROMPT_WAV), "untranscribed")
        with pytest.raises(UserError, match="zero_shot_spk_id 'untranscribed' was added without a transcr"):
            voice.inference_zero_shot(TEXT, TRANSCRIPT, "", zero_shot_spk_id="untranscribed")


def test_a_closed_object_refuses_work_at_the_call(tmp_path: Path) -> None:
    """At the call, not on iteration: no model opened again, no speaker added."""
    voice = CosyVoice3(DEMO_BUNDLE, speakers_dir=tmp_path)
    voice.close()
    calls = [lambda: voice.inference_zero_shot(TEXT, TRANSCRIPT, str(PROMPT_WAV)),
             lambda: voice.inference_cross_lingual(TEXT, str(PROMPT_WAV), stream=True),
             lambda: voice.inference_vc(str(PROMPT_WAV), str(PROMPT_WAV)),
             lambda: voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "late"),
             lambda: voice.synthesize_many([TEXT], str(PROMPT_WAV), prompt_text=TRANSCRIPT),
             lambda: voice.prompt_features(str(PROMPT_WAV))]
    for call in calls:
        with pytest.raises(UserError, match="this CosyVoice3 is closed: open the bundle again"):
            call()
    assert voice._prompt_sessions is None and voice.list_available_spks() == []
    voice.close()  # twice is fine


def test_an_object_left_open_ends_its_threads_when_collected_and_at_exit(tmp_path: Path) -> None:
    """Upstream's example never closes its object: a speaker's prefix job still running as the script ends
    must not abort the process (SIGABRT, a thread inside onnxruntime as the interpreter finalises), and an
    object dropped unclosed lets its graphs go, which the job's thread holds."""
    script = textwrap.dedent(f"""
        from cosyvoice_runtime import AutoModel
        cosyvoice = AutoModel(model_dir={str(DEMO_BUNDLE)!r}, speakers_dir={str(tmp_path)!r}, threads=1)
        cosyvoice.add_zero_shot_spk({TRANSCRIPT!r}, {str(PROMPT_WAV)!r}, "my_zero_shot_spk")
        cosyvoice.save_spkinfo()
        print("saved", cosyvoice.prefix_jobs.pending)
    """)
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert (run.returncode, run.stdout[:6]) == (0, "saved "), run.stderr[-2000:]
    voice = CosyVoice3(DEMO_BUNDLE, speakers_dir=tmp_path)
    voice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "another")
    thread, synth = voice.prefix_jobs._thread, weakref.ref(voice.synth)
    assert thread is not None
    del voice
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and synth() is None


def test_speakers_added_while_others_are_saved_are_all_kept(tmp_path: Path) -> None:
    voice = CosyVoice3(DEMO_BUNDLE, speakers_dir=tmp_path)
    with voice:
        features = voice.prompt_features(str(PROMPT_WAV))
        voice.prompt_features = lambda _: features  # type: ignore[method-assign]  # the adds race the saves
        names = [f"speaker_{i}" for i in range(40)]
        with ThreadPoolExecutor(2) as pool:
            added = pool.submit(lambda: [voice.add_zero_shot_spk(TRANSCRIPT, "x.wav", name, precompute=False)
                                         for name in names])
            while not added.done():
                voice.save_spkinfo()
            assert added.result() == [True] * len(names)
        voice.save_spkinfo()
    assert SpeakerRegistry(tmp_path, frontend_fingerprint(voice.bundle)).names() == sorted(names)


def test_streaming_ignores_speed_as_upstream(cosyvoice: CosyVoice3) -> None:
    with pytest.warns(UserWarning, match=r"speed=1.5 ignored: upstream applies speed offline only"):
        fast = [o["tts_speech"] for o in cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), stream=True,
                                                                           speed=1.5)]
    plain = [o["tts_speech"] for o in cosyvoice.inference_cross_lingual(TEXT, str(PROMPT_WAV), stream=True)]
    assert len(fast) == len(plain)
    for a, b in zip(fast, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_instruct2_with_a_speaker_reads_its_transcript_as_upstream(cosyvoice: CosyVoice3) -> None:
    """Upstream's front end takes a stored speaker's inputs whole: instruct2 reads the speaker's transcript
    where the instruction would stand (the prompt's speech ids left out), whatever `instruct_text` says."""
    cosyvoice.add_zero_shot_spk(TRANSCRIPT, str(PROMPT_WAV), "instructed")
    with pytest.warns(UserWarning, match="instruct_text unused"):
        got = [o["tts_speech"] for o in cosyvoice.inference_instruct2(TEXT, "Speak slowly.", "",
                                                                      zero_shot_spk_id="instructed")]
    transcript = "You are a helpful assistant.<|endofprompt|>" + TRANSCRIPT
    want = [o["tts_speech"] for o in cosyvoice.inference_instruct2(TEXT, transcript, str(PROMPT_WAV))]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_voice_conversion_as_upstream(cosyvoice: CosyVoice3) -> None:
    """`inference_vc`: the source's speech tokens through the flow after the prompt's tokens and mel as
    extracted, uncut (upstream's `frontend_vc`), offline and streamed; the source is only the tokenizer's."""
    samples, rate = sf.read(PROMPT_WAV, dtype="float32")
    source, prompt = (samples[:int(rate * 4.3)], rate), (samples[int(rate * 0.3):int(rate * 3.31)], rate)
    campplus, tokenizer = cosyvoice._prompt_models()
    audio = cosyvoice_runtime.cosyvoice3._audio(prompt, "prompt_wav", read_prompt_audio, check_prompt_audio)
    uncut = extract_prompt(audio, campplus, tokenizer, aligned=False)
    aligned = cosyvoice.prompt_features(prompt)
    lag = cosyvoice.synth.flow.prompt_lag(uncut)
    assert lag == 2 and uncut.speech_tokens.shape[1] == aligned.speech_tokens.shape[1] + 1
    np.testing.assert_array_equal(uncut.mel, aligned.mel)  # 150 frames: 2:1 with 75 tokens already
    np.testing.assert_array_equal(uncut.speech_tokens[:, :-1], aligned.speech_tokens)
    tokens = [int(t) for t in source_speech_tokens(PromptAudio(source[0], rate, "source"), tokenizer)[0]]

    offline = [o["tts_speech"] for o in cosyvoice.inference_vc(source, prompt)]
    assert len(offline) == 1
    np.testing.assert_array_equal(offline[0][0], cosyvoice.synth.token2wav(tokens, uncut)[1])
    assert offline[0].shape == (1, 480 * (2 * len(tokens) + lag))
    streamed = [o["tts_speech"] for o in cosyvoice.inference_vc(source, prompt, stream=True)]
    want = [c.samples for c in cosyvoice.synth.stream_tokens(tokens, uncut)]
    assert len(streamed) == len(want) >= 2
    for got, chunk in zip(streamed, want, strict=True):
        np.testing.assert_array_equal(got[0], chunk)
    assert sum(c.shape[1] for c in streamed) == 480 * (2 * len(tokens) + lag * len(streamed))

    for call, message in [
        (lambda: cosyvoice.inference_vc("", prompt), "source_wav is empty; expected a recording's path$"),
        (lambda: cosyvoice.inference_vc((np.full(16000 * 31, 0.1, np.float32), 16000), prompt),
         "source_wav lasts 31.00 s; the speech tokenizer takes at most 30 s"),
        (lambda: cosyvoice.inference_vc((np.where(np.arange(16000) == 3, np.nan, 0.1), 16000), prompt),
         "source_wav holds 1 sample"),
        (lambda: cosyvoice.inference_vc(source, (np.zeros(24000, np.float32), 24000)),
         "prompt_wav is silent or nearly so"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_upstreams_positional_constructor_arguments() -> None:
    with pytest.warns(UserWarning, match="trt_concurrent=2 ignored"), \
            CosyVoice3(DEMO_BUNDLE, False, False, False, 2) as voice:
        assert voice.sample_rate == 24000


def test_auto_model_is_the_same_object() -> None:
    assert AutoModel is CosyVoice3


def test_upstreams_example_runs_without_torch(tmp_path: Path) -> None:
    """Upstream's `example.py` pattern with its one import line changed, in a process where torch and the
    exporter cannot be imported: every mode, streaming, and a speaker saved by one object and used by
    the next, each giving `cosyvoice-run`'s samples for the same inputs."""
    system = "You are a helpful assistant.<|endofprompt|>"
    script = textwrap.dedent(f"""
        import sys
        sys.modules.update(dict.fromkeys(("torch", "torchaudio", "cosyvoice_export"), None))  # unimportable
        import soundfile as sf
        from cosyvoice_runtime import AutoModel

        out, text, prompt_wav = {str(tmp_path)!r}, {TEXT!r}, {str(PROMPT_WAV)!r}
        prompt_text = {system + TRANSCRIPT!r}
        cosyvoice = AutoModel(model_dir={str(DEMO_BUNDLE)!r})
        runs = {{
            "zero_shot": cosyvoice.inference_zero_shot(text, prompt_text, prompt_wav, stream=False),
            "zero_shot_stream": cosyvoice.inference_zero_shot(text, prompt_text, prompt_wav, stream=True),
            "cross_lingual": cosyvoice.inference_cross_lingual({system!r} + text, prompt_wav, stream=False),
            "instruct2": cosyvoice.inference_instruct2(text, "You are a helpful assistant. Speak slowly."
                                                       "<|endofprompt|>", prompt_wav, stream=False),
        }}
        assert cosyvoice.add_zero_shot_spk(prompt_text, prompt_wav, "my_zero_shot_spk")
        cosyvoice.save_spkinfo()
        again = AutoModel(model_dir={str(DEMO_BUNDLE)!r})
        assert again.list_available_spks() == ["my_zero_shot_spk"], again.list_available_spks()
        runs["speaker"] = again.inference_zero_shot(text, "", "", zero_shot_spk_id="my_zero_shot_spk")
        for name, outputs in runs.items():
            for i, j in enumerate(outputs):
                sf.write(f"{{out}}/{{name}}_{{i}}.wav", j["tts_speech"][0], cosyvoice.sample_rate)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cosyvoice_export")
                     and sys.modules[m] is not None))
    """)
    env = {**os.environ, SPEAKERS_DIR_ENV: str(tmp_path / "speakers")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
    zero_shot = ["--prompt-text", system + TRANSCRIPT]
    expected = {
        "zero_shot": (TEXT, zero_shot), "zero_shot_stream": (TEXT, [*zero_shot, "--stream"]),
        "cross_lingual": (system + TEXT, ["--mode", "cross-lingual"]),
        "instruct2": (TEXT, ["--mode", "instruct2", "--instruct",
                             "You are a helpful assistant. Speak slowly.<|endofprompt|>"]),
        "speaker": (TEXT, zero_shot),
    }
    for name, (text, args) in expected.items():
        files = sorted(tmp_path.glob(f"{name}_[0-9]*.wav"), key=lambda f: int(f.stem.rpartition("_")[2]))
        assert files, name
        got = np.concatenate([sf.read(f, dtype="int16")[0] for f in files])
        want, _ = _cli(tmp_path, *args, text=text)
        np.testing.assert_array_equal(got, want, err_msg=name)


# --- upstream's example, as it is ------------------------------------------------------------------------

UPSTREAM_EXAMPLE = """
import sys
sys.modules.update(dict.fromkeys(("torch", "torchaudio")))  # neither is installed here
{import_line}

cosyvoice = AutoModel(model_dir={model!r})
for i, j in enumerate(cosyvoice.inference_zero_shot(
        '八百标兵奔北坡，北坡炮兵并排跑。',
        'You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。',
        {prompt!r}, stream=False)):
    {save_line}
"""


def test_upstreams_example_runs_with_its_import_and_save_lines_changed(tmp_path: Path) -> None:
    """Upstream's example.py, cosyvoice3_example's zero-shot part, with `from cosyvoice.cli.cosyvoice import
    AutoModel` and `import torchaudio` made one import, and `torchaudio.save(...)` made `save_wav(...)`: it
    runs where torch cannot be imported, and writes what torchaudio would (a 32-bit float WAV)."""
    script = UPSTREAM_EXAMPLE.format(
        import_line="from cosyvoice_runtime import AutoModel, save_wav",
        model=str(DEMO_BUNDLE), prompt=str(DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav"),
        save_line="save_wav('zero_shot_{}.wav'.format(i), j['tts_speech'], cosyvoice.sample_rate)")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    written = sorted(tmp_path.glob("zero_shot_*.wav"))
    assert [p.name for p in written] == ["zero_shot_0.wav"]
    info = sf.info(str(written[0]))
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "FLOAT") and info.frames > 0


def test_upstreams_constructor_keywords_are_taken(recwarn: pytest.WarningsRecorder, tmp_path: Path) -> None:
    with CosyVoice3(DEMO_BUNDLE, load_trt=False, load_vllm=True, fp16=False, trt_concurrent=2) as tts:
        assert tts.sample_rate == 24000
    assert sorted(str(w.message) for w in recwarn.list) == [
        "load_vllm=True ignored: the LLM runs on onnxruntime",
        "trt_concurrent=2 ignored: onnxruntime's sessions serve concurrent calls"]
    tampered = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    wav = tampered / "asset" / "zero_shot_prompt.wav"
    wav.write_bytes(bytes(b ^ 1 for b in wav.read_bytes()))  # same size, other bytes: verify would refuse it
    with pytest.raises(UserError) as fp16:
        CosyVoice3(tampered, fp16=True, provider="cuda")  # refused before its files are hashed
    assert str(fp16.value) == (f"fp16=True: {tampered} is exported in fp32; on 'cuda' give its model "
                               "directory (exported in gpu-fp16 on first use), an export with "
                               "cosyvoice-export all --precision gpu-fp16, or fp16=False to run it as it is")
    with pytest.raises(UserError, match=r"load_trt=True asks for TensorRT; provider='cuda' for something "
                                        "else"):
        CosyVoice3(DEMO_BUNDLE, load_trt=True, provider="cuda")
    if "TensorrtExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ProviderError, match="provider 'tensorrt' needs onnxruntime's "
                                                "TensorrtExecutionProvider"):
            CosyVoice3(DEMO_BUNDLE, load_trt=True)


def test_upstreams_fp16_is_float32_on_a_cpu_and_gpu_fp16_on_cuda(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream takes fp16=True for False without a CUDA device; on cuda, a model bundle is exported in the
    float16 profile whose decode steps onnxruntime's CUDA provider runs (an fp16 `llm_decode`)."""
    with pytest.warns(UserWarning, match="^fp16=True ignored on the cpu provider: upstream runs in float32 "
                                         "without a CUDA device$"):
        with CosyVoice3(DEMO_BUNDLE, fp16=True) as tts:
            assert tts.bundle.precision == "fp32"
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DEMO_BUNDLE / MODEL_YAML, model / MODEL_YAML)  # all a model bundle's planned export reads
    exported: list[str] = []

    def export(model_dir: Path, out: Path, what: str, progress: bool, precision: str) -> None:
        exported.append(precision)
        raise UserError("the export is not run here")

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_source, "_export", export)
    monkeypatch.setattr(runners, "check_provider_installed", lambda provider: None)  # CUDA is not needed here
    with pytest.raises(UserError, match="the export is not run here"):
        CosyVoice3(model, fp16=True, provider="cuda")
    assert exported == ["gpu-fp16"]


def test_save_wav_takes_what_torchaudio_save_takes(tmp_path: Path) -> None:
    speech = np.linspace(-0.5, 0.5, 480, dtype=np.float32)
    save_wav(tmp_path / "a.wav", speech[None], 24000)  # (channels, frames), as tts_speech is
    save_wav(str(tmp_path / "b.wav"), speech, 24000)
    for name in ("a.wav", "b.wav"):
        samples, rate = sf.read(tmp_path / name, dtype="float32")
        assert rate == 24000 and np.array_equal(samples, speech)
    with pytest.raises(ValueError, match=r"tts_speech has shape \(1, 1, 480\)"):
        save_wav(tmp_path / "c.wav", speech[None, None], 24000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "b.wav"]
