"""CosyVoice3's text tokenizer, built with the `tokenizers` library (no transformers, no torch).

Upstream loads `CosyVoice-BlankEN/` with transformers' `AutoTokenizer` (which converts Qwen2's
`vocab.json` + `merges.txt` into a fast byte-level BPE) and then adds CosyVoice3's special tokens.
Here the same fast tokenizer is assembled directly: Qwen2's NFC normaliser, pre-tokenizer split regex
and byte-level decoder around the BPE, the folder's own added tokens at their configured ids, then
`COSYVOICE3_SPECIAL_TOKENS` in upstream's order, so that every id (for example `<|endofprompt|>` =
151646 on the real files) equals upstream's without being hard-coded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ..errors import FrontendError
from .special_tokens import COSYVOICE3_SPECIAL_TOKENS

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
"""What a `CosyVoice-BlankEN/` folder must hold for the text tokenizer."""

# Qwen2's pre-tokenizer split (the pattern transformers' Qwen2 converter installs).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _qwen2_bpe(blanken_dir: Path) -> Tokenizer:
    """The byte-level BPE that transformers' Qwen2 slow-to-fast conversion produces."""
    model = BPE.from_file(str(blanken_dir / "vocab.json"), str(blanken_dir / "merges.txt"),
                          continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                          byte_fallback=False)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# transformers' order of a tokenizer's special-token attributes (`SPECIAL_TOKENS_ATTRIBUTES`).
_SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
)


def _add_config_tokens(tokenizer: Tokenizer, config: dict[str, Any], config_path: Path) -> None:
    """Add the tokenizer_config's tokens the way transformers' fast-tokenizer init does.

    First the `added_tokens_decoder` entries in id order (each must land on its declared id), then any
    special token the config names (eos, pad, ..., `additional_special_tokens`) that is not added yet.
    """
    entries = sorted((int(i), spec) for i, spec in config.get("added_tokens_decoder", {}).items())
    for token_id, spec in entries:
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                           lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                           normalized=spec.get("normalized", True), special=spec.get("special", False))
        tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(spec["content"])
        if got != token_id:
            raise FrontendError(f"{config_path}: added token {spec['content']!r} is declared with id "
                                f"{token_id} but lands on id {got}; vocab.json and the config disagree")
    named: list[Any] = []
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        named += value if isinstance(value, list) else [value]
    for value in named:
        content = value.get("content") if isinstance(value, dict) else value
        present = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
        if content and content not in present:
            tokenizer.add_tokens([AddedToken(content, special=True)])


def check_unicode(text: str, name: str) -> None:
    """A `FrontendError` naming `name` where `text` holds a lone surrogate: JSON's `"\\ud800"` escape
    parses to one, and no encoder or tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FrontendError(f"{name} is not valid Unicode text: character {e.start + 1} is a lone surrogate "
                            f"(U+{ord(text[e.start]):04X})") from None


class TextTokenizer:
    """Upstream's `CosyVoice3Tokenizer` without transformers: Qwen2 BPE + CosyVoice3 special tokens."""

    def __init__(self, blanken_dir: str | Path, skip_special_tokens: bool = True) -> None:
        """Load `vocab.json`, `merges.txt` and `tokenizer_config.json` from `blanken_dir`.

        `skip_special_tokens` is what `decode` does with special tokens (upstream's yaml sets it).
        Raises `FrontendError` if a file is missing or unreadable.
        """
        blanken_dir = Path(blanken_dir)
        missing = [name for name in TOKENIZER_FILES if not (blanken_dir / name).is_file()]
        if missing:
            raise FrontendError(f"{blanken_dir}: tokenizer files missing: {', '.join(missing)}")
        config_path = blanken_dir / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            self._tokenizer = _qwen2_bpe(blanken_dir)
        except Exception as exc:  # json, OS and tokenizers errors (the latter are plain Exceptions)
            reason = " ".join(str(exc).split())
            raise FrontendError(f"{blanken_dir}: cannot load the tokenizer ({reason})") from None
        _add_config_tokens(self._tokenizer, config, config_path)
        # Strings become special, unnormalised, unstripped tokens, as transformers' add_special_tokens
        # makes them; tokens already present (e.g. <|im_start|>) keep their ids.
        self._tokenizer.add_special_tokens([
            AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
            for t in COSYVOICE3_SPECIAL_TOKENS
        ])
        self.skip_special_tokens = skip_special_tokens

    def __len__(self) -> int:
        """Vocabulary size including every added token (transformers' `len(tokenizer)`)."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added (upstream's `encode`). A `FrontendError` for a lone
        surrogate, which is no Unicode text (the tokenizer's own error is a TypeError)."""
        check_unicode(text, "the text")
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special_tokens`."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens))

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry or added token, e.g. `token_id("<|endofprompt|>")`.

        Raises `KeyError` if `token` is not a single token of this vocabulary.
        """
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not a single token of this tokenizer")
        return int(token_id)
