"""The runtime's front end: text and prompt audio -> model inputs, in numpy + onnxruntime.

- `TextTokenizer`: Qwen2 BPE + CosyVoice3 special tokens from a `CosyVoice-BlankEN/` folder.
- `TextFrontend`: upstream's text normalisation (wetext) and sentence splitting; prompt formats.
- `read_prompt_audio`, `extract_prompt`: prompt recording -> checked audio -> speech tokens, prompt mel
  and x-vector (`PromptFeatures`); `read_source_audio`, `source_speech_tokens`: a voice conversion's
  source recording -> its speech tokens.
- `load_wav`, `whisper_log_mel`, `kaldi_fbank`, `prompt_mel`: the audio steps on their own.
"""

from __future__ import annotations

from ..errors import FrontendError
from .audio import (
    MAX_PROMPT_SECONDS,
    MIN_PROMPT_SECONDS,
    MIN_SAMPLE_RATE,
    SILENCE_DBFS,
    SPEECH_SAMPLE_RATE,
    PromptAudio,
    check_prompt_audio,
    check_source_audio,
    load_wav,
    read_audio,
    read_prompt_audio,
    read_source_audio,
    resample,
)
from .features import PromptMelConfig, kaldi_fbank, prompt_mel, slaney_mel_filterbank, whisper_log_mel
from .prompt import (
    PromptFeatures,
    align_prompt,
    extract_prompt,
    open_session,
    source_speech_tokens,
    speaker_embedding,
    speech_tokens,
)
from .special_tokens import COSYVOICE3_SPECIAL_TOKENS, ENDOFPROMPT, ENDOFTEXT
from .text import (
    SYSTEM_PROMPT,
    TextFrontend,
    contains_chinese,
    cross_lingual_text,
    instruct_prompt,
    is_only_punctuation,
    split_paragraph,
    zero_shot_prompt,
)
from .tokenizer import TextTokenizer

__all__ = [
    "COSYVOICE3_SPECIAL_TOKENS",
    "ENDOFPROMPT",
    "ENDOFTEXT",
    "MAX_PROMPT_SECONDS",
    "MIN_PROMPT_SECONDS",
    "MIN_SAMPLE_RATE",
    "SILENCE_DBFS",
    "SPEECH_SAMPLE_RATE",
    "SYSTEM_PROMPT",
    "FrontendError",
    "PromptFeatures",
    "PromptAudio",
    "PromptMelConfig",
    "TextFrontend",
    "TextTokenizer",
    "align_prompt",
    "check_prompt_audio",
    "check_source_audio",
    "contains_chinese",
    "cross_lingual_text",
    "extract_prompt",
    "instruct_prompt",
    "is_only_punctuation",
    "kaldi_fbank",
    "load_wav",
    "open_session",
    "prompt_mel",
    "read_audio",
    "read_prompt_audio",
    "read_source_audio",
    "resample",
    "slaney_mel_filterbank",
    "source_speech_tokens",
    "speaker_embedding",
    "speech_tokens",
    "split_paragraph",
    "whisper_log_mel",
    "zero_shot_prompt",
]
