"""CosyVoice3's additional special tokens, in the order upstream's `CosyVoice3Tokenizer` adds them.

The order fixes their ids (each new token takes the next free id), so it must never be changed. The
export package holds the same list; a test checks the two are identical, since the runtime may not
import the export package.
"""

from __future__ import annotations

_EVENT_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>",
)

# ARPAbet phones (vowels bare and with stress 0/1/2), then pinyin initials and toned finals; each is
# wrapped in brackets, e.g. "[AA1]", "[ǐ]".
_ARPABET = """
AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH
EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW
OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH
""".split()
_PINYIN = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng
ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u
uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi
uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í
ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn
ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
""".split()

COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = (
    *_EVENT_TOKENS, *(f"[{p}]" for p in _ARPABET), *(f"[{p}]" for p in _PINYIN),
)
"""All 280 tokens, in upstream's add order."""

ENDOFTEXT = "<|endoftext|>"
"""Qwen2's end of text, which upstream also names as eos and pad token."""

ENDOFPROMPT = "<|endofprompt|>"
"""Separates the (system) prompt from the text to speak; every CosyVoice3 LLM text contains it."""
