"""`cosyvoice-export`: model bundles, manifests and the torch reference synthesis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click

from cosyvoice_graphs.pipeline import PipelineError
from cosyvoice_graphs.precision_plan import GRAPH_ALIASES, PROFILES, PrecisionPlanError
from cosyvoice_graphs.providers import PROVIDERS
from cosyvoice_runtime.atomic_files import check_writable
from cosyvoice_runtime.audio_files import AUDIO_OUT_HELP, audio_format, write_audio_atomic
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import MODEL_DIR_ENV, console_script
from cosyvoice_runtime.cli_options import FiniteFloatRange, NonEmptyPath
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.extras import Terminated, require_extra
from cosyvoice_runtime.sampling import MAX_SEED
from cosyvoice_runtime.speakers import SPEAKERS_DIR_ENV
from cosyvoice_runtime.synthesis import Mode

from .bundle.errors import BundleError
from .bundle.layout import LLM_CHECKPOINTS, LLM_VARIANTS, PROMPT_WAV
from .download import DEFAULT_DIR, SOURCES

SIZES = click.Choice(["tiny", "full"])
DEFAULT_DEMO_BUNDLE = Path("bundles/tiny")
LLM_OPTION = click.option(
    "--llm", type=click.Choice(list(LLM_VARIANTS)), default="base", show_default=True,
    help="The LLM checkpoint: base = llm.pt, the one upstream's loader reads; rl = llm.rl.pt, the release's "
         "reinforcement-learned LLM (same keys), checked in llm.pt's place; both = the two.")


class _Group(click.Group):
    """Turns user errors (bad bundles, bad input files, unwritable outputs) into one line on stderr and exit
    status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (BundleError, FileExistsError, UserError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Export Fun-CosyVoice3-0.5B and run its torch reference.

    A model bundle is upstream's model directory: cosyvoice3.yaml, llm.pt, flow.pt, hift.pt,
    CosyVoice-BlankEN/, campplus.onnx, speech_tokenizer_v3.onnx. `tiny-bundle` writes one with
    random weights for tests and benchmarks.
    """


@main.command()
@click.option("--size", type=SIZES, default="full", show_default=True,
              help="full: the released model's dims; tiny: the dims of our test bundles.")
@click.option("--network", type=click.Choice(["llm", "flow", "hift", "all"]), default="all",
              show_default=True)
def manifest(size: str, network: str) -> None:
    """Print the state-dict keys, shapes and dtypes our networks expect (TSV: key, shape, dtype).

    Same format as upstream's checkpoint manifests, so an unusual checkpoint can be diffed against it.
    With --network all, each table is preceded by a `# llm.pt` style comment line.
    """
    from .bundle.tiny import config_for_size
    from .manifest import NETWORKS, manifest_tsv

    cfg = config_for_size(size)
    names = NETWORKS if network == "all" else (network,)
    for name in names:
        if len(names) > 1:
            click.echo(f"# {name}.pt")
        click.echo(manifest_tsv(cfg, name), nl=False)


def model_dir_option(default: Path | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """MODEL_DIR as an argument, or as `--model-dir` as `all` and the other commands name it (either, not
    both); `default` where neither is given, or required when None."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.argument("model_dir", required=False, type=NonEmptyPath(path_type=Path))(command)
        return click.option("--model-dir", "model_dir_option", type=NonEmptyPath(path_type=Path),
                            help="The model directory (or give it as MODEL_DIR).")(command)
    return decorate


def one_model_dir(argument: Path | None, option: Path | None, default: Path | None) -> Path:
    """The model directory of `model_dir_option`'s two spellings."""
    if argument is not None and option is not None and argument != option:
        raise click.UsageError(f"MODEL_DIR {argument} and --model-dir {option}: give one")
    chosen = argument or option or default
    if chosen is None:
        raise click.UsageError("Missing MODEL_DIR (or --model-dir).")
    return chosen


@main.command("check-bundle")
@model_dir_option(None)
@LLM_OPTION
def check_bundle_cmd(model_dir: Path | None, model_dir_option: Path | None, llm: str) -> None:
    """Check that MODEL_DIR is a complete CosyVoice3 model directory of the expected shapes.

    Prints one line per file that passed; on the first problem prints one line naming the file
    (and key) with what was expected and found, and exits with status 2.
    """
    from .bundle.model_dir import ModelBundle

    require_extra("export")
    model_dir = one_model_dir(model_dir, model_dir_option, None)
    ModelBundle.open(model_dir)  # the folder is judged before the checks' libraries (torch, onnx) load
    from .bundle.check import check_bundle

    check_bundle(model_dir, report=click.echo, llm_checkpoints=LLM_VARIANTS[llm])
    click.echo(f"{model_dir}: bundle ok")


@main.command("download")
@model_dir_option(DEFAULT_DIR)
@click.option("--source", type=click.Choice(SOURCES), default="huggingface", show_default=True,
              help="The hub: huggingface ($HF_ENDPOINT, else huggingface.co), or modelscope (needs "
                   "`pip install modelscope`).")
@click.option("--revision", help="Branch, tag or commit of the release [default: the hub's default branch].")
@LLM_OPTION
def download_cmd(model_dir: Path | None, model_dir_option: Path | None, source: str, revision: str | None,
                 llm: str) -> None:
    """Download Fun-CosyVoice3-0.5B into MODEL_DIR [default: pretrained_models/Fun-CosyVoice3-0.5B], then
    check it as `check-bundle` does.

    Fetches only what the exporter and runtime read: cosyvoice3.yaml, the LLM checkpoint(s) of --llm,
    flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v3.onnx, CosyVoice-BlankEN/ without its
    model.safetensors (llm.pt carries those weights), and asset/. An interrupted download resumes when run
    again (Ctrl-C stops it at once); files already fetched are skipped. With --llm rl alone, export with
    `all --llm rl` (upstream's loader reads llm.pt only). A hub that asks for a token reads $HF_TOKEN (or
    `huggingface-cli login`'s). A release in the Hugging Face cache (`hf download`'s) is placed from there
    instead of fetched again: at the hub's commit, or where Hugging Face cannot be reached (or
    $HF_HUB_OFFLINE is set) at --revision. A hub that cannot be reached without such a cache,
    or a missing repository or revision, is one line on stderr saying how to place the files by hand, and
    exit status 2.
    """
    from .download import DownloadError, download

    require_extra("export")  # the check after the download needs it
    model_dir = one_model_dir(model_dir, model_dir_option, DEFAULT_DIR)
    check_writable(model_dir, "MODEL_DIR", directory=True)
    try:
        download(model_dir, source=source, revision=revision, llm=llm,
                 warn=lambda line: click.echo(line, err=True))
    except DownloadError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        # on a line of its own, below the progress bar
        click.echo("\ninterrupted: run the same command again to resume the download", err=True)
        sys.stdout.flush()
        os._exit(130)  # the hub client's threads would finish their files first
    from .bundle.check import check_bundle  # torch and onnx: not for a hub that cannot be reached

    try:
        check_bundle(model_dir, report=click.echo, llm_checkpoints=LLM_VARIANTS[llm])
    except BundleError as e:
        raise BundleError(f"{e}; if the download left the file damaged, delete it and run this command again "
                          "to fetch it anew") from None
    click.echo(f"{model_dir}: bundle ok")


@main.command("tiny-bundle")
@click.argument("out", type=NonEmptyPath(path_type=Path))
@click.option("--size", type=SIZES, default="tiny", show_default=True,
              help="tiny: seconds, a few MB, for tests; full: the real dims with random weights "
                   "(~4.2 GB, about a minute), for benchmarks.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the random weights.")
@click.option("--force", is_flag=True,
              help="Replace OUT if it exists: an empty folder, or a model bundle this command wrote (a "
                   "folder holding anything else is refused, never deleted).")
def tiny_bundle_cmd(out: Path, size: str, seed: int, force: bool) -> None:
    """Write a random-weight model bundle in upstream's exact file format to OUT."""
    from .bundle.tiny import write_bundle

    check_writable(out, "OUT", directory=True)
    write_bundle(out, size=size, seed=seed, force=force, progress=True)
    click.echo(f"wrote {size} bundle (seed {seed}) to {out}")


def _providers_option(ctx: click.Context, param: click.Parameter, value: str | None
                      ) -> tuple[str, ...] | None:
    """`--providers`: comma-separated names of `PROVIDERS`, each once; None where not given."""
    if value is None:
        return None
    names = tuple(name.strip() for name in value.split(","))
    for name in names:
        if name not in PROVIDERS:
            raise click.BadParameter(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{value!r} names a provider twice")
    return names


@main.command("all")
@click.option("--model-dir", type=NonEmptyPath(path_type=Path), required=True,
              help="The CosyVoice3 model bundle (upstream's model directory).")
@click.option("--out", type=NonEmptyPath(path_type=Path), required=True,
              help="The runtime bundle to write: a new or empty directory, or one this command wrote.")
@click.option("--trt", is_flag=True,
              help="Also build a TensorRT plan per graph (cached by ONNX sha256 + profile + GPU + TensorRT "
                   "version) and validate it against onnxruntime. Needs a CUDA device and the export-gpu "
                   "extra. fp16 graphs are then written in standard operators, which TensorRT parses; "
                   "without --trt their DiT and llm use onnxruntime's own attention and rotary operators.")
@click.option("--llm", type=click.Choice(list(LLM_CHECKPOINTS)), default="base", show_default=True,
              help="The LLM to export: base = llm.pt, the one upstream's loader reads; rl = llm.rl.pt, the "
                   "release's reinforcement-learned LLM (same keys). The manifest records which, with its "
                   "sha256 (cosyvoice-run --info prints it).")
@click.option("--force", is_flag=True, help="Export every graph again, even unchanged ones.")
@click.option("--reuse-from", "reuse_from", multiple=True,
              type=NonEmptyPath(exists=True, file_okay=False, path_type=Path), metavar="DIR",
              help="Another runtime bundle this command exported from the same model (another "
                   "precision's): a graph it holds that this export would make alike (the same sources, spec "
                   "version, exporter and precision; validated there, its files intact) is hard-linked from "
                   "it (copied where the file system cannot link) instead of exported again. Repeatable.")
@click.option("--wait", is_flag=True,
              help="If another export into OUT is running, wait for it to finish, then reuse what it "
                   "exported (without --wait: stop at once, exit 2).")
@click.option("--precision", default="fp32", show_default=True,
              metavar="PRECISION|PROFILE|GRAPH=PRECISION,...",
              help="A precision for the bundle (each graph whose spec bounds it gets a body in it, the "
                   "others stay float32), a profile, or a precision per graph, as llm=int4,dit=int8 "
                   f"(graphs by name or alias: {', '.join(GRAPH_ALIASES)}; graphs not named stay float32). "
                   "Precisions: "
                   "tf32 (for CUDA): the float32 graphs, which the CUDA provider computes with TF32 "
                   "matmuls and convolutions (fp32's in float32), the DiT written for onnxruntime. "
                   "fp16: float16 weights and matmul/conv compute, fragile ops (norms, softmax, time "
                   "embedding, output projections, HiFT's source and Snake) and all graph I/O in float32; "
                   "hift_f0 has none. int8: the llm's and the DiT blocks' matmul weights in int8 "
                   "(caches, norms, rotary, softmax, time embedding, AdaLN, output heads and I/O in "
                   "float32). int4: the llm's matmul weights in 4 bits (the DiT has none). bf16: the DiT and "
                   "HiFT's decoder run in bfloat16 by OpenVINO (needs AVX512-BF16 or AMX and the openvino "
                   "extra). Profiles: "
                   + "; ".join(f"{name} = " + ",".join(f"{g}={p}" for g, p in graphs.items())
                               for name, graphs in PROFILES.items())
                   + ". Each graph is validated with its spec's bounds for its precision (and the llm's "
                   "decode gates, the DiT's solve gates); the manifest and each graph's metadata record it. "
                   "OUT holds one --precision.")
@click.option("--providers", callback=_providers_option, metavar="PROVIDER,...",
              help="Export only the graphs the runtime opens on these providers (of "
                   f"{', '.join(PROVIDERS)}), each checked to run the precision first. The LLM's decode "
                   "steps run on llm_decode where a profile has one (onnxruntime's cpu, and cuda in fp16), "
                   "so --precision cpu-fast --providers cpu, or decode=fp16,dit=tf32 --providers cuda, "
                   "leaves out llm: a fifth to a third of the export's time on a 2-core Zen 4, and its "
                   "size on disk. "
                   "[default: every graph of the precision]")
@click.option("--report-memory", is_flag=True,
              help="After the summary, print each stage's time, peak RSS and the RSS it left (loading the "
                   "networks, tracing, onnxslim, saving, precision conversion, validation, per graph), then "
                   "the export's peak RSS.")
def all_cmd(model_dir: Path, out: Path, trt: bool, llm: str, force: bool, reuse_from: tuple[Path, ...],
            wait: bool, precision: str, providers: tuple[str, ...] | None, report_memory: bool) -> None:
    """Export the model to a torch-free runtime bundle in OUT: its graphs in ONNX (every one, or those
    --providers open).

    Each graph is traced from its spec, checked (onnx.checker, then its I/O against the spec),
    simplified with onnxslim, and validated against the torch networks with the spec's tolerances at
    shapes other than the trace shape. OUT also gets the embedding and noise tables, the frontend
    ONNX models, the tokenizer files and the yaml, then manifest.json last (every file with its
    sha256, the graphs' spec versions and validation figures).

    A second run into the same OUT skips graphs whose spec version, source checkpoints and exporter
    are unchanged (unless --force), takes such graphs from the bundles named by --reuse-from, and
    deletes graphs an earlier exporter made that this one no longer does. One export runs into an OUT
    at a time (it holds the lock file OUT.lock beside OUT, which stays); a second one stops with one
    line, or waits with --wait. Prints a summary table; exits 1 if a graph fails validation (no manifest
    is written then), 2 on a bad bundle or unusable OUT, 130 when interrupted (Ctrl-C).
    """
    from .memory import monitor_memory
    from .onnx.bf16 import Bf16Unavailable
    from .onnx.errors import ExportError
    from .onnx.export_plan import plan_export
    from .onnx.output_dir import locked
    from .onnx.trt import TrtUnavailable

    require_extra("export")
    try:
        # export_all's two halves: what cannot run is refused before torch and onnx load
        job = plan_export(model_dir, out, llm=llm, trt=trt, precision=precision, reuse_from=reuse_from,
                          providers=providers)
        with locked(job.out, wait):
            from .onnx.bundle_assembly import assemble

            # the monitor restarts the kernel's peak-RSS mark at every stage: only when asked to
            with monitor_memory() if report_memory else nullcontext() as memory:
                report = assemble(job, force, progress=True)
    except (TrtUnavailable, Bf16Unavailable, PrecisionPlanError, PipelineError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ExportError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except OSError as e:  # a full disk, a file-size limit: the files being written are removed again
        # numpy's short write has neither an errno nor a file name
        reason = e.strerror or f"a write stopped short ({e}): a full disk or a file-size limit (ulimit -f)"
        click.echo(f"error: {e.filename or out}: {reason}", err=True)
        sys.exit(2)
    click.echo(report.table())
    if memory is not None:
        click.echo(memory.table())
    for failure in report.failures:
        click.echo(f"error: {failure}", err=True)
    if not report.passed:
        sys.exit(1)


def _default_prompt(model_dir: Path, prompt_wav: Path | None, prompt_text: str | None
                    ) -> tuple[Path, str | None]:
    """The given prompt, else the bundle's demo prompt and its transcript (our bundles carry one)."""
    from .bundle.layout import PROMPT_TEXT, PROMPT_WAV

    if prompt_wav is not None:
        return prompt_wav, prompt_text
    prompt_wav = model_dir / PROMPT_WAV
    if not prompt_wav.is_file():
        raise BundleError(f"{prompt_wav}: file not found; pass --prompt-wav")
    if prompt_text is None and (model_dir / PROMPT_TEXT).is_file():
        prompt_text = (model_dir / PROMPT_TEXT).read_text().strip()
    return prompt_wav, prompt_text


def _demo_prompt(model_dir: Path, prompt_wav: Path | None, prompt_text: str | None
                 ) -> tuple[Path, str, Mode, str | None]:
    """The demo's prompt recording, transcript and mode, and a line for the user where the choice is not
    the obvious one: the given recording, else the model's own, else the embedded demo bundle's synthetic
    one (a model may carry none, upstream's release among them, and the demo is to run every stage all the
    same); cross-lingual where no transcript goes with the recording (zero-shot needs one)."""
    if prompt_wav is None and not (model_dir / PROMPT_WAV).is_file():
        if prompt_text is not None:
            raise UserError(f"--prompt-text without --prompt-wav: {model_dir} carries no prompt recording "
                            "for it to transcribe")
        demo = RuntimeBundle.open(DEMO_BUNDLE).default_prompt()
        assert demo is not None  # the embedded bundle carries its prompt (test_demo_bundle)
        return (*demo, Mode.ZERO_SHOT, f"prompt: {model_dir} carries none of its own: the embedded demo "
                "bundle's synthetic recording, which is not speech (--prompt-wav gives a voice)")
    wav, text = _default_prompt(model_dir, prompt_wav, prompt_text)
    if not (text or "").strip():
        return wav, "", Mode.CROSS_LINGUAL, (f"prompt: {wav} has no transcript: speaking cross-lingual "
                                             "(--prompt-text gives zero-shot)")
    return wav, text or "", Mode.ZERO_SHOT, None


def _synthesize(model_dir: Path, text: str, prompt_wav: Path | None, prompt_text: str | None, mode: str,
                instruct: str, sampling: str, seed: int, speed: float, out: Path) -> None:
    import numpy as np

    from .bundle.model_dir import ModelBundle

    require_extra("export")
    out_format = audio_format(out, "--out")
    check_writable(out, "--out")
    if not text.strip():
        raise UserError("--text: nothing to speak")
    if mode == Mode.INSTRUCT2.value and not instruct.strip():
        raise UserError(f"--mode {Mode.INSTRUCT2.value} needs --instruct, the instruction")
    if instruct and mode != Mode.INSTRUCT2.value:  # as cosyvoice-run refuses it: never dropped silently
        raise UserError(f"--instruct needs --mode {Mode.INSTRUCT2.value} ({mode} takes no instruction)")
    if prompt_text is not None and mode != Mode.ZERO_SHOT.value:
        raise UserError(f"--prompt-text needs --mode {Mode.ZERO_SHOT.value} ({mode} takes no transcript)")
    bundle = ModelBundle.open(model_dir)
    prompt_wav, prompt_text = _default_prompt(model_dir, prompt_wav, prompt_text)
    if mode == Mode.ZERO_SHOT.value and not (prompt_text or "").strip():
        raise UserError(f"--mode {Mode.ZERO_SHOT.value} needs --prompt-text, the recording's transcript")
    from .reference.llm_decode import TorchGreedySampler, TorchRasSampler  # torch: once the input is good
    from .reference.pipeline import ReferencePipeline

    pipe = ReferencePipeline(bundle)
    prompt = pipe.prompt_features(prompt_wav)
    generator = np.random.Generator(np.random.PCG64(seed))
    sampler = (TorchGreedySampler() if sampling == "greedy"
               else TorchRasSampler(bundle.config.llm.sampling, generator))
    result = pipe.synthesize(Mode(mode), text, prompt, sampler, prompt_text=prompt_text or "",
                             instruct_text=instruct, speed=speed)
    write_audio_atomic(out, result.audio, result.sample_rate, out_format)
    seconds = len(result.audio) / result.sample_rate
    click.echo(f"wrote {out}: {seconds:.2f} s at {result.sample_rate} Hz from {len(result.speech_tokens)} "
               f"speech tokens ({mode}, {sampling} sampling, seed {seed})")


_SYNTH_OPTIONS = [
    click.option("--text", required=True, help="Text to speak (one segment; no normalisation)."),
    click.option("--prompt-wav", type=NonEmptyPath(exists=True, dir_okay=False, path_type=Path),
                 help="Prompt recording (any soundfile format, >= 16 kHz). "
                      "Default: the bundle's demo prompt."),
    click.option("--prompt-text", help="Transcript of the prompt recording (zero-shot)."),
    click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.ZERO_SHOT.value,
                 show_default=True, help="Upstream's inference entry point."),
    click.option("--instruct", default="",
                 help="Instruction for instruct2, e.g. 'Please speak as fast as possible.'"),
    click.option("--sampling", type=click.Choice(["ras", "greedy"]), default="ras", show_default=True,
                 help="ras: upstream's repetition-aware sampling; greedy: argmax, for exact comparisons."),
    click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                 help="Seed of the sampler's generator."),
    click.option("--speed", type=FiniteFloatRange(min=0.5, max=2.0), default=1.0, show_default=True,
                 help="Speech rate, offline (the range cosyvoice-run takes)."),
    click.option("--out", type=NonEmptyPath(dir_okay=False, path_type=Path), required=True,
                 help=AUDIO_OUT_HELP),
]


def _synth_options(f: Any) -> Any:
    for option in reversed(_SYNTH_OPTIONS):
        f = option(f)
    return f


@main.command()
@click.option("--model-dir", type=NonEmptyPath(path_type=Path), required=True,
              help="The model directory (cosyvoice3.yaml, llm.pt, ...) the reference loads.")
@_synth_options
def synth(model_dir: Path, **kwargs: Any) -> None:
    """Synthesise speech with the torch reference pipeline (the oracle for the runtime)."""
    _synthesize(model_dir, **kwargs)


@main.command()
@click.option("--text", default="Hello from CosyVoice three.", show_default=True, help="Text to speak.")
@click.option("--prompt-wav", type=NonEmptyPath(exists=True, dir_okay=False, path_type=Path),
              help="Prompt recording. Default: the model's own (asset/zero_shot_prompt.wav), else the "
                   "embedded demo bundle's synthetic one.")
@click.option("--prompt-text", help="Its transcript. Default: the model's (asset/zero_shot_prompt.txt); "
                                    "without one the demo speaks cross-lingual.")
@click.option("--stream", is_flag=True, help="Synthesise in streaming chunks.")
@click.option("--out", type=NonEmptyPath(dir_okay=False, path_type=Path), default=Path("demo.wav"),
              show_default=True, help=AUDIO_OUT_HELP)
def demo(text: str, prompt_wav: Path | None, prompt_text: str | None, stream: bool, out: Path) -> None:
    """The main job end to end: model bundle -> runtime bundle -> torch-free synthesis.

    The model bundle is $COSYVOICE_MODEL_DIR, else a tiny random bundle at bundles/tiny (written
    first if missing, seed 0). It is exported to bundles/<name>-runtime (`all`; unchanged graphs
    are reused on later runs) and the `cosyvoice-run` command synthesises TEXT from it. Random
    weights make noise, not speech: the point is that every stage runs. A model without a prompt
    recording of its own (upstream's release may carry none) is prompted by the embedded demo
    bundle's, and a recording without a transcript is spoken cross-lingual; the command says so.
    """
    require_extra("export")
    audio_format(out, "--out")  # the name's format, and the folder's writable: before the minutes of export
    check_writable(out, "--out")
    env = os.environ.get(MODEL_DIR_ENV, "").strip()  # blank is unset, as for cosyvoice-run and -serve
    model_dir = Path(env) if env else DEFAULT_DEMO_BUNDLE
    if not env and not model_dir.exists():
        from .bundle.tiny import write_bundle

        try:
            write_bundle(model_dir, size="tiny", seed=0, force=False, progress=True)
            click.echo(f"wrote tiny bundle to {model_dir}")
        except FileExistsError:  # another demo wrote it meanwhile: the same seed, the same bundle
            pass
    if env:
        from .bundle.model_dir import ModelBundle

        try:
            ModelBundle.open(model_dir)  # the folder itself is judged before the prompt it should hold
        except BundleError as e:
            raise BundleError(f"${MODEL_DIR_ENV}: {e}") from None
    prompt_wav, prompt_text, mode, note = _demo_prompt(model_dir, prompt_wav, prompt_text)
    if note is not None:
        click.echo(note, err=True)
    from .onnx.bundle_assembly import export_all  # torch and onnx: once the input is good

    runtime_dir = DEFAULT_DEMO_BUNDLE.parent / f"{model_dir.resolve().name}-runtime"
    report = export_all(model_dir, runtime_dir, progress=True, wait=True)  # another demo's export: its result
    click.echo(report.table())
    if not report.passed:
        for failure in report.failures:
            click.echo(f"error: {failure}", err=True)
        sys.exit(1)
    command = console_script("cosyvoice-run")
    if command is None:
        raise BundleError("cosyvoice-run is not installed in this environment (pip install -e .)")
    run = [command, "--model", str(runtime_dir), "--text", text, "--prompt-wav", str(prompt_wav), "--mode",
           mode.value, *(["--prompt-text", prompt_text] if mode is Mode.ZERO_SHOT else []), "--out", str(out),
           *(["--stream"] if stream else [])]
    with subprocess.Popen(run) as child:  # the runtime as its users run it
        try:
            status = child.wait()
        except Terminated:  # it would run on alone
            child.terminate()
            child.wait()
            raise
    sys.exit(status)


@main.command("speakers")
@click.argument("spk2info", type=NonEmptyPath(dir_okay=False, path_type=Path))
@click.option("--out", type=NonEmptyPath(file_okay=False, path_type=Path),
              help=f"The speaker registry folder (cosyvoice-serve --speakers, CosyVoice3(speakers_dir=...)) "
                   f"[default: ${SPEAKERS_DIR_ENV} (blank: unset), else ~/.local/share/cosyvoice/speakers]")
@click.option("--model", type=NonEmptyPath(file_okay=False, path_type=Path),
              help=f"The bundle that will use them (cosyvoice-serve --model); default: ${MODEL_DIR_ENV}, "
                   "else the demo bundle, as cosyvoice-serve.")
def speakers_cmd(spk2info: Path, out: Path | None, model: Path | None) -> None:
    """Add the speakers of upstream's SPK2INFO (spk2info.pt, torch) to the runtime's speaker registry.

    Each zero-shot speaker (add_zero_shot_spk) becomes a registered speaker of the same name, its prompt
    tokens, mel, x-vector and transcript as upstream stored them, replacing one of that name;
    CosyVoice3.list_available_spks() lists them and cosyvoice-serve serves them. Everything is checked
    before anything is written; a problem is one line naming the file, speaker and key, and exit status 2.
    """
    require_extra("export")
    from cosyvoice_runtime.errors import USER_ERRORS
    from cosyvoice_runtime.speakers import default_speakers_dir

    from .speakers import convert_spk2info

    out = out or default_speakers_dir()
    check_writable(out, "--out", directory=True)  # before the bundle and the file are read, not after
    try:
        speakers = convert_spk2info(spk2info, out, model)
    except USER_ERRORS as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for speaker in speakers:
        click.echo(f"{speaker.name}: {speaker.features.speech_tokens.shape[1]} prompt tokens, "
                   f"transcript {speaker.prompt_text!r}")
    click.echo(f"{len(speakers)} speakers added to {out}")


@main.command("demo-bundle")
@click.option("--out", type=NonEmptyPath(file_okay=False, path_type=Path), default=None,
              help="Where to write it. Default: the runtime package's demo bundle (in a source checkout, "
                   "runtime/demo_bundle), which `cosyvoice-run` uses when given no model.")
def demo_bundle(out: Path | None) -> None:
    """Rewrite the demo runtime bundle: the tiny random model (seed 0) exported with `all`.

    The folder is replaced only once the new export is complete and validated. Commit the result; a
    test checks that the committed bundle still equals a fresh export.
    """
    if out is not None:
        check_writable(out, "--out", directory=True)  # before the export, not after it
    from .onnx.demo_bundle import write_demo_bundle

    path = write_demo_bundle(out, progress=True)
    click.echo(f"wrote the demo runtime bundle to {path}")
