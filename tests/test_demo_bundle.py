"""The embedded demo bundle and how `cosyvoice-run` chooses its bundle and prompt."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosyvoice_graphs.bundle_layout import FORMAT_VERSION, GRAPHS_DIR, MANIFEST
from cosyvoice_runtime import bundle_source
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV, MODEL_DIR_ENV, choose_bundle
from cosyvoice_runtime.cli import main
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UNREACHABLE, RuntimeBundleError, UserError


@pytest.mark.torch  # without torch, `runtime_bundle` is the demo bundle itself
def test_demo_bundle_equals_a_fresh_export(runtime_bundle: Path) -> None:
    """`cosyvoice-export demo-bundle` output is committed; it must still be what the exporter makes.

    Files must be byte-identical, except graphs, which may differ in bytes with other onnx/onnxslim
    versions, or with the CPU whose torch kernels computed a constant in float32 (the DiT's modulation
    table: up to 3.7e-6 apart between a Zen 5 and a Xeon with AMX), and must then give the same outputs
    on every validation case of their spec, to a few float32 roundings.
    """
    demo, fresh = RuntimeBundle.open(DEMO_BUNDLE, verify=True), RuntimeBundle.open(runtime_bundle)
    for key in ("model", "tables", "prompt", "frontend", "tokenizer", "sources"):
        assert getattr(demo.manifest, key) == getattr(fresh.manifest, key), key
    assert demo.manifest.files.keys() == fresh.manifest.files.keys()
    for rel, entry in demo.manifest.files.items():
        if entry.sha256 == fresh.manifest.files[rel].sha256:
            continue
        assert rel.startswith(f"{GRAPHS_DIR}/"), f"{rel} differs from a fresh export"
        name = Path(rel).stem
        s = demo.specs[name]
        ours, theirs = (ort.InferenceSession(str(b.graph_path(name)), providers=["CPUExecutionProvider"])
                        for b in (demo, fresh))
        for case in s.validate:
            feeds = s.sample_inputs(case)
            for a, b in zip(ours.run(None, feeds), theirs.run(None, feeds), strict=True):
                np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"{name} at {case.dims}")


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)


@pytest.mark.usefixtures("no_env")
def test_run_without_model_or_prompt_uses_the_demo_bundle(tmp_path: Path) -> None:
    out = tmp_path / "demo.wav"
    result = CliRunner().invoke(main, ["--text", "Hello there.", "--sampling", "greedy", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "model: the embedded demo bundle" in result.output
    assert "prompt: the bundle's zero_shot_prompt.wav" in result.output
    audio, sr = sf.read(str(out), dtype="float32")
    assert sr == 24000 and audio.size > 0 and audio.std() > 1e-3


@pytest.mark.usefixtures("no_env")
def test_info_prints_the_bundles_summary_without_text_or_out() -> None:
    result = CliRunner().invoke(main, ["--info"])
    assert result.exit_code == 0, result.output
    bundle = RuntimeBundle.open(DEMO_BUNDLE)
    lines = result.stdout.splitlines()
    assert lines[:6] == [
        f"bundle: {DEMO_BUNDLE}", f"format: cosyvoice3-runtime-bundle version {FORMAT_VERSION}",
        f"exported: {bundle.manifest.created} by {bundle.manifest.exporter_version}", "precision: fp32",
        f"llm checkpoint: llm.pt (sha256 {bundle.manifest.sources['llm.pt'].sha256})",
        "sample rate: 24000 Hz"]
    assert "llm_hidden=64" in result.stdout and "samples_per_frame=480" in result.stdout
    for name, s in bundle.specs.items():
        assert f"  {name}: fp32, spec version {s.version}, graphs/{name}.onnx, no TensorRT plan" in lines
    assert lines[-2:] == ["TensorRT plans: none (`cosyvoice-export all --trt` builds them)",
                          "providers: cpu, cuda, tensorrt, openvino"]
    missing = CliRunner().invoke(main, ["--out", "o.wav"])
    assert missing.exit_code == 2 and "Missing option '--text'" in missing.output


def test_model_dir_env_is_exported_once_into_the_cache(
        tiny_bundle: Path, runtime_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model bundle in $COSYVOICE_MODEL_DIR is exported on first use and reused while unchanged."""
    model = shutil.copytree(tiny_bundle, tmp_path / "model")
    exports: list[Path] = []

    def fake_export(model_dir: Path, out: Path, *_: Any) -> None:
        exports.append(Path(model_dir))
        shutil.copytree(runtime_bundle, out, dirs_exist_ok=True)

    monkeypatch.setattr(bundle_source, "_export", fake_export)
    monkeypatch.setenv(MODEL_DIR_ENV, str(model))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    first = choose_bundle(None, progress=False)
    assert first.default and "exported now" in first.origin and exports == [model.resolve()]
    assert first.path.is_relative_to(tmp_path / "cache") and RuntimeBundle.open(first.path)
    again = choose_bundle(None, progress=False)
    assert again.path == first.path and "exported earlier" in again.origin and len(exports) == 1
    (model / "NOTES.txt").write_text("mine")  # files no export reads: a git checkout's, notes
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert "exported earlier" in choose_bundle(None, progress=False).origin and len(exports) == 1
    (model / "flow.pt").touch()  # a changed model file (its mtime) means a new export
    assert bundle_source._stamp(model.resolve())["flow.pt"][1] == (model / "flow.pt").stat().st_mtime_ns
    assert "exported now" in choose_bundle(None, progress=False).origin and len(exports) == 2
    manifest = first.path / MANIFEST  # an export in an earlier format is made again
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"format_version": FORMAT_VERSION - 1}))
    assert "exported now" in choose_bundle(None, progress=False).origin and len(exports) == 3
    entry = json.loads(manifest.read_text())  # and so is one whose graph is at an earlier spec version
    entry["graphs"]["llm"]["spec_version"] = 0
    manifest.write_text(json.dumps(entry))
    assert "exported now" in choose_bundle(None, progress=False).origin and len(exports) == 4
    explicit = choose_bundle(runtime_bundle)
    assert explicit.path == runtime_bundle and not explicit.default


