"""The text-tokenizer side of a bundle's `CosyVoice-BlankEN/` folder, and CosyVoice3's tokenizer on top of it.

Real bundles ship Qwen2's byte-level BPE (151,643 entries in `vocab.json` + `merges.txt`, then
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as added tokens in `tokenizer_config.json`). Our tiny test
bundles get the same kind of files from a small BPE trained here, deterministically, with Qwen2's
pre-tokenizer on a built-in English + Chinese corpus, so `transformers.AutoTokenizer` loads both alike.

`CosyVoice3TextTokenizer` then does what upstream's `CosyVoice3Tokenizer` does: load the folder with
`AutoTokenizer` and add CosyVoice3's special tokens in upstream's order, so `<|endofprompt|>` lands at
base BPE size + 3 (151646 on the real files).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import Qwen2Config
from .errors import BundleError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFPROMPT = "<|endofprompt|>"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
"""What `AutoTokenizer` needs in `CosyVoice-BlankEN/` (the real folder has no `tokenizer.json`)."""
# Qwen2's own added tokens, in id order right after the BPE vocabulary.
QWEN_ADDED_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split (transformers' Qwen2 tokenizer uses the same pattern).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# CosyVoice3's additional special tokens, in upstream's order: chat markers, paralinguistic tags, then
# ARPAbet phonemes (alphabetical; each vowel bare and with stress 0/1/2), then pinyin initials and finals
# with tone marks (sorted by code point).
_EVENT_TOKENS = (
    IM_START, IM_END, ENDOFPROMPT, "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]",
    "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]",
    "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>",
)
_ARPABET_VOWELS = "AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split()
_ARPABET_CONSONANTS = "B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH".split()
_PINYIN_UNITS = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù
iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà
uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y
z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú
ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ
ǚ ǜ
""".split()


def _arpabet_tokens() -> list[str]:
    symbols = []
    for phone in sorted(_ARPABET_VOWELS + _ARPABET_CONSONANTS):
        symbols += [phone, phone + "0", phone + "1", phone + "2"] if phone in _ARPABET_VOWELS else [phone]
    return [f"[{s}]" for s in symbols]


COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = (
    *_EVENT_TOKENS, *_arpabet_tokens(), *(f"[{u}]" for u in _PINYIN_UNITS),
)

# Training text for the tiny BPE: everyday English and Mandarin sentences, written for this project.
_CORPUS_EN = """
The quick brown fox jumps over the lazy dog near the river bank.
She sells sea shells by the sea shore every summer morning.
Please call me back when you have a moment to talk about the plan.
We are testing a small speech synthesis model with random weights.
The weather today is bright and warm, with a gentle breeze from the west.
He opened the window and listened to the birds singing in the garden.
Reading a good book on a rainy afternoon is one of life's simple pleasures.
Our train leaves at seven thirty, so we should get to the station early.
Can you tell me the way to the nearest library or bookshop?
They built a wooden boat and sailed it across the quiet lake.
Music fills the room when my grandmother plays the old piano.
I'd like a cup of tea with milk, and maybe a slice of lemon cake.
The children laughed and ran through the park after school.
Numbers like 12, 345 and 2024 appear in many everyday sentences.
Good morning! How are you doing today? I'm doing fine, thank you.
Voice cloning needs a short prompt recording and its transcript.
The engineer checked every value twice before writing the report.
Light travels faster than sound, which is why we see lightning first.
It's important to drink enough water when the days are hot.
The market was full of fresh fruit, vegetables, bread and flowers.
Hello, this is a short voice prompt. It was made for testing.
You are a helpful assistant. Please speak slowly and clearly.
Let's meet at the cafe on the corner of Main Street and Oak Avenue.
Every evening the old clock in the hall strikes nine times.
Software that is tested well is easier to change later on.
"""
_CORPUS_ZH = """
今天天气很好，我们一起去公园散步吧。
请问去火车站怎么走？
我喜欢在周末读书和听音乐。
这是一个用于测试的小型语音合成模型。
他每天早上六点起床，然后去跑步。
妈妈做的饭菜特别好吃。
我们明天下午三点在学校门口见面。
春天来了，花都开了，到处都是绿色。
你好，很高兴认识你。
这本书讲的是一个关于友谊的故事。
晚上的城市灯火通明，非常热闹。
请把窗户打开，让新鲜空气进来。
学习一门新的语言需要耐心和时间。
他们在湖边钓鱼，一直待到太阳下山。
希望你们的旅行一切顺利。
我们的声音克隆只需要一段简短的录音。
这家小店的咖啡和蛋糕都很受欢迎。
孩子们在操场上开心地玩耍。
明年我想去北京和上海看看。
谢谢你的帮助，我非常感激。
"""
TINY_BPE_VOCAB_SIZE = 512
"""Size of the tiny BPE: 256 byte symbols + 256 merges (the corpus has enough pairs seen twice for more)."""


