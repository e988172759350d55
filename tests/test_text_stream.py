"""Text that arrives while it is spoken (`cosyvoice_runtime.text_stream`, upstream's `inference_bistream`):
the runtime's speech ids against the torch reference's, greedy and seeded RAS, with and without prompt
speech, on `llm` and on `llm_decode`; the text read only as decoding needs it; upstream's refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.nets.llm import CosyVoice3LM
from cosyvoice_export.reference.llm_decode import (
    TorchGreedySampler,
    TorchRasSampler,
    generate_speech_tokens_bistream,
)
from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.errors import SynthesisError, UserError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.sampling import GreedySampler, RasConfig, RasSampler
from cosyvoice_runtime.synthesis import Mode, Synthesizer
from cosyvoice_runtime.text_stream import MIX_RATIO, TextStreamDecoding

TEXT_IDS = list(range(300, 337))
"""37 text ids: 7 groups of 5 and 2 left for the final call."""


@pytest.fixture(scope="module")
def reference_lm(tiny_bundle: Path) -> CosyVoice3LM:
    lm = ModelBundle.open(tiny_bundle).load_network("llm")
    assert isinstance(lm, CosyVoice3LM)
    return lm


def _prompt(bundle: RuntimeBundle, speech: int) -> tuple[list[int], list[int]]:
    """A prompt text with `<|endofprompt|>` and 4 transcript ids after it, and `speech` prompt speech ids."""
    return [7, 8, 9, bundle.endofprompt_id, 11, 12, 13, 14], list(range(20, 20 + speech))


@pytest.mark.parametrize("speech", [40, 0, 30])  # zero-shot (first fill after 5), instruct2 (15), 30 (15)
@pytest.mark.parametrize("graph", ["llm", "llm_decode"])
def test_greedy_ids_are_the_references(runtime_bundle: Path, fp32_decode_bundle: Path,
                                       reference_lm: CosyVoice3LM, speech: int, graph: str) -> None:
    path = runtime_bundle if graph == "llm" else fp32_decode_bundle
    bundle = RuntimeBundle.open(path)
    prompt_text, prompt_speech = _prompt(bundle, speech)
    want = generate_speech_tokens_bistream(reference_lm, TEXT_IDS, prompt_text, prompt_speech,
                                           bundle.endofprompt_id, TorchGreedySampler(), max_tokens=260)
    with Synthesizer(bundle, threads=1) as synth:
        assert synth.lm.spec.name == graph
        decoding = TextStreamDecoding(synth.lm, iter(TEXT_IDS), prompt_text, prompt_speech, GreedySampler(),
                                      max_tokens=260)
        got = decoding.run()
    assert got == want and len(got) > 100
    fills = [i for i, t in enumerate(decoding.history) if t == decoding.fill]
    first = (speech // MIX_RATIO[1] + 1) * MIX_RATIO[1] - speech
    assert fills[:2] == [first, first + 16]  # forced where upstream forces them


def test_seeded_ras_ids_are_the_references(runtime_bundle: Path, reference_lm: CosyVoice3LM) -> None:
    bundle = RuntimeBundle.open(runtime_bundle)
    prompt_text, prompt_speech = _prompt(bundle, 40)
    cfg = RasConfig()
    torch_ras = TorchRasSampler(cfg, np.random.Generator(np.random.PCG64(5)))
    want = generate_speech_tokens_bistream(reference_lm, TEXT_IDS, prompt_text, prompt_speech,
                                           bundle.endofprompt_id, torch_ras, max_tokens=200)
    with Synthesizer(bundle, threads=1) as synth:
        got = TextStreamDecoding(synth.lm, iter(TEXT_IDS), prompt_text, prompt_speech,
                                 RasSampler.seeded(5, cfg), max_tokens=200).run()
    assert got == want and len(got) > 50


def test_the_text_is_read_as_decoding_needs_it(runtime_bundle: Path) -> None:
    """The first speech id comes after the first groups of text, long before the text's end: a generator
    that waits for an LLM's next words holds decoding there, not at the start."""
    bundle = RuntimeBundle.open(runtime_bundle)
    prompt_text, prompt_speech = _prompt(bundle, 0)
    read: list[int] = []

    def text() -> Iterator[int]:
        for i in TEXT_IDS:
            read.append(i)
            yield i

    with Synthesizer(bundle, threads=1) as synth:
        decoding = TextStreamDecoding(synth.lm, text(), prompt_text, prompt_speech, GreedySampler(),
                                      max_tokens=260)
        next(decoding)
        # no prompt speech: upstream decodes from sos and the prompt text to <|endofprompt|> at the first id
        assert len(read) == 1
        for _ in range(20):
            next(decoding)
        assert len(read) < len(TEXT_IDS)
        decoding.close()
        assert list(decoding) == []


