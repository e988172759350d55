"""`cosyvoice-bench`: a thin command over `suite.run`; the table goes to stdout, `--json` to a file."""

from __future__ import annotations

from pathlib import Path

import click

from cosyvoice_graphs import MAX_BATCH
from cosyvoice_graphs.bundle_layout import FLOW_NOISE
from cosyvoice_runtime.atomic_files import check_writable, refuse_overwriting_inputs, write_json_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import BundleFront, choose_prompt
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli_options import THREADS, NonEmptyPath, chunk_policy_options
from cosyvoice_runtime.errors import FrontendError
from cosyvoice_runtime.extras import require_extra
from cosyvoice_runtime.frontend import read_prompt_audio
from cosyvoice_runtime.runners import CPU, CPU_PROVIDERS, PROVIDERS, check_runs
from cosyvoice_runtime.sampling import MAX_SEED
from cosyvoice_runtime.synthesis import batches, check_synthesis, uses_cuda_graphs

from .cases import LENGTHS, default_long_tokens, make_cases, parse_lengths, parse_levels
from .errors import BenchError, user_errors
from .machine import usable_cpus
from .plots import plot_paths, require_matplotlib, write_plots
from .report import render
from .suite import Settings, run


def _check_prompt(wav: Path, what: str) -> None:
    """Read `wav` as the runtime will (`read_prompt_audio`): one line naming `what` where it cannot
    prompt, not a failed measurement after the bundle opened."""
    try:
        read_prompt_audio(wav)
    except FrontendError as e:
        raise BenchError(f"{what}: {e}") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model", required=True, type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Runtime bundle (cosyvoice-export all).")
