"""`--out` is written in the format its suffix names: WAV and FLAC hold the same 16-bit samples; MP3, Ogg
Vorbis and Ogg Opus are those formats, of the same rate and length; another suffix is refused before the
work (`tests/test_fail_early.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE


def run(out: Path) -> None:
    result = CliRunner().invoke(run_main, ["--model", str(DEMO_BUNDLE), "--sampling", "greedy", "--text",
                                           "Hello there.", "--out", str(out)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The WAV's 16-bit samples."""
    out = tmp_path_factory.mktemp("wav") / "out.wav"
    run(out)
    samples, rate = sf.read(out, dtype="int16")
    assert rate == 24000 and len(samples) > 0
    return samples


@pytest.mark.parametrize(("name", "container", "subtype"), [
    ("out", "WAV", "PCM_16"), ("out.FLAC", "FLAC", "PCM_16"), ("out.mp3", "MP3", "MPEG_LAYER_III"),
    ("out.ogg", "OGG", "VORBIS"), ("out.opus", "OGG", "OPUS")])
def test_out_is_written_in_the_format_its_suffix_names(wav: np.ndarray, tmp_path: Path, name: str,
                                                        container: str, subtype: str) -> None:
    out = tmp_path / name
    run(out)
    info = sf.info(out)
    assert (info.format, info.subtype, info.samplerate, info.channels) == (container, subtype, 24000, 1)
    samples, _ = sf.read(out, dtype="int16")
    assert len(samples) == len(wav)
    if subtype == "PCM_16":  # libsndfile's FLAC writer alone would round a float to the other integer
        np.testing.assert_array_equal(samples, wav)
    else:
        assert np.abs(samples).max() > 0


def test_a_format_this_libsndfile_cannot_write_is_refused_before_the_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A libsndfile before 1.1 (a system one, where soundfile has no wheel) has no MP3 encoder."""
    available = sf.available_subtypes
    monkeypatch.setattr(sf, "available_subtypes",
                        lambda container=None: {} if container == "MP3" else available(container))
    out = tmp_path / "out.mp3"
    result = CliRunner().invoke(run_main, ["--model", str(tmp_path / "no-bundle"), "--text", "Hi.", "--out",
                                           str(out)])
    assert result.exit_code == 2, result.output
    version = sf.__libsndfile_version__
    assert result.stderr.splitlines() == [f"error: --out {out}: this libsndfile ({version}) cannot write MP3 "
                                          "MPEG_LAYER_III; name a .wav or .flac file"]
    assert list(tmp_path.iterdir()) == []
