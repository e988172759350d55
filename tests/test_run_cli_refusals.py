"""`cosyvoice-run` refuses options it cannot use in one line with exit status 2, before the bundle is
opened where the check needs no bundle, and writes nothing: outputs that are no regular file or that clash,
text that is not UTF-8 or too long, a speed that is not finite, threads beyond the usable CPUs, a
transcript or instruction the mode does not take, a prompt or text the bundle cannot speak (before a model
bundle is exported, or a runtime bundle's files hashed and its graphs opened), a damaged graph; and every
console script reports click's own usage errors in the same one line."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import stat
import subprocess
import sys
import termios
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path

import click
import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf
from click.testing import CliRunner, Result

import cosyvoice_runtime.cli as run_cli
from cosyvoice_graphs.bundle_layout import MODEL_YAML, PROMPT_TEXT, PROMPT_WAV, QWEN_DIR
from cosyvoice_runtime import bundle_source
from cosyvoice_runtime.audio_files import save_wav
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli import main as run_main
from cosyvoice_runtime.cli_options import NonEmptyPath, Threads
from cosyvoice_runtime.cosyvoice3 import CosyVoice3
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UNREACHABLE, ProviderError, RuntimeBundleError, UserError
from cosyvoice_runtime.extras import run_console_script
from cosyvoice_runtime.runners import ort_settings
from cosyvoice_runtime.runners.ort_settings import TUNING_FILE
from cosyvoice_runtime.segments import MAX_TEXT_CHARS


def refused(result: Result) -> str:
    """The one line a command that refused its input printed (exit status 2, nothing on stdout)."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and not result.stdout, result.output
    return lines[0]


@pytest.fixture
def no_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`--model` naming no bundle, and `RuntimeBundle.open` failing the test: a refusal printed is one
    made before any bundle is looked at."""
    monkeypatch.setattr(RuntimeBundle, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    return ["--model", str(tmp_path / "no-bundle")]


def run(no_bundle: list[str], *args: str, input: str | bytes | None = None) -> Result:
    return CliRunner().invoke(run_main, [*no_bundle, *args], input=input)


# --- outputs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--out", "--tokens-out", "--chunks-out"])
def test_an_output_that_is_a_fifo_is_refused_and_left_as_it_is(option: str, no_bundle: list[str],
                                                               tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outputs = {"--out": tmp_path / "out.wav", "--tokens-out": tmp_path / "t.json",
               "--chunks-out": tmp_path / "c.json", option: fifo}
    args = [a for o, p in outputs.items() for a in (o, str(p))]
    assert refused(run(no_bundle, "--text", "Hi.", "--stream", *args)) == (
        f"error: {option} {fifo}: is a FIFO, not a regular file (writing the output would replace it)")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_a_device_is_refused_as_an_output() -> None:
    result = CliRunner().invoke(run_main, ["--text", "Hi.", "--out", os.devnull])
    assert refused(result) == (
        f"error: --out {os.devnull}: is a character device, not a regular file (writing the output would "
        "replace it)")
    assert stat.S_ISCHR(Path(os.devnull).stat().st_mode)


def test_every_atomic_writer_refuses_a_special_file(tmp_path: Path) -> None:
    """The rename all outputs are written with, not only the command's check, refuses to replace it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=f"^{fifo}: is a FIFO, not a regular file"):
        save_wav(fifo, np.zeros((1, 10), np.float32), 24000)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]


@pytest.mark.parametrize(("first", "second"), [("--out", "--tokens-out"), ("--tokens-out", "--chunks-out"),
                                               ("--out", "--chunks-out")])
