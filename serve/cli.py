"""`cosyvoice-serve`: the HTTP server (uvicorn) or, with `--grpc`, the gRPC service over the torch-free
runtime."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from cosyvoice_graphs import MAX_BATCH
from cosyvoice_runtime.bundle_source import MODEL_DIR_ENV, check_requested_bundle
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.cli_options import FLOW_WINDOW_HELP, THREADS, NonEmptyPath, chunk_policy_options
from cosyvoice_runtime.errors import USER_ERRORS
from cosyvoice_runtime.extras import require_extra
from cosyvoice_runtime.flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from cosyvoice_runtime.runners import CPU
from cosyvoice_runtime.sampling import MAX_SEED, SAMPLINGS
from cosyvoice_runtime.speakers import SPEAKERS_DIR_ENV, SpeakerError, default_speakers_dir
from cosyvoice_runtime.synthesis import GPU_MAX_BATCH

from .listen_check import grpc_binds, ray_proxy_binds, uvicorn_binds
from .ray_options import RayOptions, ray_options
from .settings import (
    API_KEY_ENV,
    BLANK_KEY,
    DEFAULT_PORT,
    HOST_ENV,
    MAX_BODY_MIB,
    PORT_ENV,
    SERVER_PROVIDERS,
    ServerSettings,
    api_key_from_env,
    load_dotenv,
)

if TYPE_CHECKING:
    import uvicorn

    from .engine import Engine
    from .metrics import ServerMetrics
    from .queue import SessionQueue

DOTENV = Path(".env")


def _api_key(_: click.Context, __: click.Parameter, value: str | None) -> str | None:
    """The key without surrounding blanks (as a .env line may leave them), else `$COSYVOICE_API_KEY`'s; None
    when neither is set. A blank one is refused, the variable's too (click takes an empty one for unset)."""
    if value is None:
        try:
            return api_key_from_env()
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    if not value.strip():
        raise click.BadParameter(BLANK_KEY)
    return value.strip()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--host", default="127.0.0.1", envvar=HOST_ENV, show_envvar=True,
              help="Address to bind; 0.0.0.0 serves every interface (an explicit choice).")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, envvar=PORT_ENV,
              show_envvar=True)
@click.option("--grpc", "grpc_service", is_flag=True,
              help="Serve upstream's gRPC service (cosyvoice.CosyVoice) on --port instead of HTTP.")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=None,
              help="Also serve the gRPC service on this port, beside HTTP in the same process: one model, "
                   "and --max-conc and --queue bound both together [default: HTTP only].")
@click.option("--model", type=NonEmptyPath(file_okay=False, path_type=Path),
              help=f"Runtime bundle, or a model bundle to export on first use. Default: ${MODEL_DIR_ENV}, "
                   "else the embedded demo bundle (as cosyvoice-run).")
@click.option("--provider", type=click.Choice(SERVER_PROVIDERS), default=CPU,
              help="onnxruntime provider, or openvino (OpenVINO's CPU plugin; bf16 graphs run on it under "
                   "cpu too).")
@click.option("--threads", type=THREADS, default=None,
              help="onnxruntime's intra-op threads per graph [default: the bundle's tuning file, else the "
                   "measured setting, else one per core].")
@click.option("--max-conc", type=click.IntRange(min=1), default=ServerSettings.max_concurrency,
              help="Sessions synthesising at once (one on the CPU: each graph call uses every core; "
                   "--max-batch runs more).")
@click.option("--max-batch", type=click.IntRange(1, MAX_BATCH), default=ServerSettings.max_batch,
              help="Sessions whose speech tokens one LLM call decodes together (continuous batching; that "
                   "many run at once, --max-conc or more). Needs a bundle with llm_decode: on the cpu "
                   "provider (export --precision cpu-fast, or decode=fp32 for float32), or on cuda in fp16 "
                   f"(decode=fp16); 1: no batching [default: {GPU_MAX_BATCH} on cuda where the bundle "
                   "batches, else 1].")
