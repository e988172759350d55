"""`cosyvoice-bench` on the tiny bundle: the pinned LLM step count, a quick run of the runtime alone without
torch, and bad input (test_bench_vs_torch runs it beside the torch reference). No timing assertions: only
that every figure is there, with the right type and a sane value."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from click.testing import CliRunner

from cosyvoice_bench.cases import make_cases
from cosyvoice_bench.cli import main
from cosyvoice_bench.errors import BenchError
from cosyvoice_bench.graph_calls import ANY
from cosyvoice_bench.measure import batch_llm_calls, llm_figures
from cosyvoice_bench.peak_rss import PeakJob, fresh_peak
from cosyvoice_bench.report import FIGURE_KEYS
from cosyvoice_bench.report import _outputs as outputs_cell
from cosyvoice_bench.runtime_runs import RuntimeBackend
from cosyvoice_graphs import DIT, FLOW_ENCODER, HIFT_DECODER, HIFT_F0, LLM
from cosyvoice_graphs.bundle_layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_runtime import synthesis
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.extras import INTERRUPTED, run_console_script
from cosyvoice_runtime.llm import LlmRequest, SpeechTokenLM
from cosyvoice_runtime.process_memory import rss_bytes
from cosyvoice_runtime.sampling import SilentTokenLimiter
from cosyvoice_runtime.synthesis import Synthesizer

PINNED = 37

# --- the pinned step count ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm(runtime_bundle: Path) -> Iterator[SpeechTokenLM]:
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as synth:
        yield synth.lm


def pinned_request(lm: SpeechTokenLM) -> LlmRequest:
    return LlmRequest(text_ids=(5, 6, 7, lm.endofprompt_id), prompt_text_ids=(8, 9),
                      prompt_speech_tokens=(11, 12, 13, 14))


class StopFirst:
    """Picks eos whenever it may, else the argmax: decoding ends at once unless the stop ids are masked."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def __call__(self, logp: Any, history: Sequence[int]) -> int:
        scores = np.asarray(logp)
        return self.eos if np.isfinite(scores[self.eos]) else int(np.argmax(scores))


def test_pinned_decoding_runs_exactly_n_steps_without_stop_ids(lm: SpeechTokenLM) -> None:
    eos = lm.speech_token_size + 1
    default = lm.decode(pinned_request(lm), StopFirst(eos), max_tokens=PINNED)
    assert default.run() == [] and default.steps == 1 and default.stop_id == eos  # unchanged by default
    pinned = lm.decode(pinned_request(lm), StopFirst(eos), max_tokens=PINNED, ignore_stop=True)
    tokens = pinned.run()
    assert pinned.steps == len(pinned.history) == PINNED and pinned.stop_id is None
    assert max(pinned.history) < lm.speech_token_size
    limiter = SilentTokenLimiter()
    assert tokens == [t for t in pinned.history if limiter.keep(t)]


# --- the benchmark -------------------------------------------------------------------------------------


def bench_args(runtime_bundle: Path, out: Path) -> list[str]:
    return ["--model", str(runtime_bundle), "--quick", "--threads", "1", "--json", str(out), "--no-progress"]


POLICY_KEYS = {key for key in FIGURE_KEYS if key.startswith("first_chunk_policy_")}
WINDOW_KEYS = {"rtf_stream_policy", "stream_final_wait_policy_s"}
TEXT_STREAM_KEYS = {"first_chunk_text_stream_s", "first_chunk_text_stream_words"}


def check_figures(figures: dict[str, Any], pinned: int, *, torch_side: bool, policy: bool = False,
                  window: bool = False) -> None:
    assert set(figures) == set(FIGURE_KEYS)
    absent = {"gpu_memory_peak_mib", "gpu_utilization_mean_pct"} | (
        {"rtf_stream", "stream_final_wait_s", *TEXT_STREAM_KEYS} if torch_side else set())
    absent |= set() if policy and not torch_side else POLICY_KEYS
    absent |= set() if window and not torch_side else WINDOW_KEYS
    for key, value in figures.items():
        if key in absent:
            assert value is None, key
        else:
            assert isinstance(value, int | float) and not isinstance(value, bool) and value > 0, (key, value)
    assert figures["llm_steps"] == pinned and 0 < figures["speech_tokens"] <= pinned
    assert figures["first_chunk_audio_s"] <= figures["audio_s"]
    stages = sum(figures[f"first_chunk_{stage}_s"] for stage in ("llm", "flow", "vocoder"))
    assert stages <= figures["first_chunk_warm_cached_s"]  # the front end and chunking are the rest
    assert figures["audio_s"] == pytest.approx(figures["speech_tokens"] * 2 * 480 / 24000)
    # the fresh process's, all three
    assert figures["rss_baseline_mib"] < figures["rss_after_mib"] <= figures["peak_rss_mib"]


