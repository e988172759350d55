"""The exporter's commands refuse a wrong model directory, precision, output or hub in one line before
torch and onnx load (seconds of imports, the same on every run): what a typo costs is the CLI's start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

from cosyvoice_runtime.cuda_device import cuda_device_name
from cosyvoice_runtime.demo import DEMO_BUNDLE

HEAVY = ("torch", "onnx")
PROBE = ("import atexit, sys\n"
         f"atexit.register(lambda: print('loaded:', *(m for m in {HEAVY!r} if m in sys.modules)))\n"
         "sys.argv[0] = 'cosyvoice-export'\n"
         "from cosyvoice_export.cli import main\n"
         "main()\n")
"""`cosyvoice-export ARGS`, then which of `HEAVY` it imported, on stdout (a refusal prints nothing there)."""


def refusal(*args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """The one error line of `cosyvoice-export ARGS` (exit status 2), and what it loaded of `HEAVY`."""
    run = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                         check=False, env=None if env is None else os.environ | env)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr)
    return lines[0], run.stdout.strip()


ALL_CASES = [
    (lambda b, t: ["--model-dir", str(t / "none")], "does not exist; expected a CosyVoice3 model directory"),
    (lambda b, t: ["--model-dir", str(DEMO_BUNDLE)], "a runtime bundle (already exported"),
    (lambda b, t: ["--model-dir", str(b), "--precision", "fp17"],
     "--precision: unknown precision or profile"),
    (lambda b, t: ["--model-dir", str(b), "--precision", "gpu-fp16", "--providers", "tensorrt"],
     "--providers tensorrt: a --precision gpu-fp16 bundle cannot run there"),
    (lambda b, t: ["--model-dir", str(b), "--llm", "rl"], "llm.rl.pt: file not found; --llm rl exports it"),
    (lambda b, t: ["--model-dir", str(b), "--reuse-from", str(t)],
     "not a runtime bundle with the records of `cosyvoice-export all`"),
    (lambda b, t: ["--model-dir", str(b), "--out", "/proc/out"], "/proc/out: cannot write there"),
]


@pytest.mark.parametrize(("args", "says"), ALL_CASES)
def test_export_all_refuses_before_torch_loads(args: Callable[[Path, Path], list[str]], says: str,
                                               tiny_bundle: Path, tmp_path: Path) -> None:
    line, loaded = refusal("all", "--out", str(tmp_path / "out"), *args(tiny_bundle, tmp_path))
    assert line.startswith("error: ") and says in line, line
    assert loaded == "loaded:", line


@pytest.mark.skipif(cuda_device_name() is not None, reason="a CUDA device is here: --trt goes on to TensorRT")
def test_export_all_trt_without_a_gpu_refuses_before_torch_loads(tiny_bundle: Path, tmp_path: Path) -> None:
    line, loaded = refusal("all", "--model-dir", str(tiny_bundle), "--out", str(tmp_path / "out"), "--trt")
    assert line == "error: --trt needs a CUDA device; the CUDA driver (libcuda.so.1) reports none"
    assert loaded == "loaded:"


@pytest.mark.parametrize("command", [["check-bundle"],
                                     ["synth", "--text", "hi", "--out", "x.wav", "--model-dir"]])
def test_a_missing_model_dir_is_refused_before_torch_loads(command: list[str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    line, loaded = refusal(*command, str(tmp_path / "none"))
    assert line == f"error: {tmp_path / 'none'}: does not exist; expected a CosyVoice3 model directory"
    assert loaded == "loaded:"


@pytest.mark.parametrize(("args", "says"), [
    (["--instruct", "Speak slowly."], "--instruct needs --mode instruct2 (zero-shot takes no instruction)"),
    (["--mode", "cross-lingual", "--prompt-text", "Hi."],
     "--prompt-text needs --mode zero-shot (cross-lingual takes no transcript)")])
def test_synth_refuses_what_its_mode_would_drop_before_torch_loads(args: list[str], says: str,
                                                                    tiny_bundle: Path, tmp_path: Path
                                                                    ) -> None:
    line, loaded = refusal("synth", "--model-dir", str(tiny_bundle), "--text", "Hello.", *args,
                           "--out", str(tmp_path / "o.wav"))
    assert line == f"error: {says}" and loaded == "loaded:"
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_its_model_dir_before_torch_loads(tmp_path: Path) -> None:
    line, loaded = refusal("demo", "--out", str(tmp_path / "demo.wav"),
                           env={"COSYVOICE_MODEL_DIR": str(tmp_path / "none")})
    assert line == (f"error: $COSYVOICE_MODEL_DIR: {tmp_path / 'none'}: does not exist; expected a "
                    "CosyVoice3 model directory")
    assert loaded == "loaded:"


def test_demo_bundle_refuses_an_out_it_cannot_write_before_torch_loads(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"")
    line, loaded = refusal("demo-bundle", "--out", str(tmp_path / "a.wav" / "demo"))
    assert line == f"error: --out {tmp_path / 'a.wav' / 'demo'}: {tmp_path / 'a.wav'} is not a folder"
    assert loaded == "loaded:"


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_tiny_bundle_refuses_a_seed_out_of_range_before_any_work(seed: str, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", PROBE, "tiny-bundle", str(tmp_path / "out"), "--seed", seed],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and f"Invalid value for '--seed': {seed} is not in the range" in run.stderr
    assert run.stdout.strip() == "loaded:" and not (tmp_path / "out").exists()


def test_download_that_cannot_reach_the_hub_says_so_before_torch_loads(tmp_path: Path) -> None:
    # offline, the hub is never asked: its address only names it in the line
    hub = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    line, loaded = refusal("download", str(tmp_path / "model"), env=hub)
    assert "offline mode is on (HF_HUB_OFFLINE)" in line
    assert loaded == "loaded:"


def test_speakers_judges_its_file_and_model_before_torch_loads(tmp_path: Path) -> None:
    import torch

    from cosyvoice_export.speakers import LEGACY_MAGIC, ZIP_HEAD

    assert LEGACY_MAGIC == torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")
    names = ("notes.pt", "empty.pt", "spk2info.pt", "none")
    not_torch, empty, zipped, none = (tmp_path / name for name in names)
    not_torch.write_text("hello, not a pickle\n")
    empty.write_bytes(b"")
    zipped.write_bytes(ZIP_HEAD + bytes(28))  # looks like torch.save's file: the model is judged next
    cases = {(str(not_torch),): f"{not_torch}: not a torch file (neither torch.save's zip archive nor its "
                                "legacy pickle); expected upstream's spk2info.pt",
             (str(empty),): f"{empty}: empty file; expected upstream's spk2info.pt",
             (str(zipped), "--model", str(none)): f"{none} (--model): does not exist"}
    for args, says in cases.items():
        line, loaded = refusal("speakers", *args, "--out", str(tmp_path / "speakers"))
        assert (line, loaded) == (f"error: {says}", "loaded:")
