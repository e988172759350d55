"""Input a command cannot use is refused before the work, in one line with exit status 2, and nothing is
written: unwritable outputs (`cosyvoice-run`, `cosyvoice-export tiny-bundle`), text over the limit, a
damaged bundle file (`cosyvoice-golden check`, `cosyvoice-bench`, which verify every sha256), a provider
missing here before that; and outputs get the usual mode of a new file."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

import onnxruntime
import pytest
import soundfile as sf
from click.testing import CliRunner, Result

from cosyvoice_bench.cli import main as bench_main
from cosyvoice_golden.cli import main as golden_main
from cosyvoice_runtime import CosyVoice3
from cosyvoice_runtime.atomic_files import new_sibling
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UNREACHABLE, RuntimeBundleError
from cosyvoice_runtime.runners import CUDA, ORT_PROVIDERS
from cosyvoice_runtime.segments import MAX_TEXT_CHARS
from cosyvoice_runtime.synthesis import Mode

AS_ROOT = os.geteuid() == 0
"""Root writes anywhere the file system lets it: a folder's permission bits refuse it nothing."""


def refused(result: Result) -> str:
    """The one line a command that refused its input printed (exit status 2, nothing on stdout)."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and not result.stdout, result.output
    return lines[0]


def refused_after_progress(result: Result) -> str:
    """The error line of a command that failed after its work (exit status 2): the last on stderr."""
    assert result.exit_code == 2, (result.output, result.exception)
    return result.stderr.splitlines()[-1]


def run(*args: str) -> Result:
    return CliRunner().invoke(run_main, ["--model", str(DEMO_BUNDLE), "--sampling", "greedy", *args])


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A regular file, where a folder would have to be."""
    path = tmp_path / "notes.txt"
    path.write_text("not a folder\n")
    return path


# --- unwritable outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--out", "--tokens-out", "--chunks-out"])
def test_run_refuses_an_output_under_a_file_before_the_bundle_opens(option: str, a_file: Path,
                                                                    tmp_path: Path) -> None:
    bad = a_file / "sub" / ("x.wav" if option == "--out" else "x.json")
    outputs = {"--out": tmp_path / "out.wav", "--tokens-out": tmp_path / "tokens.json",
               "--chunks-out": tmp_path / "chunks.json", option: bad}
    args = [arg for name, path in outputs.items() for arg in (name, str(path))]
    # a bundle that is not there: the output is checked first, before any work
    result = CliRunner().invoke(run_main, ["--model", str(tmp_path / "no-bundle"), "--text", "Hi.",
                                           "--stream", *args])
    assert refused(result) == f"error: {option} {bad}: {a_file} is not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == [a_file.name]


def test_run_refuses_an_output_under_a_folder_it_cannot_enter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Another user's home (mode 700), where Python 3.11's `Path.is_dir` raises (faked: root enters any
    folder): one line before the work, not a traceback."""
    home = tmp_path / "home"
    out = home / "out.wav"
    stat = Path.stat

    def denied(path: Path, **kwargs: object) -> os.stat_result:
        if path.is_relative_to(home) and path != home:
            raise PermissionError(13, "Permission denied", str(path))
        return stat(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", denied)
    assert refused(run("--text", "Hi.", "--out", str(out))) == (
        f"error: --out {out}: {UNREACHABLE}")


def test_run_refuses_an_output_that_would_overwrite_an_input(tmp_path: Path) -> None:
    """The prompt, or a file in the bundle (the next run would refuse the bundle as damaged): before the
    work, nothing written. A new file in the bundle's folder is written."""
    bundle = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, bundle)
    prompt = tmp_path / "voice.wav"
    shutil.copy(bundle / "asset" / "zero_shot_prompt.wav", prompt)
    before = prompt.read_bytes()
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--text", "Hi.", "--prompt-wav",
                                           str(prompt), "--prompt-text", "Hi.", "--out",
                                           str(tmp_path / "o.wav"), "--tokens-out", str(prompt)])
    assert refused(result) == (f"error: --tokens-out {prompt}: would overwrite --prompt-wav ({prompt}); "
                               "write it elsewhere")
    inside = bundle / "asset" / "zero_shot_prompt.wav"
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--text", "Hi.", "--out", str(inside)])
    assert refused(result) == (f"error: --out {inside}: would overwrite a file of --model ({bundle}); write "
                               "it elsewhere")
    assert prompt.read_bytes() == before and not (tmp_path / "o.wav").exists()
    RuntimeBundle.open(bundle, verify=True)  # intact
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--text", "Hi.", "--out",
                                           str(bundle / "o.wav"), "--sampling", "greedy"])
    assert result.exit_code == 0, result.output
    RuntimeBundle.open(bundle, verify=True)