def test_two_outputs_naming_one_file_are_refused(first: str, second: str, no_bundle: list[str],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    outputs = {"--out": "out.wav", "--tokens-out": "t.json", "--chunks-out": "c.json", first: "same",
               second: str(tmp_path / "sub" / ".." / "same")}  # the same file, spelt otherwise
    result = run(no_bundle, "--text", "Hi.", "--stream", *[a for o, p in outputs.items() for a in (o, p)])
    assert refused(result) == (
        f"error: {first} and {second} name the same file {outputs[second]}; give each its own")
    assert list(tmp_path.iterdir()) == []


# --- text --------------------------------------------------------------------------------------------------


def test_text_that_is_not_utf8_is_refused_before_the_bundle_opens(no_bundle: list[str], tmp_path: Path
                                                                  ) -> None:
    out = ["--out", str(tmp_path / "o.wav")]
    # stdin decoded strictly (a UTF-8 locale), and as Python decodes argv (and stdin in a C locale)
    assert refused(run(no_bundle, "--text", "-", *out, input=b"hello \xff\xfe world")) == (
        "error: --text - (stdin) is not valid UTF-8: byte 0xff cannot be decoded")
    bad = b"hello \xff world".decode("utf-8", "surrogateescape")
    for option, mode in (("--text", []), ("--prompt-text", []), ("--instruct", ["--mode", "instruct2"])):
        args = ["--text", bad] if option == "--text" else ["--text", "Hi.", option, bad]
        assert refused(run(no_bundle, *args, *mode, *out)) == (
            f"error: {option} is not valid UTF-8: character 7 is an undecodable byte")
    assert list(tmp_path.iterdir()) == []


def test_the_newline_ending_stdin_is_not_counted_against_the_limit(no_bundle: list[str], tmp_path: Path
                                                                   ) -> None:
    out = ["--out", str(tmp_path / "o.wav")]
    assert refused(run(no_bundle, "--text", "-", *out, input=("x" * MAX_TEXT_CHARS + "\n").encode())) != (
        f"error: --text is {MAX_TEXT_CHARS + 1} characters; the limit is {MAX_TEXT_CHARS}")
    assert refused(run(no_bundle, "--text", "-", *out, input=("x" * MAX_TEXT_CHARS + "\n\n").encode())) == (
        f"error: --text is {MAX_TEXT_CHARS + 1} characters; the limit is {MAX_TEXT_CHARS}")


@pytest.mark.parametrize("option", ["--prompt-text", "--instruct"])
def test_prompt_text_and_instruct_have_texts_limit(option: str, no_bundle: list[str], tmp_path: Path) -> None:
    mode = ["--mode", "instruct2"] if option == "--instruct" else []
    long = "x" * (MAX_TEXT_CHARS + 1)
    result = run(no_bundle, "--text", "Hi.", option, long, *mode, "--out", str(tmp_path / "o.wav"))
    assert refused(result) == (
        f"error: {option} is {MAX_TEXT_CHARS + 1} characters; the limit is {MAX_TEXT_CHARS}")


def _demo_with_prompt(tmp_path: Path, prompt: str) -> Path:
    """The demo bundle ("own"), or a copy of it without a prompt ("none") or with a blank transcript
    ("blank")."""
    if prompt == "own":
        return DEMO_BUNDLE
    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    if prompt == "none":
        manifest["prompt"] = None
    else:
        text = bundle / manifest["prompt"]["text"]
        text.write_text(" ")
        manifest["files"][manifest["prompt"]["text"]]["size"] = text.stat().st_size
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def _model_bundle(tmp_path: Path, prompt: str) -> Path:
    """A model bundle as far as a run reads it before exporting it: the demo bundle's yaml, tokenizer files
    and prompt (it is the export of such a bundle) at a model bundle's paths; its prompt as
    `_demo_with_prompt`'s."""
    root = tmp_path / "model"
    shutil.copytree(RuntimeBundle.open(DEMO_BUNDLE).tokenizer_dir, root / QWEN_DIR)
    shutil.copy(DEMO_BUNDLE / MODEL_YAML, root / MODEL_YAML)
    if prompt != "none":
        (root / PROMPT_WAV).parent.mkdir()
        shutil.copy(DEMO_BUNDLE / PROMPT_WAV, root / PROMPT_WAV)
        (root / PROMPT_TEXT).write_text((DEMO_BUNDLE / PROMPT_TEXT).read_text() if prompt == "own" else " ")
    return root


@pytest.mark.parametrize("kind", ["runtime", "model"])
@pytest.mark.parametrize(("text", "prompt", "line"), [
    ("。。。", "own", "error: --text has nothing to speak after normalisation"),
    ("Hi.", "none", "error: --prompt-wav is needed: {bundle} carries no prompt of its own"),
    ("Hi.", "blank", "error: zero-shot needs --prompt-text: the bundle's prompt zero_shot_prompt.wav has no "
                     "transcript"),
])
def test_the_prompt_and_the_text_are_refused_before_the_bundle_is_exported_hashed_or_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, prompt: str, line: str, kind: str
) -> None:
    """A model bundle's export takes minutes; upstream's release carries no prompt of its own."""
    bundle = _demo_with_prompt(tmp_path, prompt) if kind == "runtime" else _model_bundle(tmp_path, prompt)
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the bundle was exported"))
    monkeypatch.setattr(RuntimeBundle, "_check_hashes", lambda _: pytest.fail("the bundle was hashed"))
    monkeypatch.setattr(run_cli, "CosyVoice3", lambda *_, **__: pytest.fail("the graphs were opened"))
    out = tmp_path / "out" / "o.wav"
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--text", text, "--out", str(out)])
    assert refused(result) == line.format(bundle=bundle)
    assert not out.parent.exists()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime has CUDA: there is no missing provider to refuse")
