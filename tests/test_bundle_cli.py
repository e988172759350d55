"""`cosyvoice-export tiny-bundle`, `check-bundle` and `manifest`: the bundle contract end to end."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import soundfile as sf
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from cosyvoice_export.bundle.checkpoint import to_float32
from cosyvoice_export.bundle.layout import CAMPPLUS, PROMPT_WAV, QWEN_DIR, SPEECH_TOKENIZER, YAML
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.bundle.tiny import write_bundle
from cosyvoice_export.cli import main
from cosyvoice_export.manifest import build_network
from cosyvoice_runtime.demo import DEMO_BUNDLE

MANIFESTS = Path(__file__).parent / "data" / "upstream_manifest"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("network", ["llm", "flow", "hift"])
def test_manifest_command_equals_upstream_manifest(network: str) -> None:
    code, out, _ = run("manifest", "--size", "full", "--network", network)
    assert code == 0
    assert out == (MANIFESTS / f"{network}.tsv").read_text()


def test_manifest_all_tiny_has_every_network() -> None:
    code, out, _ = run("manifest", "--size", "tiny")
    assert code == 0
    headers = [line for line in out.splitlines() if line.startswith("#")]
    assert headers == ["# llm.pt", "# flow.pt", "# hift.pt"]
    assert "llm.model.model.embed_tokens.weight\t[832, 64]\tfloat32" in out


def test_tiny_bundle_round_trips_through_check_bundle(tiny_bundle: Path) -> None:
    code, out, err = run("check-bundle", str(tiny_bundle))
    assert code == 0, err
    for name in (YAML, "llm.pt", "flow.pt", "hift.pt", CAMPPLUS, SPEECH_TOKENIZER):
        assert f"ok  {name}" in out
    assert out.rstrip().endswith("bundle ok")


def test_every_file_of_a_tiny_bundle_has_a_new_files_mode(tiny_bundle: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(tiny_bundle).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in tiny_bundle.rglob("*") if p.is_file()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


@pytest.mark.parametrize("network", ["llm", "flow", "hift"])
def test_a_loaded_network_skips_only_the_random_draws(tiny_bundle: Path, network: str) -> None:
    """`load_network` builds without drawing initial weights: every tensor, parameter or buffer, is what a
    network built with its draws holds after the same strict load, and a network built so and never loaded
    keeps no draw (its parameters are not those of a built one)."""
    bundle = ModelBundle.open(tiny_bundle)
    loaded = bundle.load_network(network)
    drawn = build_network(bundle.config, network)
    drawn.load_state_dict(to_float32(bundle.read_checked_state(network)), strict=True)
    for (name, got), (_, want) in zip(loaded.state_dict(keep_vars=True).items(),
                                      drawn.state_dict(keep_vars=True).items(), strict=True):
        assert torch.equal(got, want), name
    for (name, got), (_, want) in zip(loaded.named_buffers(), drawn.named_buffers(), strict=True):
        assert torch.equal(got, want), name
    torch.manual_seed(0)
    first = dict(build_network(bundle.config, network).named_parameters())
    torch.manual_seed(0)
    again = dict(build_network(bundle.config, network, random_init=False).named_parameters())
    torch.manual_seed(0)
    assert all(torch.equal(p, first[k]) for k, p in build_network(bundle.config, network).named_parameters())
    assert not all(torch.equal(p, first[k]) for k, p in again.items())


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_bundle: Path, tmp_path: Path) -> None:
    again = write_bundle(tmp_path / "again", seed=0)
    other = write_bundle(tmp_path / "other", seed=1)
    assert _digest(again) == _digest(tiny_bundle)
    a, b = _digest(tiny_bundle), _digest(other)
    assert a["llm.pt"] != b["llm.pt"] and a["flow.pt"] != b["flow.pt"] and a["hift.pt"] != b["hift.pt"]
    assert a[YAML] == b[YAML]


def test_existing_output_needs_force(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    out.mkdir()
    code, _, err = run("tiny-bundle", str(out))
    assert code == 2
    assert err.strip() == f"error: {out}: already exists; pass --force to replace it"
    assert list(out.iterdir()) == []  # untouched, and no temp dir left beside it
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_a_bundle_another_process_wrote_meanwhile_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Two writers at once (two first demos): the second's bundle does not replace the first's, which that
    one may be exporting from already."""
    import cosyvoice_export.bundle.tiny as tiny

    out = tmp_path / "b"
    write = tiny._write

    def meanwhile(tmp: Path, *args: object) -> None:
        out.mkdir()
        (out / "theirs").write_text("finished")
        write(tmp, *args)

    monkeypatch.setattr(tiny, "_write", meanwhile)
    with pytest.raises(FileExistsError, match="already exists \\(written while this one was\\)"):
        write_bundle(out)
    assert [p.name for p in tmp_path.iterdir()] == ["b"] and [p.name for p in out.iterdir()] == ["theirs"]