@pytest.mark.parametrize(("option", "name", "why"), [
    ("--tokens-out", "-", "only --out writes to standard output; give a file name"),
    ("--out", "a" * 300 + ".wav", "File name too long"),
    # a name within the limit whose temporary file's name is not
    ("--out", "a" * 251 + ".wav", "cannot be written there (File name too long)"),
])
def test_run_refuses_an_output_name_it_could_not_write_before_the_work(
        option: str, name: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--out", "out.wav"] if option != "--out" else []
    assert refused(run("--text", "Hi.", option, name, *args)) == f"error: {option} {name}: {why}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "synth", "demo"])
def test_an_audio_output_named_for_a_format_not_written_is_refused_before_the_work(
        command: str, tmp_path: Path) -> None:
    """A file named .m4a that held WAV would mislead whatever opens it (`tests/test_audio_formats.py`)."""
    out = tmp_path / "speech.M4A"
    if command == "run":  # a bundle that is not there: the name is checked first
        result = CliRunner().invoke(run_main, ["--model", str(tmp_path / "no-bundle"), "--text", "Hi.",
                                               "--out", str(out)])
    else:
        pytest.importorskip("torch", reason="needs torch (the export extra)")
        from cosyvoice_export.cli import main as export_main

        args = ["--model-dir", str(tmp_path / "no-model"), "--text", "Hi."] if command == "synth" else []
        result = CliRunner().invoke(export_main, [command, *args, "--out", str(out)],
                                    env={"COSYVOICE_MODEL_DIR": str(tmp_path / "no-model")})
    assert refused(result) == (f"error: --out {out}: .M4A is not an audio format written here; expected a "
                               "name ending .wav, .flac, .mp3, .ogg or .opus")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["synth", "demo"])