def test_a_provider_not_installed_is_refused_before_a_model_bundle_is_exported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export takes minutes, and its bundle could not run."""
    model, cache = _model_bundle(tmp_path, "own"), tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the bundle was exported"))
    line = "provider 'cuda' needs onnxruntime's CUDAExecutionProvider; this onnxruntime"
    result = CliRunner().invoke(run_main, ["--model", str(model), "--provider", "cuda", "--text", "Hi.",
                                           "--out", str(tmp_path / "o.wav")])
    assert refused(result).startswith(f"error: {line}")
    with pytest.raises(ProviderError, match=re.escape(line)):
        CosyVoice3(model, provider="cuda")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_options_its_export_could_not_take_are_refused_before_a_model_bundle_is_exported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model bundle's export (fp32: no TensorRT plans, no `llm_decode`) takes minutes; what it could not
    run is known from its precision plan and upstream's streaming constants (`PlannedExport`)."""
    model = _model_bundle(tmp_path, "own")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the bundle was exported"))
    short = "first_chunk_tokens must be >= 5 (the vocoder holds back 8 mel frames), got 4"
    for args, line in (
            (["--provider", "trt"], f"{model}: its llm has no TensorRT plan, which 'trt' runs (export with "
                                    "--trt on the GPU that will run it)"),
            (["--cuda-graphs"], "cuda graphs are the cuda provider's, not 'cpu''s"),
            (["--stream", "--first-chunk-tokens", "4"], short)):
        result = CliRunner().invoke(run_main, ["--model", str(model), "--text", "Hi.", "--out",
                                               str(tmp_path / "o.wav"), *args])
        assert refused(result) == f"error: {line}"
    with pytest.raises(UserError, match=re.escape(
            "max_batch 2: batched decoding runs on llm_decode, on the cpu provider or in fp16 on cuda; "
            f"{model} (fp32) on 'cpu' decodes on llm")):
        CosyVoice3(model, max_batch=2)
    with pytest.raises(UserError, match=re.escape(short)):
        CosyVoice3(model, chunk_policy=ChunkPolicy(first_chunk_tokens=4))
    # upstream's fp16 with its TensorRT: an fp16 llm exported for onnxruntime does not run on its TensorRT
    with pytest.raises(ProviderError, match=re.escape(
            f"{model}: its fp16 llm attends with onnxruntime's GroupQueryAttention over growing caches")):
        CosyVoice3(model, load_trt=True, fp16=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# --- options -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", ["nan", "inf", "-nan"])
def test_a_speed_that_is_not_finite_is_refused(speed: str, no_bundle: list[str], tmp_path: Path) -> None:
    result = run(no_bundle, "--text", "Hi.", "--speed", speed, "--out", str(tmp_path / "o.wav"))
    assert result.exit_code == 2 and "Invalid value for '--speed'" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("flag", "args", "unused"), [
    ("--tune", ["--provider", "cuda", "--threads", "1"], "--provider, --threads"),
    ("--tune", ["--text", "Hi.", "--out", "o.wav", "--stream"], "--text, --stream, --out"),
    ("--info", ["--first-chunk-tokens", "10", "--seed", "5"], "--seed, --first-chunk-tokens"),
])
def test_info_and_tune_refuse_options_they_would_leave_unused(no_bundle: list[str], tmp_path: Path, flag: str,
                                                             args: list[str], unused: str) -> None:
    """Refused, not left unused: `--tune --provider cuda` would tune the CPU, `--out o.wav` write nothing."""
    line = refused(run(no_bundle, flag, *args))
    assert line == f"error: {flag} takes only --model and --verify; {unused} would go unused"
    assert list(tmp_path.iterdir()) == []