def test_force_replaces_only_a_model_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--force never deletes a folder it did not write: a folder of other files, a stray file in a bundle,
    the working folder (or one holding it) are refused in one line, untouched; a bundle it wrote, or an empty
    folder, is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = run("tiny-bundle", str(mine), "--force")
    assert code == 2 and err == (f"error: {mine}: not a model bundle tiny-bundle wrote (it holds notes.txt); "
                                 "--force replaces only such a bundle: choose another OUT, or remove it "
                                 "yourself\n")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    monkeypatch.chdir(mine)
    for out in (".", str(tmp_path)):
        code, _, err = run("tiny-bundle", out, "--force")
        assert code == 2 and err == (f"error: {out}: is the working folder or holds it; name a folder of the "
                                     "bundle's own\n"), err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    bundle = tmp_path / "bundle"
    assert run("tiny-bundle", str(bundle))[0] == 0
    (bundle / "llm.pt").write_bytes(b"damaged")
    code, out, err = run("tiny-bundle", str(bundle), "--force")
    assert code == 0, err
    assert run("check-bundle", str(bundle))[0] == 0
    (bundle / "mine.txt").write_text("mine")
    code, _, err = run("tiny-bundle", str(bundle), "--force")
    assert code == 2 and "(it holds mine.txt)" in err and (bundle / "mine.txt").is_file()