def test_the_exports_audio_outputs_are_files(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """`-` is a file's name to them: `cosyvoice-run --out -` alone writes to standard output."""
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.cli import main as export_main

    monkeypatch.chdir(tmp_path)
    args = ["--model-dir", str(tmp_path / "no-model"), "--text", "Hi."] if command == "synth" else []
    result = CliRunner().invoke(export_main, [command, *args, "--out", "-"],
                                env={"COSYVOICE_MODEL_DIR": str(tmp_path / "no-model")})
    assert refused(result) == ("error: --out -: this command writes a file, not standard output; give a file "
                               "name")
    assert list(tmp_path.iterdir()) == []


def test_run_refuses_a_loop_of_links_and_a_folders_name_as_an_output(tmp_path: Path) -> None:
    (tmp_path / "one").symlink_to(tmp_path / "two")
    (tmp_path / "two").symlink_to(tmp_path / "one")
    loop = tmp_path / "one"
    assert refused(run("--text", "Hi.", "--out", str(loop))) == (
        f"error: --out {loop}: a loop of symbolic links")
    result = run("--text", "Hi.", "--out", f"{tmp_path}/x.wav/")  # a usage error: one line from the command
    assert result.exit_code == 2
    assert "ends with '/', as a folder's name does; expected a file's" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


@pytest.mark.skipif(AS_ROOT, reason="root may write into a folder whatever its permission bits")
def test_run_refuses_an_output_in_a_read_only_folder(tmp_path: Path) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    out = folder / "new" / "out.wav"
    assert refused(run("--text", "Hi.", "--out", str(out))) == f"error: --out {out}: {folder} is not writable"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be made")
def test_an_output_the_file_system_refuses_is_found_by_writing_before_the_work(tmp_path: Path) -> None:
    """/proc passes every permission check and refuses every new file: only writing finds it."""
    out = Path("/proc/cosyvoice-out.wav")
    result = CliRunner().invoke(run_main, ["--model", str(tmp_path / "no-bundle"), "--text", "Hi.",
                                           "--out", str(out)])
    assert refused(result) == f"error: --out {out}: cannot be written there (No such file or directory)"
    # a writable output's check leaves nothing behind, not even the folders it would create
    deep = tmp_path / "a" / "b" / "out.wav"
    result = CliRunner().invoke(run_main, ["--model", str(tmp_path / "no-bundle"), "--text", "Hi.",
                                           "--out", str(deep)])
    assert result.exit_code == 2 and "no-bundle" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_outputs_are_written_together_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A side file that fails after the synthesis leaves no WAV behind, and no temporary file."""
    import cosyvoice_runtime.cli as run_cli

    def full_disk(path: Path, data: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(run_cli, "write_json", full_disk)
    out, chunks = tmp_path / "out.wav", tmp_path / "chunks.json"
    result = run("--text", "Hi.", "--stream", "--out", str(out), "--chunks-out", str(chunks))
    line = refused_after_progress(result)
    assert line.startswith("error: writing ") and line.endswith(": No space left on device; no output was "
                                                                 "written")
    assert list(tmp_path.iterdir()) == []


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """`ulimit -f`: a write past `limit` bytes fails with EFBIG (SIGXFSZ, which would end the process, is
    ignored as a shell's `trap '' XFSZ` would)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_wav_the_file_system_cuts_short_is_one_line_and_no_file(tmp_path: Path) -> None:
    """libsndfile calls a failed write "System error": the file is made in memory and written by Python."""
    out = tmp_path / "out.wav"
    with file_size_limit(20_000):  # "Hi." is ~115 kB of PCM16
        result = run("--text", "Hi.", "--out", str(out))
    assert refused_after_progress(result) == f"error: writing {out}: File too large; no output was written"
    assert list(tmp_path.iterdir()) == []


def test_paths_that_are_not_utf8_are_read_and_written(tmp_path: Path) -> None:
    """A name's bytes as they are (Python holds them as surrogates), which libsndfile's strict encoding
    refused; the console script as a terminal runs it (click's test runner prints such names strictly)."""
    folder = tmp_path / os.fsdecode(b"caf\xe9")
    folder.mkdir()
    prompt = folder / "prompt.wav"
    shutil.copy(DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav", prompt)
    result = subprocess.run([sys.executable, "-m", "cosyvoice_runtime", "--model", str(DEMO_BUNDLE), "--text",
                             "Hi.", "--prompt-wav", str(prompt), "--prompt-text", "Hello.", "--out",
                             str(folder / "out.wav")], capture_output=True, check=False)
    assert result.returncode == 0, result.stderr
    assert sf.info(os.fsencode(folder / "out.wav")).samplerate == 24000
    bundle = folder / "bundle"
    with pytest.raises(RuntimeBundleError, match="its name holds bytes that are not UTF-8"):
        RuntimeBundle.open(bundle)


def test_stdin_is_read_as_a_utf8_text_file(tmp_path: Path) -> None:
    """Whatever the locale: a byte-order mark (Notepad's) is no text to speak, and a line ends in "\n"."""
    tokens = tmp_path / "tokens.json"
    result = CliRunner().invoke(run_main, ["--model", str(DEMO_BUNDLE), "--sampling", "greedy", "--text", "-",
                                           "--out", str(tmp_path / "o.wav"), "--tokens-out", str(tokens)],
                                input="\ufeff你好。\r\nHello there.\r\n".encode())
    assert result.exit_code == 0, result.output
    texts = [piece["text"] for piece in json.loads(tokens.read_text())]
    assert "".join(texts).startswith("你好") and not any("\ufeff" in t or "\r" in t for t in texts), texts


def test_demo_refuses_an_unwritable_out_before_exporting(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.cli import main as export_main

    out = tmp_path / "notes.txt" / "demo.wav"
    (tmp_path / "notes.txt").write_text("a file\n")
    result = CliRunner().invoke(export_main, ["demo", "--out", str(out)], env={"COSYVOICE_MODEL_DIR": str(
        tmp_path / "no-model")})
    assert refused(result) == f"error: --out {out}: {tmp_path / 'notes.txt'} is not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_tiny_bundle_refuses_an_out_it_cannot_create_before_generating(a_file: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.cli import main as export_main

    for out, problem in ((a_file / "sub" / "tiny", f"{a_file} is not a folder"),
                         (a_file, "is a file, not a folder")):
        result = CliRunner().invoke(export_main, ["tiny-bundle", str(out)])
        assert refused(result) == f"error: OUT {out}: {problem}"
    assert sorted(p.name for p in a_file.parent.iterdir()) == [a_file.name]


# --- the text limit ----------------------------------------------------------------------------------------


def test_run_refuses_text_over_the_limit_the_server_shares(tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    assert refused(run("--text", "x" * 10000, "--out", str(out))) == (
        f"error: --text is 10000 characters; the limit is {MAX_TEXT_CHARS}")
    long = "Hello there. " * (MAX_TEXT_CHARS // 13 + 1)
    result = CliRunner().invoke(run_main, ["--text", "-", "--out", str(out)], input=long)
    assert refused(result) == f"error: --text is {len(long)} characters; the limit is {MAX_TEXT_CHARS}"
    assert not out.exists()
    if find_spec("fastapi") is not None:  # the server's default is the same limit
        from cosyvoice_serve.settings import ServerSettings

        assert ServerSettings().max_text_chars == MAX_TEXT_CHARS == 2000


def test_run_refuses_cuda_graphs_off_cuda_before_any_graph_opens(tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    assert refused(run("--text", "Hello.", "--out", str(out), "--cuda-graphs")) == (
        "error: cuda graphs are the cuda provider's, not 'cpu''s")
    assert not out.exists()
    # not asked, they are used wherever they can be: on the CPU nowhere, and the run goes on
    with CosyVoice3(DEMO_BUNDLE, verify=False) as voice:
        assert voice.synth.graphs is None and voice.synth.batcher is None


def test_the_library_takes_any_length_as_upstreams_does() -> None:
    with CosyVoice3(DEMO_BUNDLE, verify=False) as voice:
        pieces = voice.segments(Mode.ZERO_SHOT, "Hello there. " * 200, prompt_text="A transcript.")
    assert sum(len(p.text) for p in pieces) > MAX_TEXT_CHARS


# --- damaged bundles: every sha256 checked ------------------------------------------------------------------


@pytest.fixture
def damaged(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A copy of the demo bundle with one byte of a graph flipped (its size unchanged), and that graph."""
    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "damaged")
    graph = bundle / json.loads((bundle / "manifest.json").read_text())["graphs"]["hift_f0"]["file"]
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    yield bundle, graph


def test_golden_check_names_the_damaged_file(damaged: tuple[Path, Path]) -> None:
    bundle, graph = damaged
    result = CliRunner().invoke(golden_main, ["check", "--model", str(bundle), "--graph", "hift_f0"])
    assert refused(result).startswith(f"error: {graph}: sha256 ")
    assert "the manifest says" in result.stderr


def test_bench_names_the_damaged_file(damaged: tuple[Path, Path], tmp_path: Path) -> None:
    bundle, graph = damaged
    result = CliRunner().invoke(bench_main, ["--model", str(bundle), "--quick", "--no-progress",
                                             "--json", str(tmp_path / "bench.json")])
    assert refused(result).startswith(f"error: {graph}: sha256 ")
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.skipif(ORT_PROVIDERS[CUDA] in onnxruntime.get_available_providers(),
                    reason="this onnxruntime has the CUDA provider, whose absence the test refuses")
@pytest.mark.parametrize("command", ["run", "bench"])
def test_a_provider_missing_here_is_refused_before_any_file_is_hashed(
        command: str, damaged: tuple[Path, Path], tmp_path: Path) -> None:
    """Whether this machine runs the bundle's graphs on the provider is known from the manifest and the
    installed libraries: the damaged file, found only by hashing every graph, is not reached."""
    bundle, _ = damaged
    out = tmp_path / ("out.wav" if command == "run" else "bench.json")
    result = CliRunner().invoke(*{
        "run": (run_main, ["--model", str(bundle), "--provider", CUDA, "--text", "Hi.", "--out", str(out)]),
        "bench": (bench_main, ["--model", str(bundle), "--provider", CUDA, "--quick", "--json", str(out)]),
    }[command])
    assert refused(result).startswith("error: provider 'cuda' needs onnxruntime's CUDAExecutionProvider; ")
    assert not out.exists()


# --- the mode of outputs -----------------------------------------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_outputs_get_the_mode_of_a_new_file(tmp_path: Path, umask_022: None) -> None:
    outs = {"--out": tmp_path / "out.wav", "--tokens-out": tmp_path / "tokens.json",
            "--chunks-out": tmp_path / "chunks.json"}
    result = run("--text", "Hi.", "--stream", *[a for o, p in outs.items() for a in (o, str(p))])
    assert result.exit_code == 0, result.output
    assert {o: oct(mode(p)) for o, p in outs.items()} == dict.fromkeys(outs, oct(0o644))
    assert sf.info(outs["--out"]).samplerate == 24000


def test_an_output_that_is_a_link_is_written_where_it_points(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "old.wav").write_bytes(b"old")
    out, tokens = tmp_path / "out.wav", tmp_path / "tokens.json"
    out.symlink_to(elsewhere / "old.wav")
    tokens.symlink_to(Path("elsewhere") / "new.json")  # relative, and nothing there yet
    result = run("--text", "Hi.", "--out", str(out), "--tokens-out", str(tokens))
    assert result.exit_code == 0, result.output
    assert out.is_symlink() and tokens.is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["new.json", "old.wav"]
    assert sf.info(elsewhere / "old.wav").samplerate == 24000
    assert json.loads((elsewhere / "new.json").read_text())


def test_new_siblings_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        file = new_sibling(tmp_path / "a", ".tmp")
        folder = new_sibling(tmp_path / "a", ".tmp", directory=True)
    finally:
        os.umask(old)
    assert (mode(file), mode(folder)) == (0o640, 0o750)
    assert file != folder and file.name.startswith(".a.") and file.is_file() and folder.is_dir()