@pytest.mark.usefixtures("no_env")
def test_a_tampered_file_is_refused_before_anything_runs(tmp_path: Path) -> None:
    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    wav = bundle / "asset/zero_shot_prompt.wav"
    data = bytearray(wav.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    wav.write_bytes(bytes(data))
    args = ["--model", str(bundle), "--text", "Hi.", "--out", str(tmp_path / "o.wav")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and not (tmp_path / "o.wav").exists()
    assert result.output.startswith(f"error: {wav}: sha256 ") and "the manifest says" in result.output
    assert CliRunner().invoke(main, [*args, "--no-verify"]).exit_code == 0


@pytest.mark.parametrize(("samples", "rate", "message"), [
    (np.zeros(48000, np.float32), 48000,
     "is silent or nearly so (RMS level -inf dBFS); a prompt needs speech above -60 dBFS"),
    (np.full(24000, 2**-11, np.float32), 24000, "is silent or nearly so (RMS level -66.2 dBFS)"),
    (np.full(9000, 0.1, np.float32), 22050, "is too short (0.408 s); a prompt needs at least 0.5 s"),
    (np.full(12000, 0.1, np.float32), 11025, "has sample rate 11025 Hz; the minimum is 16000 Hz"),
    # a made-up rate sharing no factor with 16 kHz: its resampling kernel alone would take GBs
    (np.full(3000017, 0.1, np.float32), 3000017, "has sample rate 3000017 Hz; the maximum is 384000 Hz"),
    (np.full(16000 * 31, 0.1, np.float32), 16000, "lasts 31.00 s; the speech tokenizer takes at most 30 s"),
    (np.where(np.arange(24000) % 5000 == 7, np.inf, 0.1).astype(np.float32), 24000,
     "holds 5 sample(s) that are NaN or infinite; expected finite samples"),
    (np.where(np.arange(24000) == 7, np.nan, 0.1).astype(np.float32), 24000,
     "holds 1 sample(s) that are NaN or infinite"),
], ids=["silent", "near-silent", "short", "11 kHz", "3 MHz", "31 s", "infinite", "NaN"])
def test_a_bad_prompt_is_one_line_before_the_bundle_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, samples: np.ndarray, rate: int, message: str
) -> None:
    prompt = tmp_path / "prompt.wav"
    sf.write(prompt, samples, rate, subtype="FLOAT")  # float samples keep a NaN or an infinity
    opened: list[Path] = []
    monkeypatch.setattr(RuntimeBundle, "open", lambda path, **_: opened.append(path))
    out = tmp_path / "o.wav"
    result = CliRunner().invoke(main, ["--model", str(DEMO_BUNDLE), "--text", "Hi.", "--prompt-wav",
                                       str(prompt), "--prompt-text", "A transcript.", "--out", str(out)])
    assert result.exit_code == 2 and not out.exists() and opened == []
    assert result.output.startswith(f"error: audio file {prompt} {message}")
    assert result.output.count("\n") == 1


@pytest.mark.parametrize("option", ["--prompt-wav", "--out"])
def test_an_empty_path_is_named_as_one(tmp_path: Path, option: str) -> None:
    """Named as empty, not as the working folder `Path("")` is ("--out .: is a folder")."""
    prompt = DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav"
    args = {"--model": str(DEMO_BUNDLE), "--text": "Hi.", "--prompt-wav": str(prompt),
            "--prompt-text": "A transcript.", "--out": str(tmp_path / "o.wav"), option: ""}
    result = CliRunner().invoke(main, [word for pair in args.items() for word in pair])
    assert result.exit_code == 2 and not (tmp_path / "o.wav").exists()
    assert f"Invalid value for '{option}': an empty path; expected the name of a file" in result.output


@pytest.mark.usefixtures("no_env")
def test_a_folder_that_is_no_bundle_says_what_it_is(tmp_path: Path) -> None:
    """Missing, a file, a half-written export, or a folder of something else: each its own line."""
    half = tmp_path / "half"
    (half / GRAPHS_DIR).mkdir(parents=True)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "other").mkdir()
    expected = {
        tmp_path / "missing": "does not exist",
        tmp_path / "a-file": "is a file; a bundle is a folder",
        half: f"an incomplete export (graphs but no {MANIFEST}): run cosyvoice-export all --out {half} again",
        tmp_path / "other": f"neither a runtime bundle (no {MANIFEST}) nor a model bundle (no "
                            "cosyvoice3.yaml)",
    }
    for path, problem in expected.items():
        with pytest.raises(RuntimeBundleError) as refused:
            choose_bundle(path)
        assert str(refused.value) == f"{path} (--model): {problem}"
    result = CliRunner().invoke(main, ["--model", str(half), "--text", "Hi.", "--out",
                                       str(tmp_path / "o.wav")])
    assert result.exit_code == 2 and result.stderr == f"error: {half} (--model): {expected[half]}\n"