def test_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cosyvoice_export.bundle.tiny as tiny_mod

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_mod, "write_standin_onnx", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_bundle(tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
import cosyvoice_export.bundle.tiny as tiny

def killed(tmp, *args):
    (tmp / "llm.pt").write_bytes(bytes(1 << 20))
    os.kill(os.getpid(), signal.SIGKILL)

tiny._write = killed
tiny.write_bundle(Path(sys.argv[1]))
"""
HELD_WRITE = """
import sys
from pathlib import Path
import cosyvoice_export.bundle.tiny as tiny

with tiny._working_folder(Path(sys.argv[1])) as tmp:
    print(tmp.name, flush=True)
    sys.stdin.read()
"""


def test_a_write_killed_outright_leaves_a_folder_the_next_write_removes(tmp_path: Path) -> None:
    """kill -9 in the middle of a write leaves its hidden working folder (a full bundle's is 4.2 GB); the
    next write into the same OUT says so and removes it, and leaves the folder of a write still at work."""
    out = tmp_path / "b"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(out)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".b.") and left.name.endswith(".partial") and (left / "llm.pt").is_file()

    with subprocess.Popen([sys.executable, "-c", HELD_WRITE, str(out)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as working:
        assert working.stdout is not None and working.stdin is not None
        held = tmp_path / working.stdout.readline().strip()
        code, _, err = run("tiny-bundle", str(out))
        assert code == 0, err
        assert f"removing {left}: an unfinished bundle of a write that was killed\n" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", held.name])
        working.stdin.close()
    assert working.returncode == 0


@pytest.fixture
def bundle_copy(tiny_bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, dst)
    return dst


def _resave(path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    state = torch.load(path, weights_only=True)
    torch.save(edit(state), path)


def _poison(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bias = state["conv_post.bias"].clone()
    bias[:2] = torch.tensor([float("nan"), float("inf")])
    return {**state, "conv_post.bias": bias}


def test_upstream_variants_pass(bundle_copy: Path) -> None:
    """What upstream's own files may look like: bf16/fp16 storage, legacy weight norm with `generator.`,
    a training checkpoint's extra scalars."""
    _resave(bundle_copy / "llm.pt", lambda s: {k: v.to(torch.bfloat16) for k, v in s.items()})
    _resave(bundle_copy / "flow.pt", lambda s: {**{k: v.half() for k, v in s.items()}, "epoch": 3, "step": 9})

    def legacy(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in s.items():
            k = k.replace("parametrizations.weight.original0", "weight_g")
            k = k.replace("parametrizations.weight.original1", "weight_v")
            out[f"generator.{k}"] = v
        return out

    _resave(bundle_copy / "hift.pt", legacy)
    code, out, err = run("check-bundle", str(bundle_copy))
    assert code == 0, err
    assert "llm.pt: 29 tensors" in out and "bfloat16" in out
    bundle = ModelBundle.open(bundle_copy)
    hift = bundle.load_network("hift")
    assert next(hift.parameters()).dtype == torch.float32


def _break_yaml_flow(root: Path) -> None:
    text = (root / YAML).read_text()
    start = text.index("\nflow:")
    end = text.index("\nhift:")
    (root / YAML).write_text(text[:start] + text[end:])


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _without(state: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != key}


def _reshape_key(root: Path) -> None:
    key = "decoder.estimator.proj_out.weight"
    _resave(root / "flow.pt", lambda s: {**s, key: torch.zeros(80, 7)})


_INT_DECODER = torch.zeros(6761, 64, dtype=torch.int32)

CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("missing hift", lambda r: (r / "hift.pt").unlink(), "{root}/hift.pt: file not found"),
    ("missing yaml", lambda r: (r / YAML).unlink(), "{root}/cosyvoice3.yaml: file not found"),
    ("missing campplus", lambda r: (r / CAMPPLUS).unlink(), "{root}/campplus.onnx: file not found"),
    ("missing vocab", lambda r: (r / QWEN_DIR / "vocab.json").unlink(),
     "{root}/CosyVoice-BlankEN/vocab.json: file not found"),
    ("truncated llm", lambda r: _truncate(r / "llm.pt"), "{root}/llm.pt: not a readable PyTorch checkpoint"),
    ("text as checkpoint", lambda r: (r / "flow.pt").write_text("hello"),
     "{root}/flow.pt: not a readable PyTorch checkpoint"),
    ("empty checkpoint", lambda r: (r / "flow.pt").write_bytes(b""),
     "{root}/flow.pt: the file is empty; expected a PyTorch checkpoint"),
    ("safetensors checkpoint", lambda r: save_file({"w": torch.zeros(2)}, r / "hift.pt"),
     "{root}/hift.pt: a safetensors file; expected a PyTorch checkpoint (torch.save)"),
    ("folder as checkpoint", lambda r: ((r / "llm.pt").unlink(), (r / "llm.pt").mkdir()),
     "{root}/llm.pt: not a file"),
    ("list checkpoint", lambda r: torch.save([1, 2], r / "hift.pt"),
     "{root}/hift.pt: expected a dict, found list"),
    ("no flow entry", _break_yaml_flow, "{root}/cosyvoice3.yaml"),
    ("shape mismatch", _reshape_key,
     "{root}/flow.pt: decoder.estimator.proj_out.weight has shape [80, 7], expected [80, 64]"),
    ("missing key", lambda r: _resave(r / "llm.pt", lambda s: _without(s, "llm.model.model.norm.weight")),
     "{root}/llm.pt: missing key llm.model.model.norm.weight"),
    ("unexpected key", lambda r: _resave(r / "llm.pt", lambda s: {**s, "llm_decoder.bias": torch.zeros(9)}),
     "{root}/llm.pt: unexpected key llm_decoder.bias"),
    ("int tensor", lambda r: _resave(r / "llm.pt", lambda s: {**s, "llm_decoder.weight": _INT_DECODER}),
     "{root}/llm.pt: llm_decoder.weight has dtype int32"),
    ("nan weights", lambda r: _resave(r / "hift.pt", _poison),
     "{root}/hift.pt: conv_post.bias holds 2 NaN or infinite values of 18;"),
    ("garbage onnx", lambda r: (r / SPEECH_TOKENIZER).write_bytes(b"\x00garbage"),
     "{root}/speech_tokenizer_v3.onnx: not a readable ONNX model"),
    ("swapped onnx", lambda r: shutil.copy(r / CAMPPLUS, r / SPEECH_TOKENIZER),
     "{root}/speech_tokenizer_v3.onnx: expected 2 inputs"),
    ("junk prompt", lambda r: (r / PROMPT_WAV).write_bytes(bytes(range(100))),
     "cannot read audio file {root}/asset/zero_shot_prompt.wav: "),
    ("silent prompt", lambda r: sf.write(r / PROMPT_WAV, np.zeros(24000), 24000),
     "audio file {root}/asset/zero_shot_prompt.wav is silent or nearly so"),
]


def test_a_checkpoint_in_torchs_legacy_format_is_read(bundle_copy: Path) -> None:
    """torch.save's format from before its zip one, which upstream's torch.load reads too."""
    state = torch.load(bundle_copy / "hift.pt", weights_only=True)
    torch.save(state, bundle_copy / "hift.pt", _use_new_zipfile_serialization=False)
    code, _, err = run("check-bundle", str(bundle_copy))
    assert code == 0, err


@pytest.mark.parametrize("breakage,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_bundles_give_one_line_and_status_2(bundle_copy: Path, breakage: Callable[[Path], None],
                                                expected: str) -> None:
    breakage(bundle_copy)
    code, _, err = run("check-bundle", str(bundle_copy))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: " + expected.format(root=bundle_copy)), lines[0]
    assert "Traceback" not in err


def test_not_a_directory(tmp_path: Path) -> None:
    code, _, err = run("check-bundle", str(tmp_path / "nope"))
    assert code == 2
    expected = f"error: {tmp_path / 'nope'}: does not exist; expected a CosyVoice3 model directory"
    assert err.strip() == expected
    (tmp_path / "file").write_text("")
    code, _, err = run("check-bundle", str(tmp_path / "file"))
    assert code == 2
    assert err.strip() == (f"error: {tmp_path / 'file'}: not a directory; "
                           "expected a CosyVoice3 model directory")


def test_a_runtime_bundle_is_named_as_one(tmp_path: Path) -> None:
    """A runtime bundle where a model directory is wanted (`$COSYVOICE_MODEL_DIR` names either for
    cosyvoice-run) is said to be one, before any other file is looked for."""
    code, _, err = run("check-bundle", str(DEMO_BUNDLE))
    assert code == 2
    assert err.strip() == (f"error: {DEMO_BUNDLE}: a runtime bundle (already exported: run it with "
                           f"`cosyvoice-run --model {DEMO_BUNDLE}` or cosyvoice-serve); this command reads a "
                           "model directory (cosyvoice3.yaml, llm.pt, CosyVoice-BlankEN/, ...)")
    for value in (str(DEMO_BUNDLE), str(tmp_path / "nope")):  # the demo judges the folder before its prompt
        result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo.wav")],
                                    env={"COSYVOICE_MODEL_DIR": value})
        code, err = result.exit_code, result.stderr
        assert code == 2 and err.startswith(f"error: $COSYVOICE_MODEL_DIR: {value}: "), err
        assert "prompt" not in err and not (tmp_path / "demo.wav").exists()


def test_demo_takes_a_blank_model_dir_variable_for_unset(tiny_bundle: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As cosyvoice-run and cosyvoice-serve read $COSYVOICE_MODEL_DIR: blank is the default bundle."""
    import cosyvoice_export.cli as export_cli
    import cosyvoice_export.onnx.bundle_assembly as bundle_assembly
    from cosyvoice_export.bundle.errors import BundleError

    exported: list[Path] = []

    def export_all(model_dir: Path, *_: object, **__: object) -> None:
        exported.append(model_dir)
        raise BundleError("stopped before the export")

    monkeypatch.setattr(export_cli, "DEFAULT_DEMO_BUNDLE", tiny_bundle)
    monkeypatch.setattr(bundle_assembly, "export_all", export_all)
    for blank in ("", "   "):
        result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo.wav")],
                                    env={"COSYVOICE_MODEL_DIR": blank})
        assert result.exit_code == 2 and result.stderr == "error: stopped before the export\n", result.output
    assert exported == [tiny_bundle, tiny_bundle]


def test_a_write_that_fails_midway_through_an_export_is_one_line(tiny_bundle: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk, a file-size limit: onnx's writes name no file, numpy's say neither file nor cause."""
    import cosyvoice_export.onnx.bundle_assembly as bundle_assembly

    out = tmp_path / "out"
    for error, line in ((OSError(28, "No space left on device"), f"error: {out}: No space left on device"),
                        (OSError("432704 requested and 255968 written"),
                         f"error: {out}: a write stopped short (432704 requested and 255968 written): a full "
                         "disk or a file-size limit (ulimit -f)")):

        def assemble(*_: object, error: OSError = error, **__: object) -> None:
            raise error

        monkeypatch.setattr(bundle_assembly, "assemble", assemble)
        result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out)])
        assert (result.exit_code, result.stderr) == (2, f"{line}\n"), result.output


def test_model_dir_is_spelt_either_way(tiny_bundle: Path) -> None:
    """check-bundle and download take MODEL_DIR as an argument or as --model-dir, as `all` names it."""
    for args in ([str(tiny_bundle)], ["--model-dir", str(tiny_bundle)]):
        done = CliRunner().invoke(main, ["check-bundle", *args])
        assert done.exit_code == 0 and done.output.endswith(f"{tiny_bundle}: bundle ok\n"), done.output
    both = CliRunner().invoke(main, ["check-bundle", str(tiny_bundle), "--model-dir", "other"])
    assert both.exit_code == 2 and f"MODEL_DIR {tiny_bundle} and --model-dir other: give one" in both.output
    assert "Missing MODEL_DIR (or --model-dir)." in CliRunner().invoke(main, ["check-bundle"]).output