@click.option("--chunk-slots", type=click.IntRange(1, MAX_BATCH), default=None,
              help="With --max-batch, the sessions' chunks that run their flow and vocoder at once, first "
                   "chunks first [default: on a CPU as many as the usable CPUs hold at --threads each (one "
                   "when --threads is not given), on a GPU every session's].")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Replay the decode steps from CUDA graphs (--provider cuda, a bundle with llm_decode: "
                   "--precision decode=fp16 or gpu-fp16), and the DiT's calls where it is tf32's or "
                   "gpu-fp16's. The sessions decode in the batch, one at a time with --max-batch 1 "
                   "[default: on wherever they can, as cosyvoice-run].")
@click.option("--stack-dit", is_flag=True,
              help="Run concurrent sessions' DiT calls at the same ODE step and frames as one call "
                   "(a float DiT: fp32, fp16, bf16; on a GPU each call's time is mostly its launches). "
                   "Sessions whose chunks run at once stack: --max-conc, or --chunk-slots with a batch.")
@click.option("--stack-vocoder", is_flag=True,
              help="Run concurrent sessions' vocoder windows over the same frames as one hift_decoder "
                   "call (as --stack-dit does the DiT's).")
@click.option("--queue", "queue_depth", type=click.IntRange(min=0), default=ServerSettings.queue_depth,
              help="Sessions waiting for a slot; beyond them the server answers 503 (gRPC: "
                   "RESOURCE_EXHAUSTED) at once.")
@click.option("--stream-idle", "stream_idle", type=click.FloatRange(min=0, min_open=True),
              default=ServerSettings.stream_idle_timeout,
              help="Seconds a text-streaming WebSocket session (/v1/audio/speech/stream) may go without a "
                   "message before its end.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=ServerSettings.timeout,
              help="Seconds a request may take from admission to its last sample; its text's "
                   "normalisation, before admission, as long.")
@click.option("--shutdown-grace", type=click.IntRange(min=0), default=ServerSettings.shutdown_grace,
              help="On SIGINT or SIGTERM, seconds the running sessions get to finish; the waiting ones are "
                   "refused at once (503; gRPC: UNAVAILABLE), and the rest are cut after it.")
@click.option("--speakers", "speakers_dir", type=NonEmptyPath(file_okay=False, path_type=Path),
              help=f"Registered speakers' folder [default: ${SPEAKERS_DIR_ENV} (blank: unset), else "
                   "~/.local/share/cosyvoice/speakers, as CosyVoice3's]")