@pytest.mark.usefixtures("no_env")
def test_an_unreadable_bundle_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's folder, mode 700: one line, not a PermissionError (faked: root reads any folder)."""
    monkeypatch.setattr(bundle_source.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(RuntimeBundleError) as refused:
        choose_bundle(tmp_path)
    assert str(refused.value) == f"{tmp_path} (--model): cannot be read (permission denied)"


@pytest.mark.usefixtures("no_env")
def test_a_bundle_under_a_folder_it_cannot_enter_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A path inside another user's home (mode 700): Python 3.11's `Path.is_dir` raises there (faked: root
    enters any folder)."""
    hidden = tmp_path / "home" / "bundle"
    stat = os.stat

    def denied(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == str(hidden):
            raise PermissionError(13, "Permission denied", str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", denied)
    with pytest.raises(RuntimeBundleError) as refused:
        choose_bundle(hidden)
    assert str(refused.value) == f"{hidden} (--model): {UNREACHABLE}"


def test_a_tilde_in_a_variable_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .env file's value is not expanded by a shell; given as an option, quoted, it says so."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(MODEL_DIR_ENV, "~/nowhere")
    with pytest.raises(RuntimeBundleError) as missing:
        choose_bundle(None)
    assert str(missing.value) == f"{tmp_path / 'nowhere'} ($COSYVOICE_MODEL_DIR): does not exist"
    monkeypatch.setenv(CACHE_DIR_ENV, "~/cache")
    assert bundle_source.cache_root() == (tmp_path / "cache", "$COSYVOICE_CACHE_DIR")
    with pytest.raises(RuntimeBundleError) as refused:
        choose_bundle(Path("~/bundle"))
    assert str(refused.value) == ("~/bundle (--model): does not exist; a leading ~ is not expanded within "
                                  "quotes: give the home folder's path")


NO_HOME = "import pathlib\ndef home(): raise RuntimeError('Could not determine home directory.')\n" \
          "pathlib.Path.home = staticmethod(home)\n"
"""What Python does without $HOME for a user id the passwd database lacks (a container's `--user 12345`),
for a process of its own."""


def test_without_a_home_folder_the_default_places_say_what_sets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from cosyvoice_runtime.speakers import SPEAKERS_DIR_ENV, default_speakers_dir

    for variable in (CACHE_DIR_ENV, SPEAKERS_DIR_ENV, "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(variable, raising=False)
    def home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(home))
    no_home = f"no home folder (HOME is unset, and user {os.getuid()} has no entry in the passwd database)"
    with pytest.raises(UserError) as cache:
        bundle_source.cache_root()
    assert str(cache.value) == f"the export cache: {no_home}; set $COSYVOICE_CACHE_DIR to a folder for it"
    with pytest.raises(UserError) as speakers:
        default_speakers_dir()
    assert str(speakers.value) == (f"the speakers folder: {no_home}; give one with --speakers or "
                                   "$COSYVOICE_SPEAKERS_DIR")


@pytest.mark.skipif(find_spec("fastapi") is None, reason="needs the serve extra")
def test_the_servers_help_needs_no_home_folder() -> None:
    script = NO_HOME + "from cosyvoice_serve.cli import serve\nserve(['--help'])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.startswith("Usage: "), done.stderr


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize("xdg", [True, False])
def test_the_export_cache_is_named_by_what_chose_it(tiny_bundle: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, xdg: bool) -> None:
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the export ran"))
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    (tmp_path / "a-file").write_text("x")
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "a-file"))
    label = "$XDG_CACHE_HOME" if xdg else "~/.cache; $COSYVOICE_CACHE_DIR sets another"
    with pytest.raises(UserError, match=rf"^the export cache \({re.escape(label)}\) .*a-file is not a"):
        choose_bundle(tiny_bundle)


@pytest.mark.usefixtures("no_env")
def test_an_export_cache_it_cannot_write_is_refused_before_the_export(
        tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not after the line announcing minutes of export, in the export's own words."""
    monkeypatch.setattr(bundle_source, "_export", lambda *_, **__: pytest.fail("the export ran"))
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "a-file"))
    with pytest.raises(UserError, match=r"^the export cache \(\$COSYVOICE_CACHE_DIR\) .*a-file is not a"):
        choose_bundle(tiny_bundle)