def _bpe_corpus() -> list[str]:
    return [line for line in (_CORPUS_EN + _CORPUS_ZH).splitlines() if line]


def _train_tiny_bpe(vocab_size: int) -> Any:
    """A byte-level BPE with Qwen2's normalizer, pre-tokenizer and decoder, trained on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tokenizer.train_from_iterator(_bpe_corpus(), trainer=trainer)
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_config(blanken_dir: Path, n_bpe: int) -> Path:
    """Write a Qwen2-style `tokenizer_config.json` whose three added tokens take ids `n_bpe`, +1, +2."""
    added = {
        str(n_bpe + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
        for i, token in enumerate(QWEN_ADDED_TOKENS)
    }
    path = Path(blanken_dir) / "tokenizer_config.json"
    _write_json(path, {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    return path


def write_tokenizer_files(blanken_dir: Path, vocab_size: int = TINY_BPE_VOCAB_SIZE) -> int:
    """Train the tiny BPE and write `vocab.json`, `merges.txt`, `tokenizer_config.json` and
    `generation_config.json` into `blanken_dir` (created if needed).

    Returns the BPE vocabulary size, which is also the id of `<|endoftext|>`. The files are the same
    bytes on every call.
    """
    blanken_dir = Path(blanken_dir)
    blanken_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tiny_bpe(vocab_size)
    tokenizer.model.save(str(blanken_dir))  # writes vocab.json and merges.txt
    n_bpe = tokenizer.get_vocab_size()
    write_tokenizer_config(blanken_dir, n_bpe)
    _write_json(blanken_dir / "generation_config.json", {
        "bos_token_id": n_bpe, "do_sample": False, "eos_token_id": n_bpe, "max_new_tokens": 2048,
        "transformers_version": "4.51.3",
    })
    return n_bpe


def write_qwen_config(qwen: Qwen2Config, blanken_dir: Path, endoftext_id: int) -> Path:
    """Write `config.json` from `qwen.to_hf_dict()`, with bos/eos set to this tokenizer's `<|endoftext|>`."""
    config = qwen.to_hf_dict()
    config["bos_token_id"] = config["eos_token_id"] = endoftext_id
    path = Path(blanken_dir) / "config.json"
    _write_json(path, config)
    return path


class CosyVoice3TextTokenizer:
    """Upstream's `CosyVoice3Tokenizer`: a `CosyVoice-BlankEN` tokenizer plus CosyVoice3's special tokens."""

    def __init__(self, blanken_dir: Path, skip_special_tokens: bool = True) -> None:
        from transformers import AutoTokenizer

        blanken_dir = Path(blanken_dir)
        missing = [n for n in TOKENIZER_FILES if not (blanken_dir / n).is_file()]
        if missing:
            raise BundleError(f"{blanken_dir}: tokenizer files missing: {', '.join(missing)}")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(blanken_dir))
        except (OSError, ValueError, KeyError) as e:
            reason = " ".join(str(e).split())
            raise BundleError(f"{blanken_dir}: cannot load the tokenizer ({reason})") from None
        self._tokenizer.add_special_tokens({
            "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT,
            "additional_special_tokens": list(COSYVOICE3_SPECIAL_TOKENS),
        })
        self._vocab: dict[str, int] = self._tokenizer.get_vocab()
        self.skip_special_tokens = skip_special_tokens

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS (upstream's `encode`)."""
        return list(self._tokenizer([text])["input_ids"][0])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special_tokens` (upstream's yaml sets it)."""
        return self._tokenizer.batch_decode([list(ids)], skip_special_tokens=self.skip_special_tokens)[0]

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry or special token, e.g. `token_id("<|endofprompt|>")`."""
        if token not in self._vocab:
            raise KeyError(f"{token!r} is not a single token of this tokenizer")
        return self._vocab[token]


def load_cosyvoice3_tokenizer(blanken_dir: Path, skip_special_tokens: bool = True) -> CosyVoice3TextTokenizer:
    """Load `blanken_dir` the way upstream's `get_qwen_tokenizer(..., version='cosyvoice3')` does."""
    return CosyVoice3TextTokenizer(blanken_dir, skip_special_tokens)


def qwen_vocab_size(tokenizer: CosyVoice3TextTokenizer) -> int:
    """Rows the Qwen embedding needs for `tokenizer`: its length after the additions, rounded up to 64."""
    return math.ceil(len(tokenizer) / 64) * 64