def check_common(result: dict[str, Any], lengths: list[str], levels: list[int], *, threads: int = 1,
                 policy: bool = False, window: bool = False) -> None:
    assert result["schema"] == "cosyvoice-bench/1" and result["settings"]["lengths"] == lengths
    assert result["settings"]["cuda_graphs"] is result["settings"]["dit_graphs"] is False  # the CPU's
    machine = result["machine"]
    assert machine["threads"] == threads and machine["memory_bandwidth_gbs"] > 0 and machine["onnxruntime"]
    assert set(machine["vector_features"]) == {"AVX2", "AVX-512", "VNNI", "BF16", "AMX"}
    assert machine["cpu_class"] and result["cpu_class"] == machine["cpu_class"]
    assert machine["openvino"] == (version("openvino") if find_spec("openvino") else None)
    assert [c["length"] for c in result["cases"]] == lengths
    for case in result["cases"]:
        assert case["cpu_class"] == machine["cpu_class"]
        bounds = case["bounds"]
        assert bounds["threads"] == threads and bounds["dit_precision"] == bounds["llm_precision"] == "fp32"
        assert bounds["int8_matmul_gflops"] is None and bounds["dit_rate"] == "float32 MatMul"
        for key in ("llm_bytes_per_token", "llm_bound_s_per_token", "llm_fraction_runtime", "frames",
                    "dit_flops_per_step", "matmul_gflops", "dit_bound_s_per_step", "dit_fraction_runtime",
                    "hift_frames", "hift_flops", "hift_bound_s", "hift_fraction_runtime"):
            assert bounds[key] > 0, key
        check_figures(case["runtime"], case["pinned_tokens"], torch_side=False, policy=policy, window=window)
    assert [r["level"] for r in result["concurrency"]] == levels
    for row in result["concurrency"]:
        assert row["shared_synthesizer"] is True and row["outputs_match"] is True
        assert row["outputs_max_diff"] == 0 and row["tokens_match"] is True
        assert row["wall_s"] > 0 and row["audio_s"] > 0 and row["first_chunk_max_s"] > 0
        assert row["first_chunk_mean_s"] <= row["first_chunk_p95_s"] <= row["first_chunk_max_s"]
        assert row["llm_tokens_per_s"] > 0
        graphs = row["graphs"]  # where the wall went: every graph the sessions ran, each call once
        assert {FLOW_ENCODER, DIT, HIFT_F0, HIFT_DECODER} <= set(graphs)
        assert any(g.startswith(LLM) for g in graphs)
        assert graphs[ANY]["calls"] == sum(f["calls"] for g, f in graphs.items() if g != ANY)
        assert all(0 < f["share"] <= graphs[ANY]["share"] <= 1 for f in graphs.values())
        assert row["batched"] is None  # the bundle has no llm_decode: no decode batch
        if row["level"] == 1:
            assert row["warm_up"] is None
        else:  # an unmeasured round at that level first, its own figures kept
            assert row["warm_up"]["wall_s"] > 0 and row["warm_up"]["outputs_match"] is True
    levers = result["levers"]["onnxruntime"]
    assert len(levers) == 2 * 4 * 2 and all(r["seconds_per_call"] > 0 for r in levers)
    assert sorted(r["graph"] for r in levers if r["runtime_default"]) == ["flow_estimator_cached", "llm"]
    assert {e["lever"] for e in result["levers"]["export"]} and "gpu" in result["notes"]
    assert set(result["first_use"]) == ({"runtime", "torch"} if result["settings"]["model_dir"] else
                                        {"runtime"})


