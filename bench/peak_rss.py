"""The cold run, and its peak RSS measured in a fresh process of its own.

A cold run is a freshly opened pipeline's first work: the prompt extracted, then the whole case synthesised
(streamed where the backend can). The suite times it in its own process, but takes its peak RSS from
`python -m cosyvoice_bench.peak_rss`, a child that does the same work alone: what the benchmark's process
held or freed before (earlier pipelines, glibc's heap, torch beside the runtime) is then neither counted
nor reused unseen, and the figure is what one server process reaches. Run by hand, the same command prints
just that figure, as one JSON line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import click

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.cli_options import THREADS, NonEmptyPath
from cosyvoice_runtime.process_memory import peak_rss_bytes, rss_bytes
from cosyvoice_runtime.runners import CPU, PROVIDERS
from cosyvoice_runtime.runners.ort_settings import usable_cpus
from cosyvoice_runtime.sampling import MAX_SEED

from .backend import Backend, FirstChunk
from .cases import LENGTHS, Case
from .errors import BenchError, user_errors
from .runtime_runs import RuntimeBackend

MODULE = "cosyvoice_bench.peak_rss"
MIB = 2**20
BackendName = Literal["runtime", "torch"]


@dataclass(frozen=True)
class ColdRun:
    """What a cold run leaves for the suite's figures."""

    prompt: Any
    """The backend's prompt features, extracted in the run."""
    prompt_s: float
    first: FirstChunk
    synthesis_s: float
    """From the request to the end of the case (after the prompt's extraction)."""


def cold_run(backend: Backend, case: Case, wav: Path) -> ColdRun:
    """The first work of a freshly opened `backend`: the prompt of `wav` extracted, then `case` streamed to
    the end where the backend can, else its first chunk and then offline."""
    start = time.perf_counter()
    prompt = backend.prompt_features(wav)
    prompt_s = time.perf_counter() - start
    streamed = backend.stream(case, prompt)
    if streamed is None:
        first = backend.first_chunk(case, prompt)
        backend.offline(case, prompt)
    else:
        first = streamed.first
    return ColdRun(prompt, prompt_s, first, time.perf_counter() - start - prompt_s)


@dataclass(frozen=True)
class PeakJob:
    """A backend as the child opens it; `model` is the runtime bundle, or torch's model directory."""

    backend: BackendName
    model: Path
    prompt_wav: Path
    prompt_text: str
    threads: int
    provider: str = CPU
    """The runtime's; the torch reference runs on the CPU."""
    seed: int = 0
    cuda_graphs: bool = False
    """The runtime's decode steps replay from CUDA graphs, as the benchmark's do (`RuntimeBackend`)."""
    llm_checkpoint: str = "llm.pt"
    """The torch reference's LLM checkpoint in `model` (the runtime bundle's)."""

    def command(self, case: Case) -> list[str]:
        """The child's command line for `case`."""
        return [sys.executable, "-m", MODULE, "--backend", self.backend, "--model", str(self.model),
                "--prompt-wav", str(self.prompt_wav), "--prompt-text", self.prompt_text,
                "--length", case.name, "--tokens", str(case.tokens), "--threads", str(self.threads),
                "--provider", self.provider, "--seed", str(self.seed),
                "--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs",
                "--llm-checkpoint", self.llm_checkpoint]


@dataclass(frozen=True)
class FreshPeak:
    """The child's figures."""

    peak_rss_mib: float
    """VmHWM: the process's peak, interpreter and libraries included."""
    rss_before_open_mib: float
    """The interpreter and the backend's libraries (torch for the reference), before the pipeline opened."""
    rss_after_mib: float
    """VmRSS once the case ended, the pipeline still open: what a server keeps resident between requests
    (the model, and whatever the request's work left behind)."""
    open_s: float
    prompt_s: float
    synthesis_s: float


