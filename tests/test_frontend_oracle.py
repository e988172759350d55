"""The front end against upstream's own libraries: torchaudio's `Resample` and wetext 0.0.4 with its FSTs.

The oracle (`../shared/reference/frontend-oracle/`, outside the repository) holds those libraries'
outputs on inputs written for it; its README says how it was made. `tests/data/frontend_oracle/` keeps its
text cases and the resampling cases small enough for the repository (`subset.py` there writes them), so
these tests run wherever the repository is cloned; beside the full oracle they run on all of its cases and
check that copy against it.
"""

from __future__ import annotations

import contextvars
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_runtime import CosyVoice3, cli
from cosyvoice_runtime import frontend as rt
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.frontend import text as rt_text
from cosyvoice_runtime.frontend.grammar_process import (
    INTERRUPTION,
    GrammarProcess,
    Interruption,
    TextInterrupted,
)

ORACLE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "frontend-oracle"
KEPT = Path(__file__).resolve().parent / "data" / "frontend_oracle"
FULL = (ORACLE / "resample.npz").is_file()


@pytest.fixture(scope="module")
def resample_oracle() -> tuple[Any, dict[str, dict[str, Any]]]:
    """The npz (the full oracle's where it is present, else the repository's subset) and its per-case
    metadata."""
    npz = np.load(ORACLE / "resample.npz" if FULL else KEPT / "resample_subset.npz", allow_pickle=False)
    return npz, json.loads(str(npz["__meta__"]))["cases"]


