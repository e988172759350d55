"""The benchmark's GPU side, run here on what a CPU allows: nvidia-smi's description of the GPU (a stand-in
nvidia-smi on PATH, run as the real one would be), the device rates and the cuDNN search lever through the
same code on onnxruntime's CPU provider, the bounds at each precision's measured rate, the p95 of the first
chunk, the report's GPU lines, and the refusal of thread scaling on a GPU. With a CUDA provider the rates
are also measured on it."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest
from click.testing import CliRunner

from cosyvoice_bench.backend import StreamRun
from cosyvoice_bench.bounds import ModelShapes, dit_bound_s, dit_flops_per_step
from cosyvoice_bench.cases import Case, make_cases
from cosyvoice_bench.cli import main
from cosyvoice_bench.errors import BenchError
from cosyvoice_bench.gpu import conv_search_levers, describe_gpu, gpu_rates
from cosyvoice_bench.graph_profile import main as profile_main
from cosyvoice_bench.machine import Rates
from cosyvoice_bench.measure import GpuSampler
from cosyvoice_bench.report import render, summarize
from cosyvoice_bench.runtime_runs import RuntimeBackend
from cosyvoice_graphs.bundle_layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_graphs.precision import BF16, FP16, FP32, TF32
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.dit_graphs import GraphedDit
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.runners.ort_settings import CONV_ALGO_SEARCHES


def _fake_nvidia_smi(folder: Path, body: str) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_the_gpu_is_described_by_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert describe_gpu() is None  # no driver, no nvidia-smi
    # the query nvidia-smi answers: the arguments are checked by the stand-in
    _fake_nvidia_smi(tmp_path, 'test "$*" = "-i 0 --query-gpu=name,memory.total,driver_version,compute_cap '
                               '--format=csv,noheader,nounits" || exit 9\n'
                               'echo "NVIDIA H200, 143771, 580.95.05, 9.0"')
    assert describe_gpu() == {"name": "NVIDIA H200", "memory_mib": 143771.0, "driver": "580.95.05",
                              "compute_capability": "9.0"}
    _fake_nvidia_smi(tmp_path, 'echo "No devices were found" >&2; exit 6')
    with pytest.raises(BenchError, match="nvidia-smi could not describe GPU 0: No devices were found"):
        describe_gpu()


PROVIDERS_HERE = ["cpu", *(["cuda"] if "CUDAExecutionProvider" in ort.get_available_providers() else [])]


@pytest.mark.parametrize("provider", PROVIDERS_HERE)
def test_the_device_rates_come_from_tensors_on_the_device(provider: str) -> None:
    rates = gpu_rates((64, 32, 96), quick=True, provider=provider)
    assert rates.device == provider and rates.matmul_shape == (64, 32, 96)
    assert rates.int8_matmul_gflops is None
    assert rates.bandwidth_gbs > 0 and rates.matmul_gflops > 0
    assert set(rates.precision_gflops) == {"tf32", "fp16"} and min(rates.precision_gflops.values()) > 0


def test_each_precision_is_bounded_at_its_own_measured_rate(runtime_bundle: Path) -> None:
    rates = Rates(threads=0, bandwidth_gbs=4000.0, matmul_shape=(8, 8, 8), matmul_gflops=50_000.0,
                  int8_matmul_gflops=None, device="cuda",
                  precision_gflops={"tf32": 400_000.0, "fp16": 800_000.0})
    assert rates.matmul_rate(FP32) == (50_000.0, "float32 MatMul")
    assert rates.matmul_rate(TF32) == (400_000.0, "tf32 MatMul")
    assert rates.matmul_rate(FP16) == (800_000.0, "fp16 MatMul")
    assert rates.matmul_rate(BF16) == (50_000.0, "float32 MatMul (no bf16 rate measured)")
    dit = ModelShapes.of(RuntimeBundle.open(runtime_bundle), "cuda").dit
    flops = dit_flops_per_step(dit, 300)
    assert dit_bound_s(dit, 300, FP16, rates) == pytest.approx(flops / 800e12)
    assert dit_bound_s(dit, 300, FP32, rates) == pytest.approx(flops / 50e12)


def test_the_first_chunks_p95_is_the_nearest_rank_over_the_rounds() -> None:
    rounds = [{"first_chunk_warm_cached_s": v} for v in (0.12, 0.10, 0.31)]
    summary = summarize(rounds)
    assert summary["first_chunk_warm_cached_s"] == pytest.approx(0.12)
    assert summary["first_chunk_warm_cached_p95_s"] == pytest.approx(0.31)
    assert summarize([{}])["first_chunk_warm_cached_p95_s"] is None
    twenty = summarize([{"first_chunk_warm_cached_s": float(v)} for v in range(1, 21)])
    assert twenty["first_chunk_warm_cached_p95_s"] == 19.0


def test_the_cudnn_search_lever_times_first_and_warm_calls_per_mode(runtime_bundle: Path) -> None:
    """On the CPU provider the modes do not apply: this checks the rows, not a choice."""
    rows = conv_search_levers(RuntimeBundle.open(runtime_bundle), "cpu", frames=(11, 23))
    assert [(r["conv_algo_search"], r["frames"]) for r in rows] == [
        (search, n) for search in CONV_ALGO_SEARCHES for n in (11, 23)]
    assert all(r["graph"] == "hift_decoder" and r["first_call_ms"] > 0 and r["warm_call_ms"] > 0
               and r["back_call_ms"] > 0 for r in rows)


def test_the_report_names_the_gpu_and_the_search_lever(tmp_path: Path, runtime_bundle: Path) -> None:
    """A quick CPU run's result with the GPU parts a CUDA run adds: the table prints them."""
    out = tmp_path / "b.json"
    done = CliRunner().invoke(main, ["--model", str(runtime_bundle), "--quick", "--threads", "1", "--json",
                                     str(out), "--no-progress", "--lengths", "short", "--concurrency", "1"])
    assert done.exit_code == 0, done.output
    result = json.loads(out.read_text())
    assert "its 95th percentile over the rounds" in done.output
    result["machine"]["gpu"] = {"name": "NVIDIA H200", "memory_mib": 143771.0, "driver": "580.95.05",
                                "compute_capability": "9.0"}
    result["levers"]["cudnn_search"] = [{"graph": "hift_decoder", "conv_algo_search": search, "frames": 57,
                                         "first_call_ms": 812.0, "warm_call_ms": 9.1, "back_call_ms": 130.0}
                                        for search in ("EXHAUSTIVE", "HEURISTIC")]
    result["concurrency"][0]["gpu_utilization_mean_pct"] = 41.5
    text = render(result)
    assert "GPU NVIDIA H200 (140 GiB, driver 580.95.05, compute capability 9.0); its memory bandwidth" in text
    assert re.search(r"outputs match +GPU busy %\n", text) and re.search(r"yes +41\.5\n", text), text
    assert "cuDNN convolution algorithm search" in text
    assert re.search(r"hift_decoder +EXHAUSTIVE +57 +812 +9\.10 +130\n", text), text
    assert re.search(r"hift_decoder +HEURISTIC \* +57 +812 +9\.10 +130\n", text), text  # * the runtime's