def test_a_decoding_ends_past_what_the_flow_holds(runtime_bundle: Path) -> None:
    """With `max_ids` (`Flow.max_tokens`) the decoding ends at the first id past it, as the whole text's
    does: the same ids as without it, up to there. Through the object, a prompt that leaves the flow room
    for 4 ids fails at the flow (as upstream's) after 5 decoded, offline and streamed."""
    bundle = RuntimeBundle.open(runtime_bundle)
    prompt_text, prompt_speech = _prompt(bundle, 40)
    with Synthesizer(bundle, threads=1) as synth:
        full = TextStreamDecoding(synth.lm, iter(TEXT_IDS), prompt_text, prompt_speech, GreedySampler(),
                                  max_tokens=260).run()
        bounded = TextStreamDecoding(synth.lm, iter(TEXT_IDS), prompt_text, prompt_speech, GreedySampler(),
                                     max_tokens=260, max_ids=30)
        assert bounded.run() == full[:31] and len(full) > 31 and bounded.stop_id is None
    with CosyVoice3(bundle, threads=1, sampling="greedy") as voice:
        wav, text = bundle.default_prompt() or pytest.fail("the bundle has no prompt")
        prompt = voice.prompt_features(wav)
        ratio, frames = voice.synth.dims.token_mel_ratio, voice.synth.flow.noise.shape[2]
        tokens = frames // ratio - 4
        long_prompt = PromptFeatures(np.resize(prompt.speech_tokens, (1, tokens)),
                                     np.resize(prompt.mel, (1, ratio * tokens, prompt.mel.shape[2])),
                                     prompt.embedding)
        assert voice.synth.flow.max_tokens(long_prompt) == 4
        for stream in (False, True):
            pieces = iter(["Hello there, ", "this is a test ", "of the text stream."])
            speech = voice.speak_text_stream(pieces, long_prompt, Mode.ZERO_SHOT, prompt_text=text,
                                             stream=stream)
            with pytest.raises(SynthesisError, match="exceed the flow noise table"):
                list(speech)
            assert len(speech.speech_tokens) == 5, stream


def test_upstreams_refusals(runtime_bundle: Path) -> None:
    bundle = RuntimeBundle.open(runtime_bundle)
    with Synthesizer(bundle, threads=1) as synth:
        with pytest.raises(ValueError, match="is not in the prompt text"):
            TextStreamDecoding(synth.lm, iter(TEXT_IDS), [7, 8], [], GreedySampler())
        prompt_text, prompt_speech = _prompt(bundle, 0)
        eos = bundle.eos

        def eos_at_once(logp: np.ndarray, history: object) -> int:
            return eos

        with pytest.raises(SynthesisError, match=f"sampled stop id {eos} while the text streams in"):
            TextStreamDecoding(synth.lm, iter(TEXT_IDS), prompt_text, prompt_speech, eos_at_once).run()


def test_upstreams_methods_take_text_in_pieces(runtime_bundle: Path, prompt_wav: Path, prompt_text: str
                                               ) -> None:
    """A generator as `tts_text`, as upstream takes one: streamed chunks or one offline chunk, the audio of
    `speak_text_stream`; cross-lingual and a piece that is not text refused in one line."""
    pieces = ["Hello ", "there, ", "this text ", "comes in ", "while it ", "is spoken."]
    with CosyVoice3(runtime_bundle, threads=1, sampling="greedy") as voice:
        chunks = [c["tts_speech"][0] for c in voice.inference_zero_shot((p for p in pieces), prompt_text,
                                                                        prompt_wav, stream=True)]
        speech = voice.speak_text_stream(iter(pieces), voice.prompt_features(prompt_wav), Mode.ZERO_SHOT,
                                         prompt_text=prompt_text)
        want = [c.samples for c in speech]
        assert len(chunks) == len(want) > 1
        assert all(np.array_equal(a, b) for a, b in zip(chunks, want, strict=True))
        last = voice.tokenizer.encode(pieces[-1])  # each piece tokenised on its own, as upstream does
        assert speech.text_ids[-len(last):] == last
        offline = list(voice.inference_instruct2((p for p in pieces), "Please speak happily.", prompt_wav))
        assert len(offline) == 1 and offline[0]["tts_speech"].shape[1] > 0
        with pytest.raises(UserError, match="cross-lingual cannot take its text in pieces"):
            voice.inference_cross_lingual((p for p in pieces), prompt_wav)
        with pytest.raises(UserError, match="a piece of streamed text is int, not str"):
            list(voice.inference_zero_shot(iter([1, 2]), prompt_text, prompt_wav))  # type: ignore[arg-type]
