"""Text normalisation, sentence splitting and prompt formats as upstream's front end has them for CosyVoice3.

`TextFrontend.split(text)` is upstream's `text_normalize(text, split=True)` with the wetext backend:

- a text holding both `<|` and `|>` (every CosyVoice3 prompt, and any text carrying `<|endofprompt|>`) is
  neither normalised nor split;
- Chinese (any character in U+4E00..U+9FFF): wetext's zh normaliser, then upstream's clean-ups
  (newlines, spaces between non-ASCII characters, ² ³, `.` -> `。`, ` - `, brackets, trailing commas)
  and `split_paragraph` counting characters;
- anything else: wetext's en normaliser, digits spelled out with inflect, and `split_paragraph` counting
  tokenizer tokens;
- segments made only of punctuation or symbols are dropped.

wetext: upstream pins wetext 0.0.4, whose FSTs it fetches at start-up from a model hub; at the model's
release that snapshot was the one of 2025-11-28, which the wetext 0.1.2 wheel ships. We take those FST
files (checked by sha256 once per process) and wetext's token parser from wetext 0.1.2, and compose
them as wetext 0.0.4's `Normalizer.normalize` does: only text with a digit is touched, the grammar is
chosen by `contains_chinese`, tagger -> token reorder -> verbaliser, and the output is not stripped.
wetext 0.1.x's own `normalize` differs (it strips, and picks the zh grammar for digit-only text).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import regex

from ..errors import FrontendError
from .special_tokens import ENDOFPROMPT

SYSTEM_PROMPT = "You are a helpful assistant."

WETEXT_VERSION = "0.1.2"
"""The wetext release whose wheel ships the FSTs upstream's wetext 0.0.4 ran at the model's release."""

WETEXT_FST_SHA256 = {
    "en": ("bb804f88030153999f154f01950c18dbfd64de2c4cfc5035e21371d4eb4ead8a",
           "33ad65460a3e8f7fe313994ff0204a218c0fcb5dec9c09b24aeeaa30ef21d67b"),
    "zh": ("8261de8e6dbb17f2cc8e51067e237c363b3ffc1341fef4080c2c73b850d46d7f",
           "9fcadad76cafddb2e96b92d892d18249f0ba5fbe60e4d4fc51f466cb6bc7ade9"),
}
"""sha256 of each grammar's `{lang}/tn/tagger.fst` and `verbalizer.fst` in wetext's `fsts/` folder (the zh
verbaliser keeps erhua, as upstream's `remove_erhua=False`)."""

# split_paragraph settings upstream passes for every language.
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20

_ZH_TERMINATORS = frozenset("。？！；：、.?!;")
_EN_TERMINATORS = frozenset(".?!;:")
_CLOSING_QUOTES = frozenset('"”')
_DIGIT = re.compile(r"\d")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_PUNCTUATION_OR_SYMBOLS = regex.compile(r"[\p{P}\p{S}]*")


# --- prompt formats ---------------------------------------------------------------------------------


def zero_shot_prompt(transcript: str) -> str:
    """`prompt_text` for zero-shot cloning: system prompt, `<|endofprompt|>`, the prompt's transcript."""
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}"


def cross_lingual_text(text: str) -> str:
    """`tts_text` for cross-lingual / fine-grained control, which has no prompt text and so carries the
    `<|endofprompt|>` itself."""
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{text}"


def instruct_prompt(instruction: str) -> str:
    """`prompt_text` for instruct2: system prompt, one space, the instruction, `<|endofprompt|>`."""
    return f"{SYSTEM_PROMPT} {instruction}{ENDOFPROMPT}"


# --- upstream's text rules --------------------------------------------------------------------------


def contains_chinese(text: str) -> bool:
    """Whether `text` has a CJK unified ideograph (U+4E00..U+9FFF): upstream's only language test."""
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def is_only_punctuation(text: str) -> bool:
    """Whether every character of `text` is Unicode punctuation (P*) or a symbol (S*); true for ''. By the
    `regex` module's Unicode tables, as upstream tests it: Python 3.11's are older and leave the emoji of
    Unicode 15 and later unassigned."""
    return _PUNCTUATION_OR_SYMBOLS.fullmatch(text) is not None