def test_threads_beyond_the_usable_cpus_are_refused(no_bundle: list[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort_settings, "usable_cpus", lambda: 2)
    out = ["--text", "Hi.", "--out", str(tmp_path / "o.wav")]
    for threads, message in (("3", "3 is more than the 2 CPUs this process may use"),
                             ("0", "0 is not a count of threads; expected 1 or more")):
        result = run(no_bundle, "--threads", threads, *out)
        assert result.exit_code == 2 and f"Invalid value for '--threads': {message}" in result.stderr
    assert "does not exist" in run(no_bundle, "--threads", "2", *out).stderr  # allowed: on to the bundle


def _threads_options() -> dict[str, click.Command]:
    from cosyvoice_bench import dit_stacking, graph_profile, peak_rss, vocoder_stacking
    from cosyvoice_bench.cli import main as bench
    from cosyvoice_golden.cli import main as golden

    commands = {"cosyvoice-run": run_main, "cosyvoice-bench": bench, "golden check": golden.commands["check"],
                "peak_rss": peak_rss.main, "graph_profile": graph_profile.main,
                "dit_stacking": dit_stacking.main, "vocoder_stacking": vocoder_stacking.main}
    if find_spec("fastapi") is not None:
        from cosyvoice_serve.cli import serve

        commands["cosyvoice-serve"] = serve
    return commands


def test_a_path_that_must_exist_but_cannot_be_looked_at_says_why(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    @click.command()
    @click.option("--prompt-dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path))
    def command(prompt_dir: Path) -> None:
        click.echo(f"ok {prompt_dir.name}")

    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(loop)
    private = tmp_path / "private" / "prompts"
    stat = os.stat

    def denied(path: str | os.PathLike[str], *args: object, **kwargs: object) -> os.stat_result:
        if str(path) == str(private):  # what a folder of mode 700 does to another user
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", denied)
    answers = {name: CliRunner().invoke(command, ["--prompt-dir", str(path)])
               for name, path in {"loop": loop, "private": private, "missing": tmp_path / "none",
                                  "present": tmp_path}.items()}
    assert {name: result.exit_code for name, result in answers.items()} == {
        "loop": 2, "private": 2, "missing": 2, "present": 0}
    assert f"'{loop}': a loop of symbolic links" in answers["loop"].output
    assert f"'{private}': {UNREACHABLE}" in answers["private"].output
    assert "does not exist" in answers["missing"].output
    for bundle, problem in ((loop, "a loop of symbolic links"), (private, UNREACHABLE)):
        with pytest.raises(RuntimeBundleError, match=f"^{re.escape(f'{bundle}: {problem}')}$"):
            RuntimeBundle.open(bundle)


def test_every_commands_threads_is_the_shared_option() -> None:
    for name, command in _threads_options().items():
        types = [p.type for p in command.params if p.name == "threads"]
        assert len(types) == 1 and isinstance(types[0], Threads), name


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "instruct2"], "instruct2 needs --instruct"),
    (["--mode", "instruct2", "--instruct", " "], "instruct2 needs --instruct"),
    (["--prompt-wav", "p.wav"], "zero-shot needs --prompt-text (the transcript of --prompt-wav)"),
    (["--prompt-text", " "], "zero-shot needs --prompt-text (the transcript of --prompt-wav)"),
    (["--instruct", "Speak slowly."], "--instruct needs --mode instruct2 (zero-shot takes no instruction)"),
    (["--mode", "cross-lingual", "--instruct", "Speak slowly."],
     "--instruct needs --mode instruct2 (cross-lingual takes no instruction)"),
    (["--mode", "cross-lingual", "--prompt-text", "A transcript."],
     "--prompt-text needs --mode zero-shot (cross-lingual takes no transcript)"),
    (["--mode", "instruct2", "--instruct", "Speak slowly.", "--prompt-text", "A transcript."],
     "--prompt-text needs --mode zero-shot (instruct2 takes no transcript)"),
], ids=["instruct2-without", "instruct2-blank", "wav-without-text", "blank-text", "instruct-zero-shot",
        "instruct-cross-lingual", "text-cross-lingual", "text-instruct2"])
def test_a_mode_and_its_texts_are_checked_before_the_bundle_opens(
        args: list[str], message: str, no_bundle: list[str], tmp_path: Path) -> None:
    result = run(no_bundle, "--text", "Hi.", *args, "--out", str(tmp_path / "o.wav"))
    assert refused(result) == f"error: {message}"


def test_info_and_tune_together_are_refused(no_bundle: list[str]) -> None:
    assert refused(run(no_bundle, "--info", "--tune")) == "error: --info and --tune: give one"


