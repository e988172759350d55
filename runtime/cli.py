"""`cosyvoice-run`: text + prompt recording -> 24 kHz audio (WAV, FLAC, MP3, Ogg), offline or streamed,
without torch.

A thin layer over `CosyVoice3`: its front end normalises and splits the text, each segment is formatted
for the mode, tokenised and synthesised in turn, and the segments' audio is concatenated.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click
import numpy as np

from .atomic_files import atomic_paths, check_writable, refuse_overwriting_inputs, resolved, write_json
from .audio_files import AUDIO_OUT_HELP, WAV, audio_bytes, audio_format, pcm16, streaming_wav_header
from .bundle import RuntimeBundle
from .bundle_source import (
    MODEL_DIR_ENV,
    BundleFront,
    PromptChoice,
    bundle_front,
    bundle_graphs,
    choose_bundle,
    choose_prompt,
    requested_bundle,
)
from .chunk_policy import ChunkPolicy
from .cli_options import (
    FLOW_WINDOW_HELP,
    THREADS,
    FiniteFloatRange,
    NonEmptyPath,
    chunk_policy_options,
    one_line_errors,
)
from .cosyvoice3 import CosyVoice3
from .demo import DEMO_BUNDLE
from .errors import UserError
from .frontend import PromptFeatures, TextFrontend, TextTokenizer, read_prompt_audio
from .progress import SynthesisProgress
from .runners import CPU, PROVIDERS
from .runners.ort_settings import TUNING_FILE, read_tuning
from .sampling import SAMPLINGS
from .segments import MAX_TEXT_CHARS, Segment, checked_segments
from .synthesis import Mode, check_options
from .tuning import tune

ONLY_WITH_INFO = ("model", "verify", "info", "tune")
"""The parameters `--info` and `--tune` read: every other one given with them would go unused."""


def _refuse_unused(ctx: click.Context, flag: str) -> None:
    """One line and exit status 2 where options that `flag` does not use were given (a `--provider cuda`
    with `--tune` would tune the CPU unsaid)."""
    unused = [param.opts[0] for param in ctx.command.params
              if param.name not in ONLY_WITH_INFO and param.name is not None
              and ctx.get_parameter_source(param.name) not in (None, click.core.ParameterSource.DEFAULT)]
    if unused:
        with one_line_errors():
            raise UserError(f"{flag} takes only --model and --verify; {', '.join(unused)} would go unused")


def _read_text(text: str, stdin: IO[bytes]) -> str:
    if text == "-":  # UTF-8 in any locale, read as a text file is: a byte-order mark dropped, "\n" ends lines
        try:
            text = stdin.read().decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
            text = text.removesuffix("\n")  # the last line's end (`echo`), which upstream strips anyway
        except UnicodeDecodeError as e:
            raise UserError(f"--text - (stdin) is not valid UTF-8: byte 0x{e.object[e.start]:02x} cannot be "
                            "decoded") from None
    if not text.strip():
        raise UserError("--text is empty")
    return _checked_text(text, "--text")


def _checked_text(text: str, option: str) -> str:
    """`text`, refused where it is over `MAX_TEXT_CHARS` or holds bytes that are not UTF-8 (which Python
    decodes from the command line, and from stdin in a C locale, as lone surrogates)."""
    if len(text) > MAX_TEXT_CHARS:
        raise UserError(f"{option} is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{option} is not valid UTF-8: character {e.start + 1} is an undecodable byte"
                        ) from None
    return text


def _check_mode(mode: Mode, prompt_wav: Path | None, prompt_text: str | None, instruct: str | None) -> None:
    """Refuse a transcript or instruction `mode` would not use, or one it needs and lacks (without
    --prompt-wav, zero-shot takes the bundle prompt's transcript, known once the bundle is open)."""
    if instruct is not None and mode is not Mode.INSTRUCT2:
        raise UserError(f"--instruct needs --mode {Mode.INSTRUCT2.value} ({mode.value} takes no instruction)")
    if prompt_text is not None and mode is not Mode.ZERO_SHOT:
        raise UserError(f"--prompt-text needs --mode {Mode.ZERO_SHOT.value} ({mode.value} takes no "
                        "transcript)")
    if mode is Mode.ZERO_SHOT and (prompt_wav is not None or prompt_text is not None) and not (
            prompt_text or "").strip():
        raise UserError("zero-shot needs --prompt-text (the transcript of --prompt-wav)")
    if mode is Mode.INSTRUCT2 and not (instruct or "").strip():
        raise UserError("instruct2 needs --instruct")


def _check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse outputs that could not be written, two options naming the same file (one would be lost), and
    an output that would overwrite one of `inputs` or a file of one of its folders."""
    given = {option: path for option, path in outputs.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in given.items():
        if str(path) == "-":  # `--text -` reads stdin; the side outputs are files
            raise UserError(f"{option} -: only --out writes to standard output; give a file name")
        other = seen.setdefault(resolved(path, option), option)
        if other != option:
            raise UserError(f"{other} and {option} name the same file {path}; give each its own")
    for option, path in given.items():
        refuse_overwriting_inputs(path, option, inputs)
        check_writable(path, option)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "--bundle", "model", type=NonEmptyPath(file_okay=False, path_type=Path),
              help=f"Runtime bundle (cosyvoice-export all), or a model bundle to export on first use "
                   f"(needs the export extra). Default: ${MODEL_DIR_ENV}, else the embedded demo bundle.")
@click.option("--text",
              help=f"Text to speak; '-' reads stdin (UTF-8, whatever the locale). Long text is split into "
                   f"sentences; at most {MAX_TEXT_CHARS} characters. Required, as --out is, unless --info.")
@click.option("--prompt-wav", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Prompt recording (any soundfile format, >= 16 kHz, 0.5-30 s of speech). "
                   "Default: the bundle's own prompt, if it has one (the demo bundle does).")
@click.option("--prompt-text", default=None,
              help=f"Transcript of the prompt recording (zero-shot; at most {MAX_TEXT_CHARS} characters). "
                   "Default: the bundle prompt's, when --prompt-wav is not given.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.ZERO_SHOT.value,
              show_default=True, help="Upstream's inference entry point.")
@click.option("--instruct", default=None,
              help=f"Instruction (instruct2), e.g. 'Speak slowly.'; at most {MAX_TEXT_CHARS} characters.")
@click.option("--sampling", type=click.Choice(SAMPLINGS), default="ras", show_default=True,
              help="ras: upstream's repetition-aware sampling; greedy: argmax (exact comparisons).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the RAS sampler.")
@click.option("--speed", type=FiniteFloatRange(min=0.5, max=2.0), default=1.0, show_default=True,
              help="Speaking rate (offline only, as upstream).")
@click.option("--stream", is_flag=True, help="Synthesise in streaming chunks (upstream's chunk schedule).")
@chunk_policy_options("With --stream: the first chunk after N speech tokens, later chunks on upstream's "
                      "boundaries (lower latency; a deviation from upstream's schedule) [default: "
                      "upstream's].", "With --stream: " + FLOW_WINDOW_HELP)
@click.option("--provider", type=click.Choice(PROVIDERS), default=CPU, show_default=True,
              help="onnxruntime cpu/cuda/tensorrt provider, trt for the bundle's TensorRT plans, or openvino "
                   "(OpenVINO's CPU plugin; bf16 graphs run on it under cpu too).")
@click.option("--threads", type=THREADS, default=None,
              help="onnxruntime's intra-op threads per graph  [default: the bundle's tuning file, else the "
                   "measured setting, else one per core]")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Replay the LLM's decode steps from CUDA graphs: --provider cuda with a bundle whose "
                   "decode steps run on llm_decode (--precision decode=fp16 or gpu-fp16); the DiT's calls "
                   "too where it is tf32's or gpu-fp16's  [default: wherever they can]")
@click.option("--tokens-out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write the speech tokens of every segment as JSON.")
@click.option("--chunks-out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Also write every streamed chunk's ranges, sha256 and timings as JSON (--stream).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check every bundle file's sha256 against the manifest before running "
                   "(several files at once, under a second per GB); sizes are always checked.")
@click.option("--out", type=NonEmptyPath(dir_okay=False, path_type=Path),
              help=f"{AUDIO_OUT_HELP} '-': WAV on standard output, for a player (`| aplay`), each chunk as "
                   "it is made with --stream.")
@click.option("--info", is_flag=True,
              help="Print the bundle's summary (where it is, format version, model dims, sample rate, each "
                   "graph's precision, the LLM checkpoint, TensorRT plans) and exit; needs no --text or "
                   "--out.")
@click.option("--tune", is_flag=True,
              help=f"Time onnxruntime's optimisation levels and thread counts per graph on this machine "
                   f"(minutes for a full-size bundle; other processes on the cores change the choice, so run "
                   f"it as loaded as the machine will be), write the fastest into the bundle's "
                   f"{TUNING_FILE}, which later runs use, and exit; needs no --text or --out.")
def main(model: Path | None, text: str | None, prompt_wav: Path | None, prompt_text: str | None, mode: str,
         instruct: str | None, sampling: str, seed: int, speed: float, stream: bool,
         chunk_policy: ChunkPolicy | None, provider: str, threads: int | None, cuda_graphs: bool | None,
         tokens_out: Path | None,
         chunks_out: Path | None, verify: bool, out: Path | None, info: bool, tune: bool) -> None:
    """Synthesise TEXT in the voice of --prompt-wav with a CosyVoice3 runtime bundle (no torch).

    Prints which bundle and prompt it uses, shows progress, and ends with the RTF (and the first
    chunk's latency when streaming). Bad input gives one line on stderr, exit status 2 and no output.
    """
    if info and tune:
        with one_line_errors():
            raise UserError("--info and --tune: give one")
    if info or tune:
        _refuse_unused(click.get_current_context(), "--info" if info else "--tune")
    if info:
        _print_info(model, verify)
        return
    if tune:
        _tune(model, verify)
        return
    if text is None or out is None:
        raise click.UsageError(f"Missing option '{'--text' if text is None else '--out'}'.")
    with one_line_errors():
        text = _read_text(text, sys.stdin.buffer)
        for option, value in (("--prompt-text", prompt_text), ("--instruct", instruct)):
            if value is not None:
                _checked_text(value, option)
        _check_mode(Mode(mode), prompt_wav, prompt_text, instruct)
        if stream and speed != 1.0:
            raise UserError("--speed works offline only (upstream ignores it when streaming)")
        if chunks_out is not None and not stream:
            raise UserError("--chunks-out needs --stream")
        if chunk_policy is not None and not stream:
            given = "--first-chunk-tokens" if chunk_policy.first_chunk_tokens is not None else "--flow-window"
            raise UserError(f"{given} needs --stream")
        # refused now, not after the synthesis with some outputs written
        bundle, named = requested_bundle(model)
        to_stdout = str(out) == "-"
        stdout = sys.stdout.buffer
        if to_stdout and stdout.isatty():
            raise UserError("--out -: standard output is a terminal; pipe it into a player (`| aplay`) or "
                            "give a file name")
        out_format = WAV if to_stdout else audio_format(out, "--out")
        _check_outputs({"--out": None if to_stdout else out, "--tokens-out": tokens_out,
                        "--chunks-out": chunks_out}, {"--prompt-wav": prompt_wav, named: bundle})
        start = time.perf_counter()
        # a bad recording, prompt or text is refused before a model bundle is exported, or a runtime
        # bundle's hashes checked and its graphs opened: the prompt and the text front end need the
        # bundle's tokenizer and own prompt only
        given_audio = read_prompt_audio(prompt_wav) if prompt_wav is not None else None
        pieces, chosen = _pieces(bundle_front(model), Mode(mode), text, prompt_wav, prompt_text, instruct)
        check_options(bundle_graphs(model), provider, chunk_policy=chunk_policy, cuda_graphs=cuda_graphs,
                      threads=threads)
        choice = choose_bundle(model, provider=provider)
        if choice.default:
            click.echo(f"model: {choice.origin}", err=True)
        with CosyVoice3(choice.path, provider=provider, threads=threads, sampling=sampling, seed=seed,
                        verify=verify, chunk_policy=chunk_policy, cuda_graphs=cuda_graphs) as voice:
            if chosen.default:
                click.echo(f"prompt: the bundle's {chosen.wav.name} ({chosen.text!r})", err=True)
            prompt = voice.prompt_features(given_audio if given_audio is not None else chosen.wav)
            ready = time.perf_counter()
            with _reader_may_leave():
                streamed = _stream_wav(stdout, voice.sample_rate) if to_stdout and stream else None
                result = _run(voice, pieces, prompt, Mode(mode), speed, stream, streamed)
            sample_rate = voice.sample_rate
        audio = np.concatenate(result.audio) if result.audio else np.zeros(0, np.float32)
        sides = {path: data for path, data in (
            (tokens_out, [{"text": p.text, "speech_tokens": t} for p, t in zip(pieces, result.tokens,
                                                                               strict=True)]),
            (chunks_out, result.chunks)) if path is not None}
        encoded = None if to_stdout else audio_bytes(audio, sample_rate, out_format)
        try:
            with atomic_paths([*([] if encoded is None else [out]), *sides]) as written:  # all files or none
                if encoded is not None:
                    written.pop(0).write_bytes(encoded)
                for tmp, data in zip(written, sides.values(), strict=True):
                    write_json(tmp, data)
        except OSError as e:
            raise UserError(f"writing {e.filename or out}: {e.strerror or e}; no "
                            f"{'file' if to_stdout else 'output'} was written") from None
        if to_stdout and not stream:  # a streamed run's chunks have gone out already
            with _reader_may_leave():
                _write_all(stdout, audio_bytes(audio, sample_rate, out_format))
    seconds = len(audio) / sample_rate
    work = time.perf_counter() - ready
    latency = f", first chunk after {result.first_chunk:.3f} s" if result.first_chunk is not None else ""
    click.echo(f"wrote {'standard output' if to_stdout else out}: {seconds:.2f} s at {sample_rate} Hz, "
               f"{len(pieces)} segment(s), {sum(len(t) for t in result.tokens)} speech tokens ({mode}, "
               f"{sampling}, seed {seed}); RTF {work / max(seconds, 1e-9):.3f}{latency}; load "
               f"{ready - start:.2f} s", err=to_stdout)


def _pieces(front: BundleFront, mode: Mode, text: str, prompt_wav: Path | None, prompt_text: str | None,
            instruct: str | None) -> tuple[list[Segment], PromptChoice]:
    """The segments of `text` and the prompt they are spoken in (the bundle's own where `prompt_wav` is not
    given); a `UserError` where there is no prompt, no transcript zero-shot needs, or nothing to speak."""
    chosen = choose_prompt(front, prompt_wav, prompt_text)
    if mode is Mode.ZERO_SHOT and not chosen.text.strip():
        raise UserError(f"zero-shot needs --prompt-text: the bundle's prompt {chosen.wav.name} has no "
                        "transcript")
    tokenizer = TextTokenizer(front.tokenizer_dir)
    pieces = checked_segments(text, mode, tokenizer, TextFrontend(tokenizer), prompt_text=chosen.text,
                              instruct=instruct or "", text_name="--text")
    return pieces, chosen


def _print_info(model: Path | None, verify: bool) -> None:
    """--info: the chosen bundle's summary on stdout."""
    with one_line_errors():
        choice = choose_bundle(model)
        if choice.default:
            click.echo(f"model: {choice.origin}", err=True)
        bundle = RuntimeBundle.open(choice.path, verify=verify)
    for line in bundle.summary():
        click.echo(line)


def _tune(model: Path | None, verify: bool) -> None:
    """--tune: measure and write the chosen bundle's tuning file, a line per graph as it is chosen."""
    with one_line_errors():
        choice = choose_bundle(model)
        if choice.path == DEMO_BUNDLE:  # it lives in the installed package
            raise UserError(f"--tune needs --model or ${MODEL_DIR_ENV}; the embedded demo bundle is not "
                            "tuned")
        check_writable(choice.path / TUNING_FILE, "--tune")  # before the minutes of timing, not after
        if choice.default:
            click.echo(f"model: {choice.origin}", err=True)
        bundle = RuntimeBundle.open(choice.path, verify=verify)
        path = tune(bundle, on_result=lambda graph, s, seconds, ratio: click.echo(
            f"{graph}: {s.optimization}, {s.threads} thread(s): {seconds * 1e3:.1f} ms, {ratio:.2f}x the "
            "default", err=True))
    for graph, setting in read_tuning(bundle.root).items():
        click.echo(f"{graph}: {setting.optimization}, {setting.threads} thread(s)")
    click.echo(f"wrote {path}")


@dataclass
class _Result:
    audio: list[np.ndarray]
    tokens: list[list[int]]
    chunks: list[dict[str, Any]]
    first_chunk: float | None


def _run(voice: CosyVoice3, pieces: list[Segment], prompt: PromptFeatures, mode: Mode, speed: float,
         stream: bool, streamed: Callable[[np.ndarray], None] | None = None) -> _Result:
    """Each segment in turn (each with a fresh sampler from the seed, as a fresh upstream request); each
    streamed chunk's samples also to `streamed`, as the chunk is made."""
    result = _Result([], [], [], None)
    start = time.perf_counter()
    with SynthesisProgress(pieces) as progress:
        for i, piece in enumerate(pieces):
            speech = voice.speak(piece, prompt, mode, stream=stream, speed=speed, watch=progress.watch(i))
            for chunk in speech:
                result.audio.append(chunk.samples)
                if stream:
                    if result.first_chunk is None:
                        result.first_chunk = time.perf_counter() - start
                    result.chunks.append(chunk.record(i))
                    if streamed is not None:
                        streamed(chunk.samples)
            result.tokens.append(list(speech.speech_tokens))
    return result


def _stream_wav(stdout: IO[bytes], sample_rate: int) -> Callable[[np.ndarray], None]:
    """`--out -` with `--stream`: a WAV whose header, sizes unknown, leaves at once, then each chunk's
    samples as the chunk is made, so that a player starts on the first chunk."""
    _write_all(stdout, streaming_wav_header(sample_rate))
    return lambda samples: _write_all(stdout, pcm16(samples))


def _write_all(stream: IO[bytes], data: bytes) -> None:
    """`data` whole, then flushed: a buffered write may take a part (of a pipe whose reader left midway,
    without an error) and the next one raises."""
    view = memoryview(data)
    while view:
        view = view[stream.write(view):]
    stream.flush()


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """`--out -` whose reader closed the pipe (a player quit): the synthesis stops; one line, exit 1."""
    try:
        yield
    except BrokenPipeError:
        # what is still buffered for the pipe would fail again as Python exits (no file descriptor: nothing)
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        click.echo("error: --out -: its reader closed standard output before the audio's end", err=True)
        sys.exit(1)