@pytest.fixture
def short_case(runtime_bundle: Path) -> Iterator[tuple[RuntimeBackend, Case, PromptFeatures, StreamRun]]:
    """The runtime on the CPU, the short case of 12 tokens, its prompt's features and one stream of it."""
    bundle = RuntimeBundle.open(runtime_bundle)
    runtime = RuntimeBackend(bundle, provider="cpu", threads=1,
                             prompt_text=(bundle.root / PROMPT_TEXT).read_text(encoding="utf-8"), seed=0)
    try:
        prompt = runtime.prompt_features(bundle.root / PROMPT_WAV)
        (case,) = make_cases(["short"], 12)
        yield runtime, case, prompt, runtime.stream(case, prompt)
    finally:
        runtime.close()


def test_concurrent_sessions_say_how_busy_the_gpu_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        short_case: tuple[RuntimeBackend, Case, PromptFeatures, StreamRun]) -> None:
    """The concurrency runs sample the GPU while their sessions run (a stand-in nvidia-smi here)."""
    _fake_nvidia_smi(tmp_path, 'echo "2048, 37"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    runtime, case, prompt, reference = short_case
    row = runtime.concurrent(case, prompt, 1, reference, GpuSampler(interval_s=0.01))
    unsampled = runtime.concurrent(case, prompt, 1, reference)
    assert row["gpu_utilization_mean_pct"] == 37 and "gpu_utilization_mean_pct" not in unsampled
    assert row["outputs_match"] is row["tokens_match"] is True


def test_concurrent_sessions_say_how_many_dit_calls_ran_in_bindings(
        short_case: tuple[RuntimeBackend, Case, PromptFeatures, StreamRun]) -> None:
    """Where the DiT's calls go through `dit_graphs` (on a GPU, replays from CUDA graphs; here its bindings
    run as plain calls) a concurrency row gives the share of its calls that ran in a binding; elsewhere it
    has no such figure."""
    runtime, case, prompt, reference = short_case
    plain = runtime.concurrent(case, prompt, 2, reference)
    synth = runtime.voice.synth
    synth.dit_graphs = synth.flow.call = graphed = GraphedDit(synth.flow.estimator, bind_after=0)
    bound = runtime.concurrent(case, prompt, 2, reference)
    assert "dit_bound_share" not in plain
    assert 0 < bound["dit_bound_share"] <= 1 and graphed.bound_calls <= graphed.calls
    assert bound["tokens_match"] is True  # the audio: a single stream's within float32's rounding (buckets)
    assert bound["outputs_match"] or bound["outputs_max_diff"] <= 1e-4


def test_thread_scaling_is_refused_on_a_gpu_before_any_work(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-bundle"
    done = CliRunner().invoke(main, ["--model", str(missing), "--provider", "cuda", "--thread-scaling"])
    assert done.exit_code == 2
    assert done.output.strip() == ("error: --thread-scaling measures CPU threads; it does not apply to "
                                   "--provider cuda")
    assert not os.path.exists(missing)


def test_the_graph_profile_names_each_hot_calls_providers_and_copies(tmp_path: Path) -> None:
    """On the CPU provider every node is the CPU's and nothing is copied; on a GPU the same table shows
    what stayed on the CPU and the Memcpy nodes onnxruntime inserted."""
    out = tmp_path / "profile.json"
    done = CliRunner().invoke(profile_main, ["--model", str(DEMO_BUNDLE), "--calls", "3", "--json", str(out)])
    assert done.exit_code == 0, done.output
    rows = json.loads(out.read_text())["profiles"]
    assert [r["graph"] for r in rows] == ["llm", "flow_estimator_cached", "hift_decoder"]
    assert rows[0]["shape"] == {"new_len": 1, "past_len": 300}
    for r in rows:
        assert set(r["providers"]) == {"CPUExecutionProvider"} and r["memcpy_nodes"] == 0
        assert r["wall_ms"] > 0 and r["node_ms"] > 0 and r["providers"]["CPUExecutionProvider"]["nodes"] > 50
        assert f"{r['graph']} (fp32, " in done.output
    missing = CliRunner().invoke(profile_main, ["--model", str(tmp_path / "none")])
    assert missing.exit_code == 2 and missing.output.startswith("error: ")
    batched = CliRunner().invoke(profile_main, ["--model", str(DEMO_BUNDLE), "--decode-rows", "2"])
    assert batched.exit_code == 2
    assert batched.output.startswith("error: --decode-rows 2: batched decode steps run on llm_decode, which "
                                     "this bundle's decode steps on cpu do not")


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available")
def test_a_probe_session_loads_cudas_libraries_and_refuses_a_fallback(monkeypatch: pytest.MonkeyPatch
                                                                       ) -> None:
    """The rate probes and the profiler open their GPU sessions as the runtime does: CUDA's pip libraries
    loaded first, and a session onnxruntime put on the CPU refused."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is really available here")
    from cosyvoice_bench.gpu import device_session
    from cosyvoice_bench.machine import matmul_model
    from cosyvoice_runtime.runners import ort as ort_runner

    loads: list[None] = []
    monkeypatch.setattr(ort, "preload_dlls", lambda: loads.append(None), raising=False)
    ort_runner.preload_cuda_libraries.cache_clear()
    try:
        with pytest.raises(BenchError, match="onnxruntime ran it on CPUExecutionProvider, not "
                                             "CUDAExecutionProvider"):
            device_session(matmul_model(2, 2, 2), "cuda", tf32=False)
        assert loads == [None]
        assert device_session(matmul_model(2, 2, 2), "cpu", tf32=False).get_providers()[0] == \
            "CPUExecutionProvider"
    finally:
        ort_runner.preload_cuda_libraries.cache_clear()