@click.option("--prompt-wav", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Prompt recording (zero-shot; give --prompt-text with it)  [default: the bundle's own]")
@click.option("--prompt-text", default=None,
              help="Transcript of the prompt recording  [default: the bundle's own prompt's]")
@click.option("--vs-torch", is_flag=True, help="Also run every case on the torch reference, interleaved.")
@click.option("--model-dir", type=NonEmptyPath(file_okay=False, path_type=Path),
              help="The model directory the runtime bundle was exported from (torch reference).")
@click.option("--threads", type=THREADS, default=None,
              help="onnxruntime intra-op threads, and torch threads  [default: usable CPUs]")
@click.option("--provider", type=click.Choice(PROVIDERS), default=CPU, show_default=True,
              help="The runtime's provider (the torch reference always runs on the CPU).")
@click.option("--lengths", default=",".join(LENGTHS), show_default=True,
              help="Text lengths to run, comma-separated.")
@click.option("--concurrency", default="1,2,4", show_default=True,
              help="Parallel streamed sessions through the runtime, comma-separated levels (each above 1 "
                   "measured after an unmeasured round of it).")
@click.option("--tokens", type=int, default=None,
              help="LLM steps pinned for the long case (shorter cases take a share)  "
                   "[default: 10 s of audio, 250; 50 with --quick]")
@click.option("--repeat", type=click.IntRange(min=1), default=None,
              help="Warm rounds per case; medians are reported  [default: 3; 1 with --quick]")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the RAS sampler.")
@click.option("--quick", is_flag=True, help="Smoke run: few tokens, one round, short machine probes.")
@chunk_policy_options("Also measure the first chunk with the runtime's latency policy: after N tokens (and "
                      "the flow's look-ahead), beside upstream's schedule (a deviation from upstream).",
                      "Also stream each case with the final chunk run against the earlier chunks' caches, "
                      "not upstream's re-run over every frame, attention kept to the prompt and the last N "
                      "1-s blocks ('all': every block), beside upstream's flow: its RTF and final chunk's "
                      "wait (a deviation from upstream).")
@click.option("--thread-scaling/--no-thread-scaling", default=None,
              help="Also run the runtime at 1 and 2 threads (longest case): first chunk, per-stage times and "
                   "bounds at each (CPU providers)  [default: on with --threads >= 2, off with --quick and "
                   "on a GPU]")
@click.option("--chunk-slots", type=click.IntRange(1, MAX_BATCH), default=None,
              help="In the batched concurrency runs, the sessions' chunks that run their flow and vocoder at "
                   "once  [default: the runtime's: on a CPU as many as the usable CPUs hold at --threads "
                   "each, on a GPU every session's]")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Replay the runtime's decode steps from CUDA graphs (cuda, a bundle with llm_decode: "
                   "--precision decode=fp16 or gpu-fp16), and its DiT's calls where it is tf32's or "
                   "gpu-fp16's; the decodings then run in a batch, of one where the runs have no batch, one "
                   "stream's at a time  [default: as the runtime, wherever they can]")
@click.option("--stack-dit", is_flag=True,
              help="Run concurrent sessions' DiT calls at the same ODE step and frames as one call "
                   "(the runtime's DitStack); the concurrency table then says how many streams a call "
                   "served.")
@click.option("--stack-vocoder", is_flag=True,
              help="Run concurrent sessions' vocoder windows over the same frames as one hift_decoder "
                   "call; the concurrency table then says how many streams a call served.")
@click.option("--json", "json_out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write the results as JSON (atomically).")
@click.option("--plots", is_flag=True,
              help="Also draw PNGs beside --json OUT.json: OUT-stages.png (each stage against its bound) "
                   "and OUT-first-chunk.png (the first chunk's timeline); needs matplotlib.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def main(model: Path, prompt_wav: Path | None, prompt_text: str | None, vs_torch: bool,
         model_dir: Path | None, threads: int | None, provider: str, lengths: str, concurrency: str,
         tokens: int | None, repeat: int | None, seed: int, quick: bool, chunk_policy: ChunkPolicy | None,
         thread_scaling: bool | None, chunk_slots: int | None, cuda_graphs: bool | None, stack_dit: bool,
         stack_vocoder: bool, json_out: Path | None, plots: bool, progress: bool) -> None:
    """Benchmark a CosyVoice3 runtime bundle: first-chunk latency, RTF, per-stage times, LLM tokens/s,
    memory, concurrency, hardware bounds and onnxruntime levers, optionally beside the torch reference."""
    with user_errors():
        names, levels = parse_lengths(lengths), parse_levels(concurrency)
        if vs_torch != (model_dir is not None):
            raise BenchError("--vs-torch and --model-dir go together (the torch reference loads "
                             "--model-dir)")
        if vs_torch:
            require_extra("export")  # the torch reference's, named before any input is judged
        if provider not in CPU_PROVIDERS:
            if thread_scaling:
                raise BenchError(f"--thread-scaling measures CPU threads; it does not apply to --provider "
                                 f"{provider}")
            thread_scaling = False
        if prompt_wav is not None:  # the runtime's reader, before any bundle opens
            _check_prompt(prompt_wav, "--prompt-wav")
            if not (prompt_text or "").strip():
                raise BenchError("--prompt-wav needs --prompt-text, its transcript: the cases run zero-shot")
        if plots and json_out is None:
            raise BenchError("--plots writes its PNGs beside the JSON: give --json FILE too")
        inputs = {"--model": model, "--prompt-wav": prompt_wav, "--model-dir": model_dir}
        if json_out is not None:
            refuse_overwriting_inputs(json_out, "--json", inputs)
            check_writable(json_out, "--json")
        if plots:
            require_matplotlib()
            assert json_out is not None
            for path in plot_paths(json_out).values():
                refuse_overwriting_inputs(path, "--plots", inputs)
                check_writable(path, "--plots")
        # a provider that cannot run the bundle, then a damaged graph, is one line here, not a failed run
        opened = RuntimeBundle.open(model)
        check_runs(opened, provider)
        batched = max(levels) if max(levels) > 1 and batches(opened, provider) else None  # the batched runs'
        if chunk_slots is not None and batched is None:
            raise BenchError("--chunk-slots: the slots are the batched runs', and there are none: " + (
                "--concurrency has no level above 1" if max(levels) == 1 else
                f"{model} does not decode in batches on {provider} (a bundle with llm_decode does: "
                "--precision cpu-fast or decode=fp32 on a CPU)"))
        check_synthesis(opened, provider, max_batch=batched, chunk_slots=chunk_slots, cuda_graphs=cuda_graphs,
                        stack_dit=stack_dit, chunk_policy=chunk_policy)
        bundle = RuntimeBundle.open(model, verify=True)
        uses_graphs = uses_cuda_graphs(cuda_graphs, bundle, provider)
        if model_dir is not None:  # fail before the run starts, not when the torch side first loads
            from cosyvoice_export.bundle.model_dir import ModelBundle

            # another model's reference would be measured in full and then disagree on every token
            ModelBundle.open_exported_from(model_dir, bundle)
        chosen = choose_prompt(BundleFront.of(bundle), prompt_wav, prompt_text)
        prompt_wav, prompt_text = chosen.wav, chosen.text
        if chosen.default:
            _check_prompt(prompt_wav, f"the prompt of {model}")
        long_tokens = default_long_tokens(bundle.dims, quick=quick) if tokens is None else tokens
        most = bundle.manifest.tables[FLOW_NOISE].shape[2] // bundle.dims.token_mel_ratio
        if long_tokens > most:  # the prompt's tokens take their share of the same frames
            raise BenchError(f"--tokens {long_tokens}: at most {most} for {model}, whose flow noise table "
                             f"holds {most} tokens' frames, the prompt's included")
        threads = threads or usable_cpus()
        settings = Settings(
            model=model, prompt_wav=prompt_wav, prompt_text=prompt_text, cases=make_cases(names, long_tokens),
            concurrency=levels, threads=threads, provider=provider,
            repeat=repeat or (1 if quick else 3), quick=quick, seed=seed, model_dir=model_dir,
            latency_policy=chunk_policy, chunk_slots=chunk_slots, cuda_graphs=uses_graphs,
            stack_dit=stack_dit, stack_vocoder=stack_vocoder,
            thread_scaling=thread_scaling if thread_scaling is not None else threads >= 2 and not quick)
        result = run(settings, progress=progress)
        written = list(plot_paths(json_out).values()) if plots and json_out is not None else []
        result["plots"] = [str(p) for p in written]
        click.echo(render(result))  # before the files: a disk that fills loses none of the figures
        if json_out is not None:
            try:
                if written:
                    write_plots(result, json_out)
                write_json_atomic(json_out, result)
            except OSError as e:
                raise BenchError(f"{e.filename or json_out}: cannot be written ({e.strerror or e}); the "
                                 "figures are in the table above") from None
    if json_out is not None:
        click.echo(f"\nwrote {json_out}")
    for path in written:
        click.echo(f"wrote {path}")