def spell_out_numbers(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace each run of digit characters (`str.isdigit`, so also ² and other digit forms) by its words."""
    return "".join(number_to_words(run) if run[0].isdigit() else run for run in _digit_runs(text))


def _digit_runs(text: str) -> list[str]:
    """`text` cut into maximal runs of digit and non-digit characters."""
    runs: list[str] = []
    for ch in text:
        if runs and runs[-1][0].isdigit() == ch.isdigit():
            runs[-1] += ch
        else:
            runs.append(ch)
    return runs


def remove_blanks(text: str) -> str:
    """Drop each space unless both neighbours are ASCII and not spaces (keeps "a b", drops "中 文")."""
    kept = []
    for i, ch in enumerate(text):
        if ch == " ":
            prev, nxt = text[i - 1] if i > 0 else "", text[i + 1] if i + 1 < len(text) else ""
            if not (_ascii_word_char(prev) and _ascii_word_char(nxt)):
                continue
        kept.append(ch)
    return "".join(kept)


def _ascii_word_char(ch: str) -> bool:
    return ch != "" and ch.isascii() and ch != " "


def _clean_chinese(text: str) -> str:
    """Upstream's zh clean-ups after normalisation, in its order."""
    text = remove_blanks(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for bracket in ("（", "）", "【", "】", "`"):
        text = text.replace(bracket, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def split_paragraph(text: str, lang: Literal["zh", "en"], length: Callable[[str], int]) -> list[str]:
    """Upstream's `split_paragraph` with its settings (max 80, min 60, merge below 20, no comma split).

    A terminator is appended if the text does not end in one; sentences end after a terminator
    (zh: 。？！；：、.?!; — en: .?!;:), taking a closing quote that follows it. Sentences are joined
    until adding the next would pass 80 while the current piece is already over 60 (`length` units:
    characters for zh, tokens for en); a last piece shorter than 20 joins the previous one.
    Returns [] for '' (upstream would fail on it).
    """
    if not text:
        return []
    terminators = _ZH_TERMINATORS if lang == "zh" else _EN_TERMINATORS
    if text[-1] not in terminators:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in terminators:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and sentences:
            # Upstream moves the quote onto the last sentence, even one ended before this terminator
            # (whose own terminator is then lost); with no sentence yet it fails, we keep the quote.
            sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    pieces: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > TOKEN_MAX_N and length(current) > TOKEN_MIN_N:
            pieces.append(current)
            current = ""
        current += sentence
    if current:
        if length(current) < MERGE_LEN and pieces:
            pieces[-1] += current
        else:
            pieces.append(current)
    return pieces


# --- wetext -----------------------------------------------------------------------------------------


@functools.cache
def _wetext_fsts() -> dict[str, tuple[str, str]]:
    """Each language's (tagger, verbaliser) FST paths in the installed wetext, once their sha256s are
    checked (once per process)."""
    try:
        import wetext
    except ImportError as exc:
        raise FrontendError(f"text normalisation needs wetext=={WETEXT_VERSION} (pip install "
                            f"wetext=={WETEXT_VERSION}), which cannot be imported: {exc}") from None
    folder = Path(wetext.__file__).parent / "fsts"
    found = {}
    for lang, expected in WETEXT_FST_SHA256.items():
        paths = (folder / lang / "tn" / "tagger.fst", folder / lang / "tn" / "verbalizer.fst")
        for path, sha256 in zip(paths, expected, strict=True):
            try:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                raise FrontendError(f"wetext FST {path} is missing; install wetext=={WETEXT_VERSION}"
                                    ) from None
            if digest != sha256:
                version = importlib.metadata.version("wetext")
                raise FrontendError(f"wetext {version}: FST {path} is not the pinned one (sha256 {digest}); "
                                    f"install wetext=={WETEXT_VERSION}")
        found[lang] = (str(paths[0]), str(paths[1]))
    return found


class _WetextGrammar:
    """One language's text-normalisation grammar, run as wetext 0.0.4's `Normalizer` runs it."""

    def __init__(self, lang: Literal["zh", "en"]) -> None:
        import kaldifst
        from wetext.token_parser import TokenParser

        tagger, verbalizer = _wetext_fsts()[lang]
        self._lang = lang
        self._tagger = kaldifst.TextNormalizer(tagger)
        self._verbalizer = kaldifst.TextNormalizer(verbalizer)
        self._token_parser = TokenParser

    def __call__(self, text: str) -> str:
        """wetext 0.0.4's `normalize` for text that has a digit: no strip before or after."""
        tagged = self._tagger(text)
        return str(self._verbalizer(self._token_parser(self._lang, "tn").reorder(tagged)))


@functools.cache
def _wetext_grammar(lang: Literal["zh", "en"]) -> _WetextGrammar:
    """`lang`'s grammar, loaded on first use: most texts (those without digits) never need it."""
    return _WetextGrammar(lang)


def load_grammars() -> None:
    """Load both grammars now, not on their first texts (`GrammarProcess`'s child)."""
    for lang in ("zh", "en"):
        _wetext_grammar(lang)


def wetext_normalize(text: str) -> str:
    """What upstream's wetext normaliser (`Normalizer(remove_erhua=False).normalize`, wetext 0.0.4 with
    the pinned FSTs) returns for `text`: `text` itself unless it has a digit, else the zh grammar's output
    if it holds a CJK ideograph, the en grammar's otherwise, unstripped. Raises what the grammar raises
    when it finds no parse."""
    if not needs_grammar(text):
        return text
    return _wetext_grammar("zh" if contains_chinese(text) else "en")(text)


def needs_grammar(text: str) -> bool:
    """Whether wetext 0.0.4 runs a grammar over `text`: only over text with a digit."""
    return _DIGIT.search(text) is not None


def checked_wetext_normalize(text: str) -> str:
    """`wetext_normalize`, where a grammar finds no parse a `FrontendError` in one line."""
    try:
        return wetext_normalize(text)
    except FrontendError:
        raise
    except Exception as exc:  # wetext asserts when its grammar finds no parse
        lang = "zh" if contains_chinese(text) else "en"
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise FrontendError(f"wetext ({lang}) cannot normalise {shown!r} ({type(exc).__name__}); "
                            f"rephrase it or turn text normalisation off") from None


@functools.cache
def _inflect_engine() -> Any:
    import inflect

    return inflect.engine()  # seconds to build: only texts with digits pay for it


_INFLECT_LOCK = threading.Lock()
"""inflect's engine keeps a call's state on itself (`mill_count`): one call at a time."""


def _number_to_words(digits: str) -> str:
    import inflect

    try:
        with _INFLECT_LOCK:
            return str(_inflect_engine().number_to_words(digits))
    except inflect.NumOutOfRangeError:  # upstream's text_normalize fails on it too
        raise FrontendError(f"a number of {len(digits)} digits: more than inflect can spell out") from None


class TokenEncoder(Protocol):
    """Anything with the tokenizer's `encode` (English splitting counts tokens)."""

    def encode(self, text: str) -> Sequence[int]: ...


class TextFrontend:
    """Upstream's `text_normalize` for CosyVoice3: wetext normalisation and sentence splitting."""

    def __init__(self, tokenizer: TokenEncoder, use_wetext: bool = True,
                 grammar: Callable[[str], str] = checked_wetext_normalize) -> None:
        """`tokenizer` counts tokens for English splitting.

        `use_wetext=False` skips the wetext step only, like upstream without a normaliser installed; the
        clean-ups, number spelling and splitting still run. With `use_wetext=True`, a missing wetext or
        an FST that is not the pinned one raises `FrontendError` here; each grammar loads on first use.
        `grammar` runs the wetext step: `checked_wetext_normalize`, or the same in a process of its own
        (`GrammarProcess`).
        """
        self._tokenizer = tokenizer
        self._use_wetext = use_wetext
        self._grammar = grammar
        if use_wetext:
            _wetext_fsts()

    def normalize(self, text: str) -> str:
        """The normalised text as one string (upstream's `split=False`), for prompt texts."""
        if _is_markup(text) or text == "":
            return text
        return self._normalize(text)[1]

    def split(self, text: str) -> list[str]:
        """Normalise `text` and cut it into the segments upstream synthesises one by one.

        Text with `<|`...`|>` markup, and '', come back as the single segment [text], as upstream
        returns them; whitespace-only text gives [] (upstream fails on it).
        """
        if _is_markup(text) or text == "":
            return [text]
        lang, normalized = self._normalize(text)
        if lang == "zh":
            pieces = split_paragraph(normalized, "zh", len)
        else:
            pieces = split_paragraph(normalized, "en", lambda s: len(self._tokenizer.encode(s)))
        return [p for p in pieces if not is_only_punctuation(p)]

    def _normalize(self, text: str) -> tuple[Literal["zh", "en"], str]:
        text = text.strip()
        if contains_chinese(text):
            return "zh", _clean_chinese(self._wetext(text))
        return "en", spell_out_numbers(self._wetext(text), _number_to_words)

    def _wetext(self, text: str) -> str:
        return self._grammar(text) if self._use_wetext else text


def _is_markup(text: str) -> bool:
    return "<|" in text and "|>" in text