@pytest.mark.torch
@pytest.mark.usefixtures("no_env")
def test_a_model_bundle_is_exported_once_saying_so_first(tiny_bundle: Path, tmp_path: Path) -> None:
    """cosyvoice-run on a model bundle: one line on stderr before the export, whose report goes to stderr
    too; stdout holds the run's own line."""
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path / "cache")}
    command = [sys.executable, "-m", "cosyvoice_runtime", "--model", str(tiny_bundle), "--text", "Hi.",
               "--sampling", "greedy", "--out", str(tmp_path / "o.wav")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"{tiny_bundle} (--model) is a model bundle: exporting it once into "
                            f"{tmp_path / 'cache'}") and "2.9 GB of disk" in first
    assert "validation" in done.stderr or "graph" in done.stderr  # the export's report
    assert done.stdout.startswith("wrote ") and len(done.stdout.splitlines()) == 1


@pytest.mark.torch
@pytest.mark.usefixtures("no_env")
def test_a_model_bundle_the_export_refuses_is_one_error_line(tiny_bundle: Path, tmp_path: Path) -> None:
    """The export's refusal, in the run's one line: not the export's line and then the run's."""
    model = shutil.copytree(tiny_bundle, tmp_path / "model")
    (model / "hift.pt").write_bytes(b"")
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path / "cache")}
    command = [sys.executable, "-m", "cosyvoice_runtime", "--model", str(model), "--text", "Hi.", "--out",
               str(tmp_path / "o.wav")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2 and not (tmp_path / "o.wav").exists()
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        f"error: exporting {model} (--model) failed: {model / 'hift.pt'}: the file is empty; expected a "
        "PyTorch checkpoint"]


def test_an_fp16_export_of_a_model_bundle_has_a_cache_folder_of_its_own(
        tiny_bundle: Path, runtime_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`AutoModel(model_dir, fp16=True)` on a GPU's provider: the model bundle is exported in a float16
    precision (fp16 under tensorrt), beside (not over) its fp32 export."""
    asked: list[tuple[Path, str]] = []

    def fake_export(model_dir: Path, out: Path, what: str, progress: bool, precision: str) -> None:
        asked.append((out, precision))
        shutil.copytree(runtime_bundle, out, dirs_exist_ok=True)

    monkeypatch.setattr(bundle_source, "_export", fake_export)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    fp32, fp16 = choose_bundle(tiny_bundle), choose_bundle(tiny_bundle, precision="fp16")
    assert [precision for _, precision in asked] == ["fp32", "fp16"]
    assert fp16.path.parent.name == f"{fp32.path.parent.name}-fp16"