_BLOCK_TORCH = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchaudio", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _Block())
"""


def test_quick_run_of_the_runtime_without_torch(runtime_bundle: Path, tmp_path: Path) -> None:
    """With the DiT's calls stacked: the sessions' audio still matches a single stream's, and the concurrency
    table says how many streams a DiT call served. With `--flow-window`, each case is streamed on it too (on
    upstream's schedule, beside `--first-chunk-tokens`' first chunk)."""
    out = tmp_path / "bench.json"  # the prompt: the bundle's own
    args = [*bench_args(runtime_bundle, out), "--lengths", "long", "--concurrency", "1,2", "--stack-dit",
            "--flow-window", "all", "--first-chunk-tokens", "10"]
    script = _BLOCK_TORCH + textwrap.dedent(f"""
        from cosyvoice_bench.cli import main
        try:
            main({args!r})
        finally:
            leaked = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
            assert not leaked, leaked
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RTF offline" in done.stdout and "first chunk, cold, cached prompt" in done.stdout
    result = json.loads(out.read_text())
    check_common(result, ["long"], [1, 2], policy=True, window=True)
    assert result["settings"]["flow_window"] == "all" and result["settings"]["first_chunk_tokens"] == 10
    assert "on upstream's chunk schedule" in result["notes"]["stream_policy"]
    assert "first_chunk_policy" in result["notes"]
    assert "RTF streaming, --flow-window" in done.stdout
    assert Path(result["settings"]["prompt_wav"]) == runtime_bundle / PROMPT_WAV
    case = result["cases"][0]
    assert case["torch"] is None and case["speedup"] is None and case["same_speech_tokens"] is None
    assert case["pinned_tokens"] == 50  # --quick's: a chunk and the final one
    assert result["thread_scaling"] is None and result["plots"] == []  # off with --quick, and not asked
    assert result["settings"]["stack_dit"] is True and "DiT streams/call" in done.stdout
    assert "where the sessions' wall went" in done.stdout
    one, two = result["concurrency"]
    assert one["dit_streams_per_call"] == 1 and one["dit_calls"] > 0
    assert 1 <= two["dit_streams_per_call"] <= 2 and two["dit_calls"] > 0


def test_a_batched_decodings_steps_are_timed_by_their_period() -> None:
    calls = batch_llm_calls(1.0, [0.3, 0.4, 0.5, 0.6])  # the prefill's log-probs at 0.3, then a step each 0.1
    assert calls == pytest.approx([0.7, 0.1, 0.1, 0.1])
    figures = llm_figures(1.0, calls)
    assert figures["llm_steps"] == 4 and figures["llm_prefill_s"] == pytest.approx(0.7)
    assert figures["llm_per_token_s"] == pytest.approx(0.1)
    assert batch_llm_calls(0.5, [0.2]) == [0.5] and batch_llm_calls(0.5, []) == []


def test_the_concurrency_table_says_how_sessions_differ_from_a_single_stream() -> None:
    row = {"outputs_match": False, "outputs_max_diff": 3e-6, "tokens_match": True}
    assert outputs_cell({**row, "outputs_match": True}) == "yes"
    assert outputs_cell(row) == "NO (max 0.000003)"  # the same ids, another rounding
    moved = {**row, "tokens_match": False}
    assert outputs_cell({**moved, "outputs_max_diff": 0.85}) == "NO (max 0.850; tokens differ)"
    assert outputs_cell({**moved, "outputs_max_diff": None}) == "NO (lengths; tokens differ)"


