"""The torch reference synthesis: upstream's offline CosyVoice3 algorithm over our networks.

This is the oracle that exports, the runtime and golden files are judged against. One text segment
per call (no normalisation or splitting): `tts_text` is synthesised as given. Every random draw is
explicit: the LLM sampler takes a `torch.Generator`, and the flow / vocoder read the fixed tables of
`noise.noise_tables`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice_runtime.frontend import ENDOFPROMPT as END_OF_PROMPT
from cosyvoice_runtime.frontend import cross_lingual_text, instruct_prompt, open_session, zero_shot_prompt
from cosyvoice_runtime.synthesis import Mode

from ..bundle.layout import CAMPPLUS, SPEECH_TOKENIZER
from ..bundle.model_dir import ModelBundle
from ..bundle.tokenizer_files import load_cosyvoice3_tokenizer
from ..nets.flow import CausalMaskedDiffWithDiT
from ..nets.hift import CausalHiFTGenerator
from ..nets.llm import CosyVoice3LM
from ..noise import noise_tables
from .frontend import TorchPromptFeatures, extract_prompt
from .llm_decode import TorchSampler, generate_speech_tokens


@dataclass(frozen=True)
class LLMInputs:
    """What the LLM sees for one request: text ids and the optional prompt speech tokens."""

    text_ids: list[int]
    prompt_text_ids: list[int]
    prompt_speech_tokens: list[int]


@dataclass(frozen=True)
class TorchSynthesis:
    """One synthesised segment (the runtime's `Synthesis` holds the mel in numpy)."""

    speech_tokens: list[int]
    mel: torch.Tensor
    """(1, 80, T) float32 generated mel frames (after `speed`)."""
    audio: np.ndarray
    """float32 samples in [-audio_limit, audio_limit] at `sample_rate`."""
    sample_rate: int


class ReferencePipeline:
    """Networks, tokenizer, prompt models and noise tables of one bundle, loaded once."""

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.config = bundle.config
        llm, flow, hift = (bundle.load_network(n) for n in ("llm", "flow", "hift"))
        assert isinstance(llm, CosyVoice3LM)
        assert isinstance(flow, CausalMaskedDiffWithDiT)
        assert isinstance(hift, CausalHiFTGenerator)
        self.llm, self.flow, self.hift = llm, flow, hift
        self.tokenizer = load_cosyvoice3_tokenizer(bundle.qwen_dir)
        self.eop_id = self.tokenizer.token_id(END_OF_PROMPT)
        self.noise = noise_tables(self.config)
        self._campplus = open_session(bundle.root / CAMPPLUS)
        self._speech_tokenizer = open_session(bundle.root / SPEECH_TOKENIZER)

    def prompt_features(self, wav_path: Path | str) -> TorchPromptFeatures:
        """Speech tokens, mel and x-vector of a prompt recording, aligned 2:1 as upstream does."""
        return extract_prompt(wav_path, self._campplus, self._speech_tokenizer, self.config.feat,
                              self.config.token_mel_ratio)

    def llm_inputs(self, mode: Mode, tts_text: str, prompt: TorchPromptFeatures, *, prompt_text: str = "",
                   instruct_text: str = "") -> LLMInputs:
        """Upstream's frontend text handling per mode (`frontend_zero_shot` and its variants).

        Texts that lack `<|endofprompt|>` get CosyVoice3's system prefix, as upstream's examples and
        server add it; texts that carry it are used verbatim.
        """
        encode = self.tokenizer.encode
        if mode is Mode.ZERO_SHOT:
            if not prompt_text:
                raise ValueError("zero-shot needs the prompt recording's transcript (prompt_text)")
            if END_OF_PROMPT not in prompt_text:
                prompt_text = zero_shot_prompt(prompt_text)
            return LLMInputs(encode(tts_text), encode(prompt_text), prompt.speech_tokens[0].tolist())
        if mode is Mode.CROSS_LINGUAL:
            if END_OF_PROMPT not in tts_text:
                tts_text = cross_lingual_text(tts_text)
            return LLMInputs(encode(tts_text), [], [])
        if not instruct_text:
            raise ValueError("instruct2 needs an instruction (instruct_text)")
        if END_OF_PROMPT not in instruct_text:
            instruct_text = instruct_prompt(instruct_text)
        # instruct2 keeps the instruction as prompt text but drops the LLM's prompt speech.
        return LLMInputs(encode(tts_text), encode(instruct_text), [])

    @torch.no_grad()
    def token2wav(self, speech_tokens: list[int], prompt: TorchPromptFeatures, *, speed: float = 1.0
                  ) -> tuple[torch.Tensor, np.ndarray]:
        """Offline `token2wav`: full-attention flow, `speed` by linear mel interpolation, final HiFT."""
        if not speech_tokens:
            raise ValueError("no speech tokens to vocode")
        token = torch.tensor([speech_tokens], dtype=torch.long)
        mel = self.flow.inference(token, prompt.speech_tokens, prompt.mel, prompt.embedding,
                                  self.noise.flow_noise, streaming=False, finalize=True)  # (1, 80, T)
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        wav = self.hift.inference(mel, self.noise.sine_waves, finalize=True)  # (1, 480 T)
        return mel, wav[0].numpy()

    @torch.no_grad()
    def token2wav_stream(self, speech_tokens: list[int], prompt: TorchPromptFeatures, hops: Sequence[int],
                         lookahead: int) -> tuple[list[tuple[tuple[int, int], np.ndarray]], np.ndarray]:
        """Upstream's CosyVoice3 streaming `token2wav` over a finished token list, chunk by chunk.

        Chunk k covers `hops[k]` tokens: the block-causal flow over tokens[:offset + hop + lookahead],
        keeping the frames after token_mel_ratio·offset, then HiFT re-run over the whole accumulated
        mel. A final chunk takes the remaining tokens with full attention and the finalizing HiFT.
        Returns each chunk's token range and its new samples, and the accumulated mel (1, 80, frames).
        """
        ratio = self.config.token_mel_ratio
        acc = torch.zeros(1, self.config.feat.num_mels, 0)  # (1, 80, frames so far)
        out: list[tuple[tuple[int, int], np.ndarray]] = []
        offset = emitted = 0
        for hop in [*hops, None]:
            final = hop is None
            part = speech_tokens if hop is None else speech_tokens[:offset + hop + lookahead]
            mel = self.flow.inference(torch.tensor([part]), prompt.speech_tokens, prompt.mel,
                                      prompt.embedding, self.noise.flow_noise, streaming=not final,
                                      finalize=final)  # (1, 80, T)
            acc = torch.cat([acc, mel[:, :, ratio * offset:]], dim=2)
            wav = self.hift.inference(acc, self.noise.sine_waves, finalize=final)[0].numpy()
            end = len(speech_tokens) if hop is None else offset + hop
            out.append(((offset, end), wav[emitted:]))
            offset, emitted = end, len(wav)
        return out, acc.numpy()

    def synthesize(self, mode: Mode, tts_text: str, prompt: TorchPromptFeatures, sampler: TorchSampler, *,
                   prompt_text: str = "", instruct_text: str = "", speed: float = 1.0,
                   max_tokens: int | None = None) -> TorchSynthesis:
        """Text (one segment) to speech, as upstream's non-streaming `inference_*` for `mode`."""
        inputs = self.llm_inputs(mode, tts_text, prompt, prompt_text=prompt_text, instruct_text=instruct_text)
        tokens = generate_speech_tokens(self.llm, inputs.text_ids, inputs.prompt_text_ids,
                                        inputs.prompt_speech_tokens, self.eop_id, sampler,
                                        max_tokens=max_tokens)
        mel, audio = self.token2wav(tokens, prompt, speed=speed)
        return TorchSynthesis(tokens, mel, audio, self.config.sample_rate)
