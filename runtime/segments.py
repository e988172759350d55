"""Text to what the LLM is fed, segment by segment: upstream's normalisation and splitting, then each
piece formatted for the inference mode and tokenised."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError
from .frontend import (
    ENDOFPROMPT,
    TextFrontend,
    TextTokenizer,
    cross_lingual_text,
    instruct_prompt,
    zero_shot_prompt,
)
from .frontend.tokenizer import check_unicode
from .synthesis import Mode

MAX_TEXT_CHARS = 2000
"""The longest text `cosyvoice-run` and the server take (characters; `cosyvoice-serve --max-text` can
change the server's), so that one request cannot hold the machine or a server's slot for hours.
`CosyVoice3`'s methods, as upstream's, take any length: the limit is the commands' policy."""


@dataclass(frozen=True)
class Segment:
    """One piece of the text, tokenised for the LLM."""

    text: str
    text_ids: list[int]
    prompt_text_ids: list[int]


def segments(text: str, mode: Mode, tokenizer: TextTokenizer, frontend: TextFrontend | None, *,
             prompt_text: str = "", instruct: str = "") -> list[Segment]:
    """Normalise and split `text` as upstream does (`frontend` None: one piece, as given, upstream's
    `text_frontend=False`), and format each piece for `mode` (`prompt_ids`; cross-lingual: each piece gets
    the system prompt and `<|endofprompt|>` itself, unless it holds `<|endofprompt|>` already)."""
    prompt = prompt_ids(mode, tokenizer, prompt_text=prompt_text, instruct=instruct)
    out = []
    for piece in frontend.split(text) if frontend is not None else [text]:
        if mode is Mode.CROSS_LINGUAL and ENDOFPROMPT not in piece:
            piece = cross_lingual_text(piece)
        out.append(Segment(piece, tokenizer.encode(piece), prompt))
    return out


def checked_segments(text: str, mode: Mode, tokenizer: TextTokenizer, frontend: TextFrontend | None, *,
                     prompt_text: str = "", instruct: str = "", text_name: str = "tts_text") -> list[Segment]:
    """`segments`, with a `UserError` (naming the text `text_name`) where `text` is empty, where a text holds
    no Unicode (before the normaliser, whose grammars would fail on it) or where nothing is left to speak."""
    if not text.strip():
        raise UserError(f"{text_name} is empty")
    for value, name in ((text, text_name), (prompt_text, "prompt_text"), (instruct, "instruct_text")):
        check_unicode(value, name)
    pieces = segments(text, mode, tokenizer, frontend, prompt_text=prompt_text, instruct=instruct)
    if not pieces:
        raise UserError(f"{text_name} has nothing to speak after normalisation")
    return pieces


def prompt_ids(mode: Mode, tokenizer: TextTokenizer, *, prompt_text: str = "", instruct: str = ""
               ) -> list[int]:
    """The prompt text's ids for `mode`. Zero-shot: system prompt + `<|endofprompt|>` + transcript;
    instruct2: system prompt + instruction + `<|endofprompt|>`; cross-lingual: none. A transcript or
    instruction that already holds `<|endofprompt|>` is used as is."""
    if mode is Mode.ZERO_SHOT:
        if not prompt_text.strip():
            raise UserError("zero-shot needs prompt_text (the transcript of prompt_wav)")
        return tokenizer.encode(prompt_text if ENDOFPROMPT in prompt_text else zero_shot_prompt(prompt_text))
    if mode is Mode.INSTRUCT2:
        if not instruct.strip():
            raise UserError("instruct2 needs instruct_text")
        return tokenizer.encode(instruct if ENDOFPROMPT in instruct else instruct_prompt(instruct))
    return []