def fresh_peak(job: PeakJob, case: Case) -> FreshPeak:
    """Run `case` cold in a child process of its own and return its figures; a `BenchError` (one line)
    when the child fails or is killed."""
    done = subprocess.run(job.command(case), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)
    where = f"{job.backend} {case.name}: the fresh process measuring peak RSS"
    if done.returncode != 0:
        raise BenchError(f"{where} {_failure(done.returncode, done.stderr)}")
    lines = done.stdout.strip().splitlines()
    try:  # the last line: anything a library printed before it is not ours
        return FreshPeak(**json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError) as e:
        raise BenchError(f"{where} printed no figures ({e})") from None


def _failure(code: int, stderr: str) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    lines = [line for line in stderr.splitlines() if line.strip()]
    return f"failed (exit {code}): {lines[-1].strip().removeprefix('error: ') if lines else 'no message'}"


def _opener(job: PeakJob) -> Callable[[], Backend]:
    """Opens the backend of `job`; its libraries are imported here, before the baseline is read."""
    if job.backend == "torch":
        from .torch_runs import TorchBackend  # torch only in the reference's child

        return lambda: TorchBackend(job.model, job.llm_checkpoint, threads=job.threads,
                                    prompt_text=job.prompt_text, seed=job.seed)
    return lambda: RuntimeBackend(RuntimeBundle.open(job.model), provider=job.provider, threads=job.threads,
                                  prompt_text=job.prompt_text, seed=job.seed, cuda_graphs=job.cuda_graphs)


def measure_here(job: PeakJob, case: Case) -> FreshPeak:
    """`case` cold in this process, which must be fresh for the peak to mean anything (the child's work)."""
    opener = _opener(job)
    before = rss_bytes() or 0
    start = time.perf_counter()
    backend = opener()
    try:
        open_s = time.perf_counter() - start
        run = cold_run(backend, case, job.prompt_wav)
        peak, after = peak_rss_bytes(), rss_bytes() or 0
    finally:
        backend.close()
    return FreshPeak(peak / MIB, before / MIB, after / MIB, open_s, run.prompt_s, run.synthesis_s)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--backend", type=click.Choice(["runtime", "torch"]), default="runtime", show_default=True,
              help="What runs the case: the runtime (numpy and onnxruntime), or the torch reference.")
@click.option("--model", required=True, type=NonEmptyPath(exists=True, file_okay=False, path_type=Path),
              help="The runtime bundle; with --backend torch, the model directory.")
@click.option("--prompt-wav", required=True, type=NonEmptyPath(exists=True, dir_okay=False, path_type=Path),
              help="Prompt recording (zero-shot).")
@click.option("--prompt-text", required=True, help="Transcript of the prompt recording.")
@click.option("--length", type=click.Choice(list(LENGTHS)), default="long", show_default=True,
              help="The case's text (cosyvoice-bench --lengths).")
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="LLM steps pinned for the case.")
@click.option("--threads", type=THREADS, default=None,
              help="onnxruntime intra-op threads, and torch threads  [default: usable CPUs]")
@click.option("--provider", type=click.Choice(PROVIDERS), default=CPU, show_default=True,
              help="The runtime's provider.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the RAS sampler.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=False, show_default=True,
              help="The runtime's decode steps replay from CUDA graphs (cuda, with an llm_decode).")
@click.option("--llm-checkpoint", default="llm.pt", show_default=True,
              help="With --backend torch: the LLM's checkpoint in the model directory (the runtime "
                   "bundle's).")
def main(backend: BackendName, model: Path, prompt_wav: Path, prompt_text: str, length: str, tokens: int,
         threads: int | None, provider: str, seed: int, cuda_graphs: bool, llm_checkpoint: str) -> None:
    """Peak RSS of one cold run in this (fresh) process, printed as one JSON line (cosyvoice-bench runs
    it for each case)."""
    job = PeakJob(backend, model, prompt_wav, prompt_text, threads or usable_cpus(), provider, seed,
                  cuda_graphs, llm_checkpoint)
    with user_errors():
        click.echo(json.dumps(asdict(measure_here(job, Case(LENGTHS[length], tokens)))))


if __name__ == "__main__":
    main()
