"""The GPU: what it is (`nvidia-smi`), what it can do measured through onnxruntime's CUDA provider with
every tensor on the device (memory bandwidth; float32, TF32 and float16 matmul rates: the bounds'
denominators for a GPU run), and the cuDNN algorithm search's lever (each search mode's first call at a
new shape and its warm call, on the vocoder, whose convolutions meet a new shape with every chunk length).

Every measurement runs on the CPU provider too, with the same code, which is how it is tested where there
is no GPU.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import HIFT_DECODER, vocoder_case
from cosyvoice_graphs.precision import FP16, TF32
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners import CPU, CUDA, ORT_PROVIDERS, OrtRunner, provider_chain
from cosyvoice_runtime.runners.ort import preload_cuda_libraries
from cosyvoice_runtime.runners.ort_settings import CONV_ALGO_SEARCHES

from .errors import BenchError
from .machine import Rates, matmul_model, scale_model
from .measure import timed

GPU_FIELDS = ("name", "memory.total", "driver_version", "compute_cap")
"""What `describe_gpu` asks nvidia-smi for."""


def describe_gpu(device_id: int = 0) -> dict[str, Any] | None:
    """GPU `device_id` as nvidia-smi names it: name, memory in MiB, driver, compute capability; None where
    there is no nvidia-smi (no NVIDIA driver)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "-i", str(device_id), f"--query-gpu={','.join(GPU_FIELDS)}",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        raise BenchError(f"nvidia-smi could not describe GPU {device_id}: "
                         f"{(done.stderr or done.stdout).strip() or f'exit status {done.returncode}'}")
    name, memory, driver, capability = (v.strip() for v in done.stdout.strip().splitlines()[0].split(","))
    return {"name": name, "memory_mib": float(memory), "driver": driver, "compute_capability": capability}


# --- rates on the device ---------------------------------------------------------------------------------


def gpu_rates(shape: tuple[int, int, int], *, quick: bool, provider: str = CUDA, device_id: int = 0) -> Rates:
    """The bounds' rates measured on `provider`'s device: memory bandwidth (a float32 array read and
    written, 1 GiB, 64 MiB with `quick`), and `MatMul` at `shape` in float32 (TF32 off), TF32 and float16.
    On the CPU provider TF32 is float32's math (its figure says only that the code runs)."""
    repeats = 3 if quick else 10
    n = (64 if quick else 1024) * 2**20 // 4
    bandwidth = 2 * n * 4 / _best_seconds(scale_model(n), {"x": np.ones(n, dtype=np.float32)}, provider,
                                          device_id, tf32=False, repeats=repeats) / 1e9
    m, k, nn = shape
    rng = np.random.default_rng(0)

    def matmul(dtype: type[np.floating], tf32: bool) -> float:
        feeds = {"a": rng.standard_normal((m, k)).astype(dtype),
                 "b": rng.standard_normal((k, nn)).astype(dtype)}
        seconds = _best_seconds(matmul_model(m, k, nn, dtype=dtype), feeds, provider, device_id, tf32=tf32,
                                repeats=repeats)
        return 2 * m * k * nn / seconds / 1e9

    return Rates(threads=0, bandwidth_gbs=bandwidth, matmul_shape=shape,
                 matmul_gflops=matmul(np.float32, False), int8_matmul_gflops=None,
                 device=CPU if provider == CPU else CUDA,
                 precision_gflops={TF32.name: matmul(np.float32, True), FP16.name: matmul(np.float16, False)})


def device_session(model: bytes | str, provider: str, *, tf32: bool, device_id: int = 0,
                   options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """An onnxruntime session of `model` on exactly `provider` with the runtime's provider options (and,
    on a GPU, the CUDA libraries it loads first); a `BenchError` where onnxruntime placed it elsewhere."""
    if provider != CPU:
        preload_cuda_libraries()
    session = ort.InferenceSession(model, options, providers=provider_chain(provider, device_id, tf32=tf32))
    if session.get_providers()[0] != ORT_PROVIDERS[provider]:
        raise BenchError(f"onnxruntime ran it on {session.get_providers()[0]}, not {ORT_PROVIDERS[provider]}")
    return session


def _best_seconds(model: bytes, feeds: dict[str, np.ndarray], provider: str, device_id: int, *, tf32: bool,
                  repeats: int) -> float:
    """The fastest of `repeats` calls of `model` after a warm-up, its inputs and outputs on the device
    (IOBinding), so that no host copy is timed."""
    session = device_session(model, provider, tf32=tf32, device_id=device_id)
    device = CPU if provider == CPU else CUDA
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, device_id))
    for output in session.get_outputs():
        binding.bind_output(output.name, device, device_id)
    session.run_with_iobinding(binding)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)  # returns once the device has finished
        best = min(best, time.perf_counter() - start)
    return best


# --- the cuDNN algorithm search -----------------------------------------------------------------------------

LEVER_FRAMES = (57, 83, 500)
"""Mel frames of the vocoder calls the search lever times: shapes no call before it had (a streamed
chunk's window, a longer one, an offline utterance's 20 s)."""


def conv_search_levers(bundle: RuntimeBundle, provider: str = CUDA, *, frames: tuple[int, ...] = LEVER_FRAMES,
                       on_row: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Per cuDNN algorithm search mode (`CONV_ALGO_SEARCHES`): the vocoder graph opened fresh with it, then
    per frame count its first call (which pays the search for that shape), the fastest of 3 calls after it,
    and, once every count has run, a call at it right after a call at another count (`back_call_ms`: what
    a session pays to come back to a shape it ran before, where it keeps only its last shape's plans), in
    ms."""
    spec = bundle.specs[HIFT_DECODER]
    rows = []
    for search in CONV_ALGO_SEARCHES:
        with OrtRunner(bundle.graph_path(HIFT_DECODER), spec, provider, conv_algo_search=search) as runner:
            feeds = {n: spec.sample_inputs(vocoder_case(n)) for n in frames}
            found = []
            for n in frames:
                first = timed(partial(runner.infer, feeds[n]))
                warm = min(timed(partial(runner.infer, feeds[n])) for _ in range(3))
                found.append({"graph": HIFT_DECODER, "conv_algo_search": search, "frames": n,
                              "first_call_ms": first * 1e3, "warm_call_ms": warm * 1e3})
            for row, other in zip(found, (*frames[1:], frames[0]), strict=True):
                runner.infer(feeds[other])
                row["back_call_ms"] = timed(partial(runner.infer, feeds[row["frames"]])) * 1e3
            rows += found
        on_row()
    return rows