def test_the_runtimes_runs_are_unbatched_unless_a_level_batches_them(fp32_decode_bundle: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the runtime would batch by default (cuda), the bench's single streams and unbatched sessions
    still decode alone: its concurrency levels batch them themselves."""
    monkeypatch.setattr(synthesis, "default_max_batch", lambda bundle, provider: 4)
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    runtime = RuntimeBackend(bundle, provider="cpu", threads=1, prompt_text="", seed=0)
    try:
        assert runtime.voice.synth.batcher is None
    finally:
        runtime.close()


def test_offline_llm_figures_with_the_decodings_in_a_batch(fp32_decode_bundle: Path) -> None:
    """Where a decode batch makes the LLM's calls (as `--cuda-graphs` does, in a batch of one) the offline
    run still reports the prefill and the time per step: timed by when each call's log-probs reach the
    decoding."""
    bundle = RuntimeBundle.open(fp32_decode_bundle)
    runtime = RuntimeBackend(bundle, provider="cpu", threads=1,
                             prompt_text=(bundle.root / PROMPT_TEXT).read_text(encoding="utf-8"), seed=0)
    try:
        prompt = runtime.prompt_features(bundle.root / PROMPT_WAV)
        (case,) = make_cases(["long"], PINNED)
        alone = runtime.offline(case, prompt)
        runtime.voice.synth.set_max_batch(2)
        batched = runtime.offline(case, prompt)
    finally:
        runtime.close()
    assert batched.speech_tokens == alone.speech_tokens
    for run in (alone, batched):
        figures = run.figures
        assert figures["llm_steps"] == PINNED
        assert 0 < figures["llm_prefill_s"] < figures["llm_s"] and 0 < figures["llm_per_token_s"]
        assert figures["llm_prefill_s"] + (PINNED - 1) * figures["llm_per_token_s"] == pytest.approx(
            figures["llm_s"])


@pytest.mark.parametrize(("extra", "message"), [
    (["--lengths", "short,huge"], "--lengths: unknown length 'huge'; known: short, medium, long"),
    (["--concurrency", "1,0"], "--concurrency: '0' is not a positive integer"),
    (["--vs-torch"], "--vs-torch and --model-dir go together"),
    (["--cuda-graphs"], "cuda graphs are the cuda provider's, not 'cpu''s"),
    (["--cuda-graphs", "--provider", "cuda"], "cuda graphs: the decode steps replay from CUDA graphs on "
                                              "llm_decode; "),
    (["--tokens", "100000000"], "--tokens 100000000: at most "),
    (["--prompt-wav", "BUNDLE_PROMPT"], "--prompt-wav needs --prompt-text, its transcript"),
])
def test_bad_input_is_one_line(runtime_bundle: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    prompt = str(runtime_bundle / "asset" / "zero_shot_prompt.wav")
    extra = [prompt if a == "BUNDLE_PROMPT" else a for a in extra]
    done = CliRunner().invoke(main, [*bench_args(runtime_bundle, tmp_path / "x.json"), *extra])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: {message}")
    assert not (tmp_path / "x.json").exists()


def test_a_json_inside_the_bundle_is_refused_before_it_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Written there, it would replace a file the bundle lists (its manifest): the next run refuses it."""
    monkeypatch.setattr(RuntimeBundle, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    done = CliRunner().invoke(main, bench_args(bundle, bundle / "manifest.json"))
    assert done.exit_code == 2 and done.stderr == (
        f"error: --json {bundle / 'manifest.json'}: would overwrite a file of --model ({bundle}); write it "
        "elsewhere\n")


def test_missing_bundle_is_one_line(tmp_path: Path) -> None:
    done = CliRunner().invoke(main, bench_args(tmp_path / "nothing", tmp_path / "x.json"))
    assert done.exit_code == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: {tmp_path / 'nothing'}: does not exist")


def test_an_unusable_prompt_is_refused_before_the_bundle_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """--prompt-wav is read as the runtime reads a prompt, first: one line naming it, not a failed fresh
    process after the bundle opened."""
    monkeypatch.setattr(RuntimeBundle, "open", lambda *_, **__: pytest.fail("the bundle was opened"))
    junk = tmp_path / "junk.wav"
    junk.write_bytes(bytes(range(100)))
    for wav, message in ((junk, f"cannot read audio file {junk}: "),
                         (tmp_path / "none.wav", f"audio file {tmp_path / 'none.wav'}: no such file")):
        done = CliRunner().invoke(main, [*bench_args(tmp_path / "bundle", tmp_path / "x.json"),
                                         "--prompt-wav", str(wav)])
        assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
        assert done.stderr.startswith(f"error: --prompt-wav: {message}")
    assert not (tmp_path / "x.json").exists()


def test_an_interrupted_run_exits_130(runtime_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C is the shell's 130 with click's "Aborted!", not 1, the status of a failure (every console
    script goes through `run_console_script`)."""
    from cosyvoice_bench import cli

    invoke = click.Command.invoke

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    monkeypatch.setattr(sys, "argv", ["cosyvoice-bench", *bench_args(runtime_bundle, tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exit:
        run_console_script("cosyvoice-bench", "cosyvoice_bench.cli")
    assert exit.value.code == INTERRUPTED == 130
    assert capsys.readouterr().err.endswith("\nAborted!\n")
    assert click.Command.invoke is invoke  # click's own again once the script is done


def test_a_json_the_disk_cannot_take_after_the_run_keeps_the_table(runtime_bundle: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The minutes of figures are printed before the file is written, so a disk that filled meanwhile loses
    none of them; its refusal is one line naming the file."""
    from cosyvoice_bench import cli

    def full_disk(path: Path, data: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "run", lambda *_, **__: {"figures": "measured"})
    monkeypatch.setattr(cli, "render", lambda result: f"the table of {result['figures']}")
    monkeypatch.setattr(cli, "write_json_atomic", full_disk)
    out = tmp_path / "x.json"
    done = CliRunner().invoke(main, bench_args(runtime_bundle, out))
    assert (done.exit_code, done.stdout, done.stderr) == (
        2, "the table of measured\n",
        f"error: {out}: cannot be written (No space left on device); the figures are in the table above\n")


# --- peak RSS in a fresh process ------------------------------------------------------------------------


def peak_job(runtime_bundle: Path, **change: Any) -> PeakJob:
    job = PeakJob("runtime", runtime_bundle, runtime_bundle / PROMPT_WAV,
                  (runtime_bundle / PROMPT_TEXT).read_text().strip(), threads=1)
    return replace(job, **change)


def test_peak_rss_is_that_of_a_fresh_process(runtime_bundle: Path) -> None:
    held = np.ones(400 * 2**20 // 8)  # this process holds 400 MiB more than any fresh one
    case = make_cases(["medium"], 50)[0]
    peak = fresh_peak(peak_job(runtime_bundle), case)
    assert 0 < peak.rss_before_open_mib < peak.rss_after_mib <= peak.peak_rss_mib
    assert peak.rss_before_open_mib < (rss_bytes() or 0) / 2**20 - 300  # not this process's
    assert peak.open_s > 0 and peak.prompt_s > 0 and peak.synthesis_s > 0
    del held


def test_the_fresh_process_decodes_as_the_benchmark_does(runtime_bundle: Path) -> None:
    """The child opens the runtime with the benchmark's CUDA-graph setting: asked for on the CPU, it
    refuses in the runtime's line."""
    job = peak_job(runtime_bundle, cuda_graphs=True)
    assert "--cuda-graphs" in job.command(make_cases(["short"], 10)[0])
    with pytest.raises(BenchError, match=r"runtime short: the fresh process measuring peak RSS failed "
                                         r"\(exit 2\): cuda graphs are the cuda provider's"):
        fresh_peak(job, make_cases(["short"], 10)[0])


@pytest.mark.parametrize(("bad", "message"), [
    ("model", "failed (exit 2): Error: Invalid value for '--model': Directory '/nonexistent' does not "
              "exist."),
    ("prompt", "failed (exit 2): cannot read audio file"),
])
def test_a_failing_fresh_process_is_one_line(runtime_bundle: Path, tmp_path: Path, bad: str, message: str
                                             ) -> None:
    text = tmp_path / "prompt.wav"
    text.write_text("not audio")
    change = {"model": Path("/nonexistent")} if bad == "model" else {"prompt_wav": text}
    job = peak_job(runtime_bundle, **change)
    with pytest.raises(BenchError) as caught:
        fresh_peak(job, make_cases(["short"], 10)[0])
    error = str(caught.value)
    assert "\n" not in error
    assert error.startswith(f"runtime short: the fresh process measuring peak RSS {message}")


def test_a_killed_fresh_process_is_one_line(runtime_bundle: Path, tmp_path: Path) -> None:
    wav = tmp_path / "prompt.wav"  # read by the child: a fifo nobody writes holds it until it is killed
    os.mkfifo(wav)
    case = make_cases(["short"], 10)[0]
    job = peak_job(runtime_bundle, prompt_wav=wav)
    with ThreadPoolExecutor(1) as pool:
        measured = pool.submit(fresh_peak, job, case)
        child = _child_of_this_process("cosyvoice_bench.peak_rss")
        os.kill(child, signal.SIGKILL)
        with pytest.raises(BenchError, match=r"^runtime short: the fresh process measuring peak RSS was "
                                             r"killed by SIGKILL \(out of memory\?\)$"):
            measured.result(timeout=60)


def _child_of_this_process(module: str) -> int:
    """The pid of this process's child running `python -m module`, once it has started: other children (a
    serve test's engine, alive for the session, has its text normaliser's) are left alone."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                args = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid == os.getpid() and module.encode() in args:
                return int(stat.parent.name)
        time.sleep(0.05)
    raise AssertionError(f"no child process runs {module}")


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "x"], "--replicas: 'x'; expected distinct counts from 0 (the single-process server) to"),
    (["--replicas", "100"], "--replicas: '100'; expected distinct counts"),
    (["--replicas", "0,0"], "--replicas: '0,0'; expected distinct counts"),
    (["--concurrency", "0"], "--concurrency: '0' is not a positive integer"),
    (["--text", " "], "--text: nothing to speak"),
    (["--model", "/nonexistent"], "--model /nonexistent: not a folder"),
])
def test_serve_replicas_refuses_bad_input_before_a_server_starts(args: list[str], message: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from cosyvoice_bench import serve_replicas

    monkeypatch.setattr(serve_replicas, "bench_server", lambda *_: pytest.fail("a server was started"))
    done = CliRunner().invoke(serve_replicas.main, args)
    assert done.exit_code == 2 and done.stderr == f"error: {message}" + done.stderr.removeprefix(
        f"error: {message}"), done.output
    assert done.stderr.count("\n") == 1
