"""ci/gpu.sh, the script a session with a lent GPU runs in one call, run here on the CPU provider at the tiny
size (what its PROVIDER and SIZE are for; SCRIPT_CHECK: its tests collected, not run again): every step
passes, the exports beside the checks, the deadline skips what would start too late, a second call reuses
what the first exported, and STEPS selects the steps that run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra): the script exports bundles")
pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent


def _run(out: Path, work: Path, **env: str) -> list[str]:
    settings = {"PROVIDER": "cpu", "SIZE": "tiny", "SCRIPT_CHECK": "1", "GATES": "tf32 decode=fp16",
                "PRECISIONS": "fp32 decode=fp16", "STREAMS": "3", "WORK": str(work),
                "PYTHON": sys.executable, **env}
    done = subprocess.run(["bash", str(ROOT / "ci" / "gpu.sh"), str(out)], capture_output=True, text=True,
                          env={**os.environ, **settings}, timeout=900)
    assert done.returncode == 0, done.stderr
    return (out / "summary.txt").read_text().splitlines()


def test_the_gpu_script_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    work = tmp_path / "work"
    lines = _run(tmp_path / "out", work)
    steps = [line.split(":")[0] for line in lines[:-1]]
    # the model and the exports run in the background beside the checks: their lines interleave
    assert steps[0] == "gpu"
    assert sorted(steps[1:9]) == ["export-decode-fp16", "export-fp32", "gates-decode-fp16", "gates-tf32",
                                  "golden", "model", "tests", "tiny-model"]
    assert steps.index("model") < min(steps.index("export-fp32"), steps.index("export-decode-fp16"))
    assert steps.index("tiny-model") < steps.index("gates-tf32") < steps.index("gates-decode-fp16")
    assert steps[9:] == ["bench-fp32", "bench-decode-fp16", "nographs-decode-fp16", "stacking-fp32",
                         "stacking-decode-fp16", "vocstacking-fp32", "vocstacking-decode-fp16",
                         "streams3-decode-fp16", "stacked-streams3-decode-fp16", "profile-fp32",
                         "profile-decode-fp16",
                         "variants-decode-fp16", "rows4-decode-fp16", "rows16-decode-fp16",
                         "slots1-streams3-decode-fp16"]
    assert "nographs-decode-fp16: skipped, CUDA graphs are the cuda provider's" in lines
    assert all(": exit 0 after " in line for line in lines[:-1] if not line.startswith("nographs-")), lines
    # the tests step's tests exist (the suite runs them on the CPU; the script runs them where CUDA is)
    assert re.search(r"^\d\d+ tests collected in ", (tmp_path / "out" / "tests.log").read_text(), re.M)
    rows = json.loads((tmp_path / "out" / "rows4-decode-fp16.json").read_text())["profiles"][0]
    assert rows["graph"] == "llm_decode" and rows["precision"] == "fp16" and rows["shape"]["batch"] == 4
    variants = json.loads((tmp_path / "out" / "variants-decode-fp16.json").read_text())
    assert [run["rows"] for run in variants["runs"]] == [1, 4, 16]
    assert variants["runs"][2]["variants"]["bound once"]["max_abs_diff"] == 0
    (streams,) = json.loads((tmp_path / "out" / "streams3-decode-fp16.json").read_text())["concurrency"]
    assert streams["level"] == 3 and streams["batched"]["llm_tokens_per_s"] > 0
    assert streams["batched_window"]["audio_s_per_s"] > 0  # the batch on --flow-window all
    one_slot_run = json.loads((tmp_path / "out" / "slots1-streams3-decode-fp16.json").read_text())
    (one_slot,) = one_slot_run["concurrency"]
    assert one_slot["batched"]["chunk_slots"] == 1 and one_slot["batched"]["outputs_match"] is True
    stacked_run = json.loads((tmp_path / "out" / "stacked-streams3-decode-fp16.json").read_text())
    (stacked,) = stacked_run["concurrency"]
    assert stacked["dit_calls"] > 0 and stacked["batched"]["dit_calls"] > 0
    assert stacked["vocoder_calls"] > 0 and stacked["batched"]["vocoder_calls"] > 0
    # the vocoder's stacked rows: the decoder's rounding in another batch (3e-6 measured at 2 threads on a
    # Zen 4 with AVX-512); a stream given another's frames would be off by ~1e-1
    assert stacked["outputs_max_diff"] < 1e-4 and stacked["batched"]["outputs_max_diff"] < 1e-4
    stacking = json.loads((tmp_path / "out" / "stacking-fp32.json").read_text())
    assert [run["streams"] for run in stacking["runs"][:3]] == [1, 4, 16]
    assert all(run["max_abs_diff"] < 1e-5 for run in stacking["runs"])  # exact at 2 threads
    vocoder = json.loads((tmp_path / "out" / "vocstacking-fp32.json").read_text())
    assert [run["streams"] for run in vocoder["runs"][:3]] == [1, 4, 16]
    assert all(run["waveform_max_abs_diff"] < 1e-4 and run["phase_sum_max_abs_diff"] == 0
               for run in vocoder["runs"])
    result = json.loads((tmp_path / "out" / "bench-fp32.json").read_text())
    assert result["settings"]["provider"] == "cpu" and result["bundle"]["precision"] == "fp32"
    case = result["cases"][0]["runtime"]
    assert case["first_chunk_warm_cached_p95_s"] >= case["first_chunk_warm_cached_s"] > 0
    # a second call on the same machine: the model and the exports are reused; a deadline reached skips
    again = _run(tmp_path / "again", work, DEADLINE="0")
    assert again[0] == "gpu: skipped, 0 s deadline reached"
    assert all("skipped" in line for line in again[:-1])
    assert "model" not in "\n".join(again)
    # a step that could not run a quarter of its limit before the deadline does not start
    short = _run(tmp_path / "short", work, DEADLINE="60", STEPS="gpu tests")
    assert short[0].startswith("gpu: exit 0 after ")
    assert re.fullmatch(r"tests: skipped, \d+ s left before the deadline, under a quarter of its 300 s",
                        next(line for line in short if line.startswith("tests:")))
    # a later session picks the steps the earlier ones did not reach
    picked = _run(tmp_path / "picked", work, STEPS="gpu profile-*")
    ran = [line for line in picked[:-1] if "not selected" not in line]
    assert [line.split(":")[0] for line in ran] == ["gpu", "profile-fp32", "profile-decode-fp16"]
    assert all(": exit 0 after " in line for line in ran), ran
    assert "bench-fp32: not selected (STEPS)" in picked