@click.option("--sampling", type=click.Choice(SAMPLINGS), default=ServerSettings.sampling,
              help="ras: upstream's repetition-aware sampling; greedy: argmax (exact comparisons).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="Seed of requests that carry none [default: a random seed per request, as upstream].")
@click.option("--api-key", callback=_api_key,
              help="Require this key on every endpoint but /health and the page (HTTP: 'Authorization: "
                   "Bearer KEY' or 'X-API-Key: KEY'; gRPC: the same as metadata) [default: "
                   f"${API_KEY_ENV}, else none; blank: refused].")
@click.option("--flow-prefix-cache", "flow_prefix_mib", type=click.IntRange(min=0),
              default=DEFAULT_PREFIX_CACHE_BYTES >> 20,
              help="MiB kept of the streaming flow's per-prompt prefixes (the DiT's caches of a prompt's "
                   "leading blocks, about 3.6 MB per prompt frame at full size), so that a speaker's next "
                   "stream starts after them, registered speakers' and the bundle voice's ahead of uploaded "
                   "prompts'; 0 keeps none.")
@click.option("--max-text", type=click.IntRange(min=1), default=ServerSettings.max_text_chars,
              help="Longest text accepted (characters).")
@click.option("--max-body-mib", type=click.IntRange(min=1), default=MAX_BODY_MIB,
              help="Largest HTTP request body (MiB); a larger one is refused with 413 before it is read "
                   "(the default holds the largest prompt upload, 32 MiB, base64-encoded in JSON).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Let web pages from ORIGIN (e.g. https://app.example.com; '*' for any) call the HTTP API "
                   "from a browser (CORS) and open its WebSocket; repeatable [default: none, same-origin "
                   "only; upstream's server allows every origin].")
@click.option("--docs", is_flag=True,
              help="Serve FastAPI's /docs and /redoc, whose pages load Swagger UI and ReDoc from a CDN "
                   "(cdn.jsdelivr.net) [default: off; /openapi.json is served either way].")
@click.option("--prompt-dir", type=NonEmptyPath(exists=True, file_okay=False, path_type=Path),
              help="Let /synthesize's prompt_audio name a file in this folder by path, as the bridge server "
                   "took it (paths leading out of it are refused) [default: paths refused, base64 only].")
@click.option("--warm-up/--no-warm-up", default=ServerSettings.warm_up,
              help="Before serving, stream a few chunks in the bundle's own voice, so that the first request "
                   "does not pay for the first synthesis (the text normaliser's grammars, the prompt's "
                   "features, every graph's first calls: a few seconds at start-up on a CPU).")
@chunk_policy_options("Every stream's first chunk after N speech tokens, later chunks on upstream's "
                      "boundaries (lower latency; a deviation from upstream's schedule) [default: "
                      "upstream's].", "Every stream: " + FLOW_WINDOW_HELP)
@ray_options
def serve(host: str, port: int, grpc_service: bool, grpc_port: int | None, model: Path | None, provider: str,
          threads: int | None, max_conc: int, max_batch: int | None, chunk_slots: int | None,
          cuda_graphs: bool | None,
          stack_dit: bool, stack_vocoder: bool, queue_depth: int,
          stream_idle: float, timeout: float, shutdown_grace: int,
          speakers_dir: Path | None, sampling: str, seed: int | None,
          flow_prefix_mib: int, max_text: int, api_key: str | None, max_body_mib: int,
          cors_origins: tuple[str, ...], docs: bool, prompt_dir: Path | None, warm_up: bool,
          chunk_policy: ChunkPolicy | None, ray: RayOptions | None) -> None:
    """Serve CosyVoice3 over HTTP: upstream's /inference_* endpoints, the bridge's /synthesize, /health,
    /speakers and /metrics, OpenAI-style /v1/audio/speech and a web page at / (no torch); with --grpc-port,
    upstream's gRPC service beside it; or, with --grpc, that service alone; or, with --ray, HTTP through
    Ray Serve replicas.

    Options not given are read from the environment and then from ./.env (COSYVOICE_PORT,
    COSYVOICE_HOST, COSYVOICE_MODEL_DIR, COSYVOICE_SPEAKERS_DIR, COSYVOICE_API_KEY).
    """
    if grpc_port is not None and (grpc_service or grpc_port == port):
        raise click.UsageError("--grpc-port serves gRPC beside HTTP on another port than --port; --grpc "
                               "serves gRPC alone on --port")
    require_extra("serve")  # named before the input is judged, as importing it would (one line: __main__)
    if ray is None or ray.address is None:  # a cluster's replicas find the model where they run
        try:
            check_requested_bundle(model)
        except USER_ERRORS as e:
            _refuse(str(e))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    try:
        speakers_folder = speakers_dir or default_speakers_dir()
    except USER_ERRORS as e:
        _refuse(str(e))
    settings = ServerSettings(max_concurrency=max_conc, max_batch=max_batch, chunk_slots=chunk_slots,
                              cuda_graphs=cuda_graphs, stack_dit=stack_dit, stack_vocoder=stack_vocoder,
                              queue_depth=queue_depth,
                              stream_idle_timeout=stream_idle, timeout=timeout, shutdown_grace=shutdown_grace,
                              max_text_chars=max_text,
                              sampling=sampling, seed=seed,
                              speakers_dir=speakers_folder, api_key=api_key,
                              max_body_bytes=max_body_mib << 20, cors_origins=cors_origins, docs=docs,
                              prompt_dir=prompt_dir, chunk_policy=chunk_policy, warm_up=warm_up)
    if ray is not None:
        if grpc_service or grpc_port is not None:
            raise click.UsageError("--ray serves HTTP only; --grpc and --grpc-port run without it")
        if threads is not None:
            raise click.UsageError("--threads sets this process's threads; with --ray each replica takes as "
                                   "many as its --replica-cpus")
        from .ray_app import ReplicaConfig, run_ray  # the ray extra, imported only here

        if ray.address is None:  # a local instance: its replicas keep speakers here, its proxy listens here
            _create_speakers_folder(settings.speakers_dir, given=speakers_dir is not None)
            _check_listen(host, port, "--port", ray_proxy_binds)
        run_ray(ray, ReplicaConfig(model, provider, flow_prefix_mib << 20, settings, ray.speaker_store),
                host=host, port=port)
        return
    if not grpc_service:  # upstream's gRPC service has no registered speakers
        _create_speakers_folder(settings.speakers_dir, given=speakers_dir is not None)
    _check_listen(host, port, "--port", grpc_binds if grpc_service else uvicorn_binds)
    if grpc_port is not None:
        _check_listen(host, grpc_port, "--grpc-port", grpc_binds)
    # the serve extra's heavy part (FastAPI, uvicorn), imported once the input has passed
    from .app import create_app
    from .engine import Engine
    from .http_server import http_server

    try:
        engine = Engine.open(model, provider=provider, flow_prefix_bytes=flow_prefix_mib << 20,
                             threads=threads, max_batch=max_batch, chunk_slots=chunk_slots,
                             chunk_policy=chunk_policy, cuda_graphs=cuda_graphs, stack_dit=stack_dit,
                             stack_vocoder=stack_vocoder)
    except USER_ERRORS as e:
        _refuse(str(e))
    try:
        click.echo(f"model: {engine.origin}", err=True)
        click.echo(f"sessions at once: {settings.sessions_at_once(engine.max_batch)}, their speech tokens "
                   + (f"decoded in batches of up to {engine.max_batch}" if engine.max_batch > 1 else
                      "decoded each on its own")
                   + (", the decode steps replayed from CUDA graphs" if engine.cuda_graphs else ""), err=True)
        click.echo(f"streams: {engine.voice.chunk_policy.summary()}", err=True)
        if warm_up:
            engine.warm_up()
        click.echo(f"API key: {'required' if api_key else 'none (every endpoint is open)'}", err=True)
        if grpc_service:
            _run_grpc(engine, settings, host, port)
            return
        try:
            app = create_app(engine, settings)
        except SpeakerError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        click.echo(f"speakers: {settings.speakers_dir} ({len(app.state.server.speakers.names())} registered)",
                   err=True)
        http = http_server(app, settings, host, port)
        if grpc_port is None:
            http.run()
            if not http.started:  # uvicorn said why (the port taken since the check, say)
                sys.exit(1)
            return
        _run_grpc(engine, settings, host, grpc_port, http=http, sessions=app.state.server.sessions,
                  metrics=app.state.server.metrics)
    finally:
        engine.close()


def _create_speakers_folder(folder: Path, *, given: bool) -> None:
    """The folder the server keeps its speakers in, made and written to now, so that one it cannot use is a
    refusal before the bundle opens rather than a traceback after (Ray's replicas make theirs where they
    run); named by what chose it (`given`: --speakers)."""
    if given:
        what = f"--speakers {folder}"
    elif os.environ.get(SPEAKERS_DIR_ENV, "").strip():
        what = f"${SPEAKERS_DIR_ENV} {folder}"
    else:
        what = f"the speakers folder {folder} (the default; --speakers sets another)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _refuse(f"{what}: cannot create the folder ({e.strerror or e})")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        _refuse(f"{what}: cannot write in the folder ({e.strerror or e})")


def _check_listen(host: str, port: int, option: str, binds: Callable[[str, int], None]) -> None:
    """A refusal where the server could not listen on `host`:`port` now (a name that does not resolve, an
    address not this machine's, a port taken), asked as that server `binds` (`listen_check`), before the
    bundle opens and warms up rather than after."""
    try:
        binds(host, port)
    except OSError as e:
        _refuse(f"cannot listen on {host!r} port {port} (--host or ${HOST_ENV}, {option}): {e.strerror or e}")


def _refuse(message: str) -> NoReturn:
    """A bad start: one line on stderr, exit status 2."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def _run_grpc(engine: Engine, settings: ServerSettings, host: str, port: int, *,
              http: uvicorn.Server | None = None, sessions: SessionQueue | None = None,
              metrics: ServerMetrics | None = None) -> None:
    """`run_grpc`, its lines on stderr; an address that cannot be bound is one line and exit status 1."""
    from .grpc_server import run_grpc

    try:
        run_grpc(engine, settings, host, port, announce=lambda line: click.echo(line, err=True), http=http,
                 sessions=sessions, metrics=metrics)
    except OSError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


def main() -> None:
    """Console entry point: load ./.env (without overriding the environment), then run the command."""
    load_dotenv(DOTENV)
    serve()