def test_tune_refuses_a_bundle_it_cannot_write_before_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """As the read-only folder a user (not root) or a read-only mount gives: os.access says so."""
    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not (Path(path) == bundle and mode & os.W_OK)
                        and access(path, mode))
    monkeypatch.setattr(RuntimeBundle, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    monkeypatch.setattr(run_cli, "tune", lambda *_, **__: pytest.fail("the tuning ran"))
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--tune"])
    assert refused(result) == f"error: --tune {bundle / TUNING_FILE}: {bundle} is not writable"
    assert not (bundle / TUNING_FILE).exists()


def _demo_copy(tmp_path: Path, section: str, name: str) -> tuple[Path, Path]:
    """A copy of the demo bundle and the path of its manifest's `section`.`name` file (to damage)."""
    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    entry = json.loads((bundle / "manifest.json").read_text())[section][name]
    return bundle, bundle / (entry["file"] if isinstance(entry, dict) else entry)


def _refused_unverified(bundle: Path, tmp_path: Path) -> str:
    """`cosyvoice-run --no-verify` on `bundle`: refused (status 2, no output written); its last line."""
    out = tmp_path / "o.wav"
    result = CliRunner().invoke(run_main, ["--model", str(bundle), "--no-verify", "--text", "Hi.", "--out",
                                           str(out)])
    assert result.exit_code == 2 and not out.exists(), result.output
    return result.stderr.splitlines()[-1]


@pytest.mark.parametrize(("damage", "reason"), [
    ("all", "not a graph onnxruntime can load (Protobuf parsing failed)"),
    # one byte inside a node, or in the metadata: onnxruntime's InvalidArgument, a UnicodeDecodeError
    (1000, "not a graph onnxruntime can load (Invalid model. Node input "),
    (-30, "its metadata is not UTF-8 text"),
])
def test_a_damaged_graph_unverified_is_one_line_naming_it(tmp_path: Path, damage: str | int, reason: str
                                                          ) -> None:
    bundle, graph = _demo_copy(tmp_path, "graphs", "hift_f0")
    data = bytearray(np.random.default_rng(0).bytes(graph.stat().st_size) if damage == "all"
                     else graph.read_bytes())  # the size the manifest says
    if isinstance(damage, int):
        data[damage] ^= 0xFF
    graph.write_bytes(bytes(data))
    line = _refused_unverified(bundle, tmp_path)
    assert line.startswith(f"error: {graph}: {reason}"), line
    assert line.endswith("; verifying the bundle's sha256s finds a damaged file")


def test_a_damaged_front_end_model_unverified_is_one_line_naming_it(tmp_path: Path) -> None:
    bundle, model = _demo_copy(tmp_path, "frontend", "campplus")
    data = bytearray(model.read_bytes())
    data[:4096] = np.random.default_rng(0).bytes(4096)
    model.write_bytes(bytes(data))
    line = _refused_unverified(bundle, tmp_path)
    assert line.startswith(f"error: {model}: not a graph onnxruntime can load ("), line


@pytest.mark.parametrize(("table", "what"), [("text_embedding", "the LLM's log-probs"),
                                             ("flow_noise", "the flow's mel")])
def test_a_table_of_nans_unverified_is_one_line_and_no_audio(tmp_path: Path, table: str, what: str) -> None:
    """NaN would reach the file as a constant (the vocoder's clip), or fail deep in the sampler."""
    bundle, path = _demo_copy(tmp_path, "tables", table)
    np.save(path, np.full_like(np.load(path), np.nan))  # the size the manifest says
    line = _refused_unverified(bundle, tmp_path)
    assert line.startswith(f"error: {what} holds NaN or infinity: a graph or table of the bundle is "
                           "damaged"), line


# --- click's usage errors ----------------------------------------------------------------------------------

SCRIPTS = {"cosyvoice-run": ("cosyvoice_runtime.cli", ()), "cosyvoice-golden": ("cosyvoice_golden.cli", ()),
           "cosyvoice-bench": ("cosyvoice_bench.cli", ()),
           "cosyvoice-serve": ("cosyvoice_serve.cli", ("serve", "ray")),
           "cosyvoice-export": ("cosyvoice_export.cli", ("export",))}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_reports_a_usage_error_in_one_line(
        script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    module, extras = SCRIPTS[script]
    monkeypatch.setattr(sys, "argv", [script, "--no-such-option"])
    show = click.UsageError.show
    with pytest.raises(SystemExit) as exit:
        run_console_script(script, module, extras)
    out, err = capsys.readouterr()
    if "pip install" in err:
        pytest.skip(err.strip())  # the script's extra is not installed here
    assert (exit.value.code, out) == (2, "")
    assert err.startswith("error: No such option '--no-such-option'") and err.count("\n") == 1, err
    assert click.UsageError.show is show  # click's own again once the script is done


def test_a_path_it_may_not_use_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Where no check before the work named it (a prompt inside another user's home, a name too long): one
    line, not a traceback."""
    for error in (PermissionError(errno.EACCES, "Permission denied", "/home/someone/prompt.wav"),
                  OSError(errno.ENAMETOOLONG, "File name too long", "p" * 300 + ".wav")):

        def fails(error: OSError = error) -> None:
            raise error

        monkeypatch.setattr(run_cli, "main", fails)
        with pytest.raises(SystemExit) as exit:
            run_console_script("cosyvoice-run", "cosyvoice_runtime.cli")
        assert exit.value.code == 2
        assert capsys.readouterr().err == f"error: {error.filename}: {error.strerror}\n"


def test_a_write_the_file_system_refuses_and_the_memory_running_out_are_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk, a file-size limit, too little memory: what no check before the work can see coming."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    with pytest.raises(MemoryError) as numpy_error:
        np.empty(1 << 48, np.float32)  # a PiB: more than any address space holds
    load = "Load model from /b/graphs/flow_encoder.onnx failed:std::bad_alloc"
    cases = [(OSError(errno.ENOSPC, "No space left on device", "/data/out.wav"), 2,
              "error: /data/out.wav: No space left on device"),
             (OSError(errno.EFBIG, "File too large"), 2, "error: File too large"),
             (numpy_error.value, 1, f"error: out of memory ({numpy_error.value})"),
             (Fail(f"[ONNXRuntimeError] : 1 : FAIL : {load}"), 1, f"error: out of memory ({load})")]
    for error, status, line in cases:

        def fails(error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(run_cli, "main", fails)
        with pytest.raises(SystemExit) as exit:
            run_console_script("cosyvoice-run", "cosyvoice_runtime.cli")
        assert (exit.value.code, capsys.readouterr().err) == (status, f"{line}\n")
    other = Fail("[ONNXRuntimeError] : 1 : FAIL : something else")
    monkeypatch.setattr(run_cli, "main", lambda: (_ for _ in ()).throw(other))
    with pytest.raises(Fail):  # not the memory's: the traceback a bug deserves
        run_console_script("cosyvoice-run", "cosyvoice_runtime.cli")


def test_a_current_folder_that_was_removed_is_one_line(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = "import os, sys; os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); " \
             "from cosyvoice_runtime.extras import run_console_script; " \
             "run_console_script('cosyvoice-export', 'cosyvoice_export.cli')"
    result = subprocess.run([sys.executable, "-c", script, str(gone)], capture_output=True, text=True,
                            check=False)
    assert (result.returncode, result.stderr) == (
        2, "error: the current folder no longer exists; change to another and run the command again\n")


def started(process: subprocess.Popen[str], marker: Path) -> None:
    """Wait until `process` has written `marker` (fails if it ends first)."""
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.02)


def test_a_command_runs_with_its_standard_streams_closed(tmp_path: Path) -> None:
    """`cosyvoice-run ... <&- >&- 2>&-` (a daemon's closed descriptors): the output is written, and what
    would have been printed is dropped; `--text -` reads nothing."""
    def close_all() -> None:
        for fd in (0, 1, 2):
            os.close(fd)

    run = [sys.executable, "-m", "cosyvoice_runtime", "--model", str(DEMO_BUNDLE), "--sampling", "greedy"]
    done = subprocess.run([*run, "--text", "Hi.", "--out", str(tmp_path / "o.wav")], preexec_fn=close_all,
                          check=False)
    assert done.returncode == 0 and sf.info(tmp_path / "o.wav").samplerate == 24000
    nothing = subprocess.run([*run, "--text", "-", "--out", str(tmp_path / "p.wav")], capture_output=True,
                             text=True, preexec_fn=lambda: os.close(0), check=False)
    assert (nothing.returncode, nothing.stderr) == (2, "error: --text is empty\n")


def test_sigterm_unwinds_a_command_so_that_its_cleanups_run(tmp_path: Path) -> None:
    """`docker stop`, `kill`: the temporary file is removed as for Ctrl-C, then the process ends by the
    signal, as it would have without the handler."""
    (tmp_path / "slow_command.py").write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path

        def main():
            partial = Path({str(tmp_path / "partial")!r})
            partial.write_text("half")
            try:
                time.sleep(60)
            finally:
                partial.unlink()
    """))
    script = "import sys; from cosyvoice_runtime.extras import run_console_script; " \
             "sys.path.insert(0, sys.argv[1]); run_console_script('slow', 'slow_command')"
    with subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stderr=subprocess.PIPE,
                          text=True) as command:
        started(command, tmp_path / "partial")
        command.send_signal(signal.SIGTERM)
        assert command.wait(10) == -signal.SIGTERM and command.stderr is not None
        assert command.stderr.read() == ""
    assert not (tmp_path / "partial").exists()


SLOW_COMMAND = """
import sys, time
from pathlib import Path

def main():
    partial = Path(sys.argv[1]) / "partial"
    partial.write_text("half")
    try:
        for _ in range(600):  # a progress bar's writes
            print("working", file=sys.stderr, flush=True)
            time.sleep(0.1)
    finally:
        print("removing the partial file", file=sys.stderr, flush=True)
        partial.unlink()
"""
"""A command that holds a temporary file and writes on stderr until it is stopped."""
RUN_SLOW = ("import sys; from cosyvoice_runtime.extras import run_console_script; "
            "sys.path.insert(0, sys.argv[1]); run_console_script('slow', 'slow_command')")


def test_a_closed_terminal_unwinds_a_command_so_that_its_cleanups_run(tmp_path: Path) -> None:
    """An ssh session or terminal window closed under a command: the kernel sends SIGHUP, and the terminal
    takes no more writes (EIO). The command unwinds as for SIGTERM, its cleanups writing nowhere, and ends by
    the signal."""
    (tmp_path / "slow_command.py").write_text(SLOW_COMMAND)
    terminal, attached = pty.openpty()

    def own_terminal() -> None:  # a login shell's child: the pty is its session's controlling terminal
        os.setsid()
        fcntl.ioctl(attached, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not a test runner's nohup, inherited

    with subprocess.Popen([sys.executable, "-c", RUN_SLOW, str(tmp_path)], stdin=attached, stdout=attached,
                          stderr=attached, preexec_fn=own_terminal) as command:
        os.close(attached)
        started(command, tmp_path / "partial")
        os.close(terminal)  # the hang-up
        assert command.wait(10) == -signal.SIGHUP
    assert not (tmp_path / "partial").exists()


def test_nohup_keeps_a_command_running_through_a_hang_up(tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored) a command goes on through a SIGHUP; SIGTERM still unwinds it."""
    (tmp_path / "slow_command.py").write_text(SLOW_COMMAND)
    with subprocess.Popen([sys.executable, "-c", RUN_SLOW, str(tmp_path)], stderr=subprocess.DEVNULL,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) as command:
        started(command, tmp_path / "partial")
        command.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            command.wait(1)
        command.send_signal(signal.SIGTERM)
        assert command.wait(10) == -signal.SIGTERM
    assert not (tmp_path / "partial").exists()


def interruptible() -> None:  # a process a background shell starts inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


INTERRUPTED_IMPORT = """
import _imp, importlib, os, signal, sys
from importlib.machinery import ExtensionFileLoader
from importlib.util import find_spec
import click

real = _imp.create_dynamic

def create_dynamic(spec, *args):  # the signal comes while an extension module initialises
    if spec.name == initialising:
        signal.raise_signal(getattr(signal, os.environ["SIGNAL"]))  # runs its handler at once
        print("initialised", spec.name, file=sys.stderr, flush=True)
    return real(spec, *args)

@click.command()
def main():
    global initialising
    candidates = ("_zoneinfo", "mmap", "_sqlite3", "_curses", "_dbm", "readline")  # not imported yet
    loaders = {n: getattr(find_spec(n), "loader", None) for n in candidates if n not in sys.modules}
    initialising = os.environ.get("EXTENSION") or next(
        n for n, loader in loaders.items() if isinstance(loader, ExtensionFileLoader))
    _imp.create_dynamic = create_dynamic
    try:
        importlib.import_module(os.environ.get("PACKAGE") or initialising)
    finally:
        print("unwound", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize(("signum", "package", "extension"), [
    (signal.SIGINT, "", ""), (signal.SIGTERM, "", ""),
    pytest.param(signal.SIGINT, "onnx", "onnx.onnx_cpp2py_export", marks=pytest.mark.skipif(
        find_spec("onnx") is None, reason="onnx is not installed (the export extra)"))])
def test_a_signal_during_an_extension_modules_initialisation_waits_for_its_end(
        tmp_path: Path, signum: signal.Signals, package: str, extension: str) -> None:
    """Ctrl-C or SIGTERM while a module of C++ initialises (onnx's crashed the process, also when the signal
    was raised once the module was created and before it was executed; onnxruntime's failed to import): the
    command unwinds and exits as ever, once the initialisation has ended."""
    (tmp_path / "slow_command.py").write_text(INTERRUPTED_IMPORT)
    script = RUN_SLOW.replace("sys.argv[1]", "sys.argv.pop(1)")  # the command's arguments: none
    env = os.environ | {"SIGNAL": signum.name, "PACKAGE": package, "EXTENSION": extension}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, preexec_fn=interruptible, env=env)
    status, end = (130, "\nAborted!\n") if signum == signal.SIGINT else (-signal.SIGTERM, "")
    assert done.returncode == status
    assert re.fullmatch(f"initialised [a-z_.0-9]+\nunwound\n{end}", done.stderr), done.stderr


def test_a_module_created_and_never_executed_holds_no_signal() -> None:
    """`module_from_spec` alone creates an extension module without executing it: Ctrl-C after it is
    Ctrl-C, not held for an execution that never comes; a handler a module sets as it initialises stays."""
    script = """
import _imp, importlib.util, signal, sys
from importlib.machinery import ExtensionFileLoader
from cosyvoice_runtime.extras import extension_inits_hold_signals

real = _imp.create_dynamic

def create_dynamic(spec, *args):
    signal.raise_signal(signal.SIGINT)
    return real(spec, *args)

def sets_its_own_handler(spec, *args):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return real(spec, *args)

candidates = ("_zoneinfo", "mmap", "_sqlite3", "_curses", "_dbm", "readline")
specs = [s for n in candidates if n not in sys.modules and (s := importlib.util.find_spec(n)) is not None]
spec = next(s for s in specs if isinstance(s.loader, ExtensionFileLoader))
with extension_inits_hold_signals():
    _imp.create_dynamic = sets_its_own_handler
    importlib.import_module(spec.name)
    print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _imp.create_dynamic = create_dynamic
    importlib.util.module_from_spec(spec)
    _imp.create_dynamic = real
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        print("interrupted")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          preexec_fn=interruptible)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\ninterrupted\n", "")


def test_ctrl_c_while_a_command_imports_is_aborted_and_130(tmp_path: Path) -> None:
    """Ctrl-C before the command has started (its modules importing): click's line and 130, no traceback."""
    (tmp_path / "slow_command.py").write_text("import signal\nsignal.raise_signal(signal.SIGINT)\n")
    done = subprocess.run([sys.executable, "-c", RUN_SLOW, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, preexec_fn=interruptible)
    assert (done.returncode, done.stderr) == (130, "\nAborted!\n")


def test_a_terminated_demo_stops_its_synthesis_too(tiny_bundle: Path, tmp_path: Path) -> None:
    """The demo runs cosyvoice-run as a process of its own: SIGTERM to the demo alone (a supervisor's, or
    `docker stop`'s) does not leave it running on."""
    child_pid = tmp_path / "child.pid"
    (tmp_path / "cosyvoice-run").write_text(
        f"#!{sys.executable}\nimport os, time\nopen({str(child_pid)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n")
    (tmp_path / "cosyvoice-run").chmod(0o755)
    script = textwrap.dedent("""
        import sys
        import cosyvoice_export.cli as cli
        import cosyvoice_export.onnx.bundle_assembly as assembly
        from cosyvoice_runtime.extras import run_console_script

        class Passed:
            passed, failures = True, []
            def table(self):
                return "exported"

        assembly.export_all = lambda *args, **kwargs: Passed()
        run, out = sys.argv[1:]
        cli.console_script = lambda name: run
        sys.argv = ["cosyvoice-export", "demo", "--out", out]
        run_console_script("cosyvoice-export", "cosyvoice_export.cli")
    """)
    env = {**os.environ, "COSYVOICE_MODEL_DIR": str(tiny_bundle)}
    with subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cosyvoice-run"),
                           str(tmp_path / "demo.wav")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          text=True) as demo:
        started(demo, child_pid)
        pid = int(child_pid.read_text())
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(10) == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):  # ended, and reaped by the demo
        os.kill(pid, 0)


def test_cosyvoice_runs_option_errors_are_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    nan = "error: Invalid value for '--speed': 'nan' is not a finite number"
    for args, line in ((["--text", "Hi."], "error: Missing option '--out'."), (["--speed", "nan"], nan)):
        monkeypatch.setattr(sys, "argv", ["cosyvoice-run", *args])
        with pytest.raises(SystemExit) as exit:
            run_console_script("cosyvoice-run", "cosyvoice_runtime.cli")
        assert exit.value.code == 2 and capsys.readouterr().err == f"{line}\n"