@pytest.fixture(scope="module")
def text_oracle() -> list[dict[str, Any]]:
    return json.loads((KEPT / "text_normalize.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.skipif(not FULL, reason=f"the full front-end oracle {ORACLE} is absent (it lies beside the "
                                     "repository, in ../shared)")
def test_the_repositorys_copy_is_the_oracles(tmp_path: Path) -> None:
    """`tests/data/frontend_oracle` holds what its `subset.py` writes from the oracle: the same arrays and
    cases, the same text file."""
    spec = importlib.util.spec_from_file_location("frontend_oracle_subset", KEPT / "subset.py")
    assert spec is not None and spec.loader is not None
    subset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(subset)
    subset.subset(ORACLE, tmp_path)
    assert (tmp_path / subset.TEXT).read_bytes() == (KEPT / subset.TEXT).read_bytes()
    with np.load(tmp_path / subset.RESAMPLE) as fresh, np.load(KEPT / subset.RESAMPLE) as kept:
        assert sorted(fresh.files) == sorted(kept.files)
        for key in fresh.files:
            np.testing.assert_array_equal(fresh[key], kept[key], err_msg=key)
        cases = json.loads(str(kept["__meta__"]))["cases"]
    assert len(cases) == 21 and {name.split("__")[0] for name in cases} == set(subset.SIGNALS)


def test_resampler_equals_torchaudio_on_every_case(tmp_path: Path,
                                                   resample_oracle: tuple[Any, dict[str, dict[str, Any]]]
                                                   ) -> None:
    """Each case through the runtime as a prompt goes (a float WAV file read, channels averaged and
    resampled) where its rate is one upstream accepts, through `resample` alone below 16 kHz."""
    npz, cases = resample_oracle
    worst, shorter = 0.0, 0
    for name, meta in cases.items():
        source, target = meta["orig_sr"], meta["new_sr"]
        given = npz[f"{name}__in"]  # (N,) or (N, channels)
        if source >= rt.MIN_SAMPLE_RATE:
            path = tmp_path / f"{name}.wav"
            sf.write(path, given, source, subtype="FLOAT")
            mono, sr = rt.read_audio(path)
            assert sr == source
            if given.ndim == 2:
                np.testing.assert_array_equal(mono, npz[f"{name}__mono"], err_msg=name)
            got = rt.load_wav(path, target)
        else:
            got = rt.resample(given, source, target)
        expected = npz[f"{name}__out"]
        assert got.dtype == np.float32 and got.shape == expected.shape, (name, got.shape, expected.shape)
        if source == target:
            np.testing.assert_array_equal(got, expected, err_msg=name)
        error = float(np.abs(got.astype(np.float64) - expected).max())
        assert error <= 1e-6, f"{name}: max |Δ| {error:.3g} against torchaudio"
        worst = max(worst, error)
        if meta.get("one_shorter_than_exact_ceil"):
            shorter += 1
            assert got.shape[0] == meta["exact_ceil_length"] - 1
    assert len(cases) == (72 if FULL else 21) and shorter == (6 if FULL else 4)
    print(f"worst max |Δ| over {len(cases)} cases: {worst:.3g}")


def test_resampler_length_rule_rounds_through_float32() -> None:
    n = 1_102_704  # the oracle's long 44.1 kHz case: exactly 400,074.6... samples, float32 gives 400,074
    assert rt.resample(np.zeros(n, np.float32), 44100, 16000).shape == (400_074,)
    assert math.ceil(n * 160 / 441) == 400_075


def test_wetext_output_equals_upstreams_on_every_text(text_oracle: list[dict[str, Any]]) -> None:
    """The raw normaliser output (before upstream's clean-ups): spacing, trailing space and words alike."""
    got = {case["id"]: rt_text.wetext_normalize(case["input"]) for case in text_oracle}
    differing = [(case["id"], got[case["id"]], case["upstream"]) for case in text_oracle
                 if got[case["id"]] != case["upstream"]]
    assert differing == []
    assert len(text_oracle) == 50


@pytest.fixture(scope="module")
def grammar_process() -> Iterator[GrammarProcess]:
    process = GrammarProcess()
    yield process
    process.close()


def grammar_children(parent: int) -> list[int]:
    """The grammar processes `parent` runs."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):  # ended meanwhile
            continue
        if ppid == parent and b"cosyvoice_runtime.frontend.grammar_process" in command:
            found.append(int(stat.parent.name))
    return found


def test_the_grammar_process_normalises_every_text_as_upstream(text_oracle: list[dict[str, Any]],
                                                               grammar_process: GrammarProcess) -> None:
    """The grammars in a child process: the same outputs, and the same one-line error where a grammar finds
    no parse."""
    got = {case["id"]: grammar_process(case["input"]) for case in text_oracle}
    assert [case["id"] for case in text_oracle if got[case["id"]] != case["upstream"]] == []
    with pytest.raises(rt.FrontendError) as in_process:
        rt_text.checked_wetext_normalize("\tA5")
    assert str(in_process.value).startswith("wetext (en) cannot normalise '\\tA5' (AssertionError); ")
    with pytest.raises(rt.FrontendError) as in_child:
        grammar_process("\tA5")
    assert str(in_child.value) == str(in_process.value)


def test_other_threads_run_while_the_grammar_process_normalises(grammar_process: GrammarProcess) -> None:
    """kaldifst holds the GIL through a text; in the child it does not hold this process's: a thread that
    ticks every millisecond goes on ticking through the call (in this process it stops for all of it)."""
    text = ("On Jan. 5, 2024 at 3:30 pm, 12 people paid $45.50 each for 3 kg of apples. " * 8)[:600]
    expected = rt_text.wetext_normalize(text)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        assert grammar_process(text) == expected
        end = time.perf_counter()
    finally:
        done.set()
        ticker.join()
    middle = [t for t in ticks if start + (end - start) / 4 < t < end - (end - start) / 4]
    assert len(middle) >= 10, (end - start, len(middle))


def test_a_killed_grammar_process_is_replaced() -> None:
    """The child killed (the kernel's out-of-memory killer): the next text with a digit starts another and
    is normalised; one without needs none."""
    others = set(grammar_children(os.getpid()))  # a server engine's, where a test made one
    process = GrammarProcess()
    try:
        assert process("Room 12.") == rt_text.wetext_normalize("Room 12.")
        [child] = set(grammar_children(os.getpid())) - others
        os.kill(child, signal.SIGKILL)
        assert process("Room twelve.") == "Room twelve."  # no grammar reads it: not sent
        assert set(grammar_children(os.getpid())) - others - {child} == set()
        assert process("Room 13.") == rt_text.wetext_normalize("Room 13.")
        assert len(replaced := set(grammar_children(os.getpid())) - others) == 1 and replaced != {child}
    finally:
        process.close()


@pytest.mark.parametrize("most", [1, 2])
def test_a_short_text_waits_behind_a_long_one_only_where_no_other_child_may_start(
        long_text_asked: tuple[str, threading.Event], most: int) -> None:
    """A short text with a digit sent while a long one is normalised: with room for a second child it gets
    one and is done first; without, it waits for the long one."""
    long_text, asked = long_text_asked
    others = set(grammar_children(os.getpid()))
    process = GrammarProcess(most)
    ended: dict[str, float] = {}

    def normalise(name: str, text: str) -> None:
        assert process(text) == rt_text.wetext_normalize(text)
        ended[name] = time.perf_counter()

    try:
        long = threading.Thread(target=normalise, args=("long", long_text))
        long.start()
        assert asked.wait(30)
        normalise("short", "Room 12.")
        long.join()
        assert len(set(grammar_children(os.getpid())) - others) == most
    finally:
        process.close()
    assert (ended["short"] < ended["long"]) == (most == 2)
    assert set(grammar_children(os.getpid())) == others


def test_an_interruption_ends_its_text_and_the_child_working_on_it(
        long_text_asked: tuple[str, threading.Event]) -> None:
    """A caller whose client left ends the normalisation of its text (seconds) from another thread: the call
    raises `TextInterrupted` rather than return the text, its child is ended and another takes the next
    text; interrupted before a grammar is asked, it raises at once and ends no child."""
    long_text, asked = long_text_asked
    others = set(grammar_children(os.getpid()))
    process = GrammarProcess()

    def interruptible() -> tuple[Interruption, contextvars.Context]:
        interruption, context = Interruption(), contextvars.copy_context()
        context.run(INTERRUPTION.set, interruption)
        return interruption, context

    outcome: list[str | BaseException] = []

    def normalise(context: contextvars.Context) -> None:
        try:
            outcome.append(context.run(process, long_text))
        except TextInterrupted as e:
            outcome.append(e)

    try:
        [first] = set(grammar_children(os.getpid())) - others
        interruption, context = interruptible()
        thread = threading.Thread(target=normalise, args=(context,))
        thread.start()
        assert asked.wait(30)
        interruption.interrupt()
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], TextInterrupted)
        assert process("Room 12.") == rt_text.wetext_normalize("Room 12.")
        [second] = set(grammar_children(os.getpid())) - others
        assert second != first
        early, context = interruptible()
        early.interrupt()
        with pytest.raises(TextInterrupted):
            context.run(process, "Room 13.")
        assert set(grammar_children(os.getpid())) - others == {second}
        assert process("Room 14.") == rt_text.wetext_normalize("Room 14.")
    finally:
        process.close()
    assert set(grammar_children(os.getpid())) == others


def test_a_negative_count_of_normaliser_processes_is_refused_before_the_bundle_opens(tmp_path: Path) -> None:
    line = "normalizer_processes is -1; expected 0 (in this process) or more"
    with pytest.raises(UserError, match=f"^{re.escape(line)}$"):
        CosyVoice3(tmp_path / "not-a-bundle", normalizer_processes=-1)


def test_numbers_are_spelt_out_alike_from_threads_at_once() -> None:
    """inflect's engine keeps a call's state on itself: calls from threads at once gave other numbers' words
    ("eleven quadrillion" for 11,234,567,890) or raised out of range, unless they take turns."""
    frontend = rt.TextFrontend(rt.TextTokenizer(DEMO_BUNDLE / "tokenizer"), use_wetext=False)
    texts = [f"Order {10 ** k + 123456789 * k} now." for k in range(6, 30)]
    want = [frontend.normalize(t) for t in texts]
    def twenty_rounds(_: int) -> list[str]:
        return [frontend.normalize(t) for _ in range(20) for t in texts]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch within a call
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(twenty_rounds, range(4)))
    finally:
        sys.setswitchinterval(interval)
    assert got == [want * 20] * 4


def test_a_grammar_process_ends_with_its_parent() -> None:
    """A process killed outright (SIGKILL) leaves no grammar process behind holding its stderr: reading
    that to its end ends."""
    script = ("import time; from cosyvoice_runtime.frontend.grammar_process import GrammarProcess; "
              "grammar = GrammarProcess(); grammar('Room 1.'); print('ready', flush=True); time.sleep(600)")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as parent:
        assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
        [child] = grammar_children(parent.pid)
        parent.kill()
        assert parent.communicate(timeout=30) == ("", "")
    command = Path(f"/proc/{child}/cmdline")
    deadline = time.monotonic() + 10
    while command.exists() and command.read_bytes() and time.monotonic() < deadline:  # a zombie's is empty
        time.sleep(0.05)
    assert not command.exists() or command.read_bytes() == b""


def test_no_escape_reaches_the_llm(text_oracle: list[dict[str, Any]]) -> None:
    frontend = rt.TextFrontend(rt.TextTokenizer(DEMO_BUNDLE / "tokenizer"))
    quoted = [case for case in text_oracle if '"' in case["input"] or "“" in case["input"]]
    assert len(quoted) >= 3
    for case in text_oracle:
        for segment in frontend.split(case["input"]):
            assert "\\" not in segment, (case["id"], segment)


@pytest.mark.parametrize(("case", "mel_case"), [
    ("lenclicks__22050__to16000", "lenclicks__22050__to24000"),
    ("stereo_cancel__22050__to16000", None),  # the oracle resamples its stereo cases to 16 kHz only
    ("vowel__22050__to16000", "vowel__22050__to24000"),
    ("stereo_independent__44100__to16000", None),
    ("vowel__48000__to16000", "vowel__48000__to24000"),
])
def test_cosyvoice_run_prompt_features_come_from_torchaudios_waveform(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        resample_oracle: tuple[Any, dict[str, dict[str, Any]]], case: str, mel_case: str | None) -> None:
    """`cosyvoice-run --prompt-wav` on 22.05 kHz (clicks, a vowel, stereo), 44.1 kHz stereo and 48 kHz
    prompts: the speech tokens and x-vector it conditions on are those of torchaudio's 16 kHz waveform, the
    prompt mel that of its 24 kHz one."""
    npz, cases = resample_oracle
    if case not in cases:
        pytest.skip(f"{case} is in the full front-end oracle only ({ORACLE}, beside the repository)")
    prompt = tmp_path / "prompt.wav"
    sf.write(prompt, npz[f"{case}__in"], cases[case]["orig_sr"], subtype="FLOAT")
    used: list[rt.PromptFeatures] = []
    extract = CosyVoice3.prompt_features

    def observed(voice: CosyVoice3, prompt_wav: Any) -> rt.PromptFeatures:
        used.append(extract(voice, prompt_wav))
        return used[-1]

    monkeypatch.setattr(CosyVoice3, "prompt_features", observed)
    out = tmp_path / "out.wav"
    result = CliRunner().invoke(cli.main, ["--model", str(DEMO_BUNDLE), "--text", "Hello there.",
                                           "--prompt-wav", str(prompt), "--prompt-text", "Ah.",
                                           "--sampling", "greedy", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and len(used) == 1

    frontend = DEMO_BUNDLE / "frontend"
    campplus = rt.open_session(frontend / "campplus.onnx")
    tokenizer = rt.open_session(frontend / "speech_tokenizer_v3.onnx")
    wav16k = npz[f"{case}__out"]
    tokens = rt.speech_tokens(tokenizer, wav16k)
    n = used[0].speech_tokens.shape[1]
    np.testing.assert_array_equal(used[0].speech_tokens, tokens[:, :n])
    np.testing.assert_allclose(used[0].embedding, rt.speaker_embedding(campplus, wav16k), rtol=0, atol=1e-5)
    if mel_case is not None:
        mel = rt.prompt_mel(npz[f"{mel_case}__out"], rt.PromptMelConfig())
        assert n == min(mel.shape[1] // 2, tokens.shape[1])
        # waveforms within 3e-7 of each other; the log mel's bands near its 1e-5 clamp move most
        np.testing.assert_allclose(used[0].mel, mel[:, :2 * n], rtol=0, atol=1e-3)
