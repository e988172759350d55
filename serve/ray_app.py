"""The HTTP server as a Ray Serve application: replicas over a Ray cluster, each one `Engine` behind the
app `create_app` makes, so every route, header and byte is the single-process server's.

Three ways to start it: `cosyvoice-serve --ray` (`run_ray`, its options in `serve/ray_options.py`: a
local Ray instance, or a cluster with `--ray-address`), `serve run cosyvoice_serve.ray_app:app` (the
defaults), and Ray's config file (`deploy/serve-config.yaml`, `import_path:
cosyvoice_serve.ray_app:build_app`, whose `args` are `replica_config`'s and whose `deployments` entry sets
replicas, autoscaling and resources).

A replica opens the bundle itself (a bundle or speakers it cannot open fail the deployment, the error in
one line: `ReplicaStartError`), runs its graphs on as many threads as it reserves CPUs, and names itself
in every response's `X-Served-By` (its Ray actor's name). Speakers are shared: the `--speakers` folder on
a shared filesystem (`SpeakerRegistry`, which sees other replicas' changes), or the store actor
(`serve/ray_speakers.py`) where there is none.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI
from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails
from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosyvoice_runtime.errors import USER_ERRORS
from cosyvoice_runtime.flow_prefix import DEFAULT_PREFIX_CACHE_BYTES
from cosyvoice_runtime.runners import CPU, CPU_PROVIDERS
from cosyvoice_runtime.speakers import SpeakerError, SpeakerRegistry, frontend_fingerprint

from .app import create_app
from .engine import Engine
from .ray_options import SPEAKER_STORES, RayOptions, ScaleOptions, SpeakerStore
from .ray_speakers import ActorSpeakers
from .settings import SERVER_PROVIDERS, ServerSettings, api_key_from_env

APP_NAME = "cosyvoice"
"""The Serve application's name (`serve status`, the replicas' actor names)."""
DEPLOYMENT_NAME = "CosyVoice"
SERVED_BY = "X-Served-By"


class ReplicaStartError(RuntimeError):
    """A replica could not open the bundle (or its speakers); the message is the one line to show."""


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica opens: the same bundle, settings and speakers."""

    model: Path | None = None
    """The runtime bundle, a path on every node (None: each node's `$COSYVOICE_MODEL_DIR`, else the
    embedded demo bundle)."""
    provider: str = CPU
    flow_prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    settings: ServerSettings = field(default_factory=ServerSettings)
    """Each replica's own queue, timeout and sampling; `speakers_dir` is where speakers are kept."""
    speaker_store: SpeakerStore = "folder"


class ServedBy:
    """Names the replica in every HTTP response's `X-Served-By` header."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app, self.header = app, (SERVED_BY.lower().encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class CosyVoiceReplica:
    """One replica: an `Engine` and the server's app over it."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        """The replica's Ray actor name (`ray.get_actor(name, namespace="serve")`)."""
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        # onnxruntime's default is a thread per core of the machine, which replicas sharing it would
        # oversubscribe; none reserved (num_cpus 0) keeps that default
        threads = math.ceil(cpus) if cpus else None
        try:
            self.engine = Engine.open(config.model, provider=config.provider,
                                      flow_prefix_bytes=config.flow_prefix_bytes, threads=threads,
                                      max_batch=config.settings.max_batch,
                                      chunk_slots=replica_chunk_slots(config, threads),
                                      chunk_policy=config.settings.chunk_policy,
                                      cuda_graphs=config.settings.cuda_graphs,
                                      stack_dit=config.settings.stack_dit,
                                      stack_vocoder=config.settings.stack_vocoder)
        except USER_ERRORS as e:
            raise self._start_error(e) from None
        if config.settings.warm_up:
            self.engine.warm_up()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The server's app over this replica's engine, with its speakers where every replica finds them."""
        config = self.config
        try:
            speakers = (ActorSpeakers(config.settings.speakers_dir, self.engine.frontend_fingerprint)
                        if config.speaker_store == "actor" else None)
            app = create_app(self.engine, config.settings, speakers)
        except SpeakerError as e:
            raise self._start_error(e) from None
        app.add_middleware(ServedBy, name=self.name)
        return app

    def _start_error(self, error: Exception) -> ReplicaStartError:
        return ReplicaStartError(f"replica {self.name} on {ray.util.get_node_ip_address()}: {error}")


def replica_chunk_slots(config: ReplicaConfig, threads: int | None) -> int | None:
    """A replica's `chunk_slots`: the settings' own, else one on a CPU where the replica batches its decodings
    and reserved CPUs for its `threads` (they, not the machine's cores that `default_chunk_slots` counts, are
    what its chunks share), else the runtime's default (none without a batch)."""
    batched = (config.settings.max_batch or 1) > 1  # a CPU's default is no batch
    if config.settings.chunk_slots is None and threads and config.provider in CPU_PROVIDERS and batched:
        return 1
    return config.settings.chunk_slots


REPLICAS: Deployment = serve.deployment(name=DEPLOYMENT_NAME)(serve.ingress()(CosyVoiceReplica))
"""The replicas' deployment (its options: `deployment`)."""


def deployment(scale: ScaleOptions, settings: ServerSettings, provider: str) -> Deployment:
    """The replicas' deployment on `provider` with `scale`'s options."""
    return REPLICAS.options(**scale.deployment_options(settings, provider))


def replica_config(args: dict[str, Any]) -> ReplicaConfig:
    """The replicas' config from `args` as a Serve config file's application gives them: `model`,
    `provider`, `flow_prefix_mib`, `speaker_store` (`folder` or `actor`) and any field of `ServerSettings`
    (`max_concurrency`, `queue_depth`, `timeout`, `sampling`, `seed`, `speakers_dir`, ...), values as YAML
    or `serve run`'s `key=value` strings give them; the API key comes from `$COSYVOICE_API_KEY`, kept out
    of config files and of every message. `ValueError` naming what is wrong, in one line."""
    args = dict(args)
    model = args.pop("model", None)
    provider = str(args.pop("provider", CPU))
    if provider not in SERVER_PROVIDERS:
        raise ValueError(f"provider must be one of {', '.join(SERVER_PROVIDERS)}, got {provider!r}")
    flow_prefix_mib = _whole_number("flow_prefix_mib",
                                    args.pop("flow_prefix_mib", DEFAULT_PREFIX_CACHE_BYTES >> 20))
    store = args.pop("speaker_store", "folder")
    if store not in SPEAKER_STORES:
        raise ValueError(f"speaker_store must be one of {', '.join(SPEAKER_STORES)}, got {store!r}")
    unknown = sorted(set(args) - {f.name for f in fields(ServerSettings)})
    if unknown:
        raise ValueError(f"unknown args {', '.join(unknown)}: model, provider, flow_prefix_mib, "
                         "speaker_store and ServerSettings' fields are taken")
    try:  # pydantic's messages repeat the input, which must not hold a key: it is added after
        settings = TypeAdapter(ServerSettings).validate_python(args)
    except ValidationError as e:
        raise ValueError("; ".join(_message(error) for error in e.errors(include_input=False))) from None
    key = api_key_from_env()
    if key and settings.api_key is None:
        settings = replace(settings, api_key=key)
    return ReplicaConfig(Path(model) if model else None, provider, flow_prefix_mib << 20, settings, store)


def _message(error: ErrorDetails) -> str:
    """One of pydantic's errors without its input: `field: message`, or the message of a check of several
    fields (`ServerSettings.__post_init__`)."""
    message = error["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


def _whole_number(name: str, value: object) -> int:
    """`value` (YAML's number or `serve run`'s string) as a whole number of at least 0; else a `ValueError`
    naming `name`."""
    try:
        number = float(value)  # type: ignore[arg-type]  # anything else is refused below
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (number >= 0 and number.is_integer()):
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(number)


def build_app(args: dict[str, Any]) -> Application:
    """The application `serve run` and Ray's config file import (`cosyvoice_serve.ray_app:build_app`), with
    `args` as `replica_config` takes them: one replica reserving one CPU, unless the config file's
    `deployments` entry says otherwise."""
    config = replica_config(args)
    return deployment(ScaleOptions(), config.settings, config.provider).bind(config)


app = build_app({})
"""`serve run cosyvoice_serve.ray_app:app`: one replica, the server's defaults."""


def run_ray(options: RayOptions, config: ReplicaConfig, *, host: str, port: int) -> None:
    """`cosyvoice-serve --ray`: deploy the replicas and serve HTTP on `host`:`port` (Ray Serve's proxy)
    until SIGINT or SIGTERM, then delete the app (and stop the Ray instance started here). A replica that
    cannot open the bundle fails the deployment: one line on stderr, exit status 2; on a local instance, whose
    replicas open this machine's bundle and speakers, what they would refuse is refused before Ray starts
    (`check_replica`), and replicas its resources cannot hold once it has started (`placement_problem`; a
    cluster's is a warning: an autoscaler may add the nodes)."""
    if options.address is None:
        try:
            check_replica(config)
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    # Serve's controller logs each replica's start and stop, tracebacks included: they stay in the
    # session's log folder (/tmp/ray/session_latest/logs), and a failed deployment is one line here
    ray.init(address=options.address, include_dashboard=False, log_to_driver=False)
    signal.signal(signal.SIGTERM, _interrupt)  # Ray's own handler ends the process with SIGABRT
    problem = placement_problem(options.scale, ray.nodes())
    if problem is not None and options.address is None:
        ray.shutdown()
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if problem is not None:
        print(f"warning: {problem}; the deployment waits until the cluster has such nodes", file=sys.stderr)
    status = 1  # where an exception escapes
    try:
        status = _serve_until_a_signal(options, config, host=host, port=port)
    finally:
        _leave_ray(status)
    if status:
        sys.exit(status)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM before the app serves (`_stop_on_a_signal` takes over then): unwind as Ctrl-C does, the app
    deleted and a local instance stopped."""
    raise KeyboardInterrupt


def placement_problem(scale: ScaleOptions, nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the alive nodes of `nodes` (`ray.nodes()`: their total resources) cannot hold the replicas
    `scale` starts with, each on one node; None where they can."""
    need = {name: amount for name, amount in (("CPU", scale.cpus), ("GPU", scale.gpus)) if amount > 0}
    if not need:
        return None
    held = [min(math.floor(node["Resources"].get(name, 0.0) / amount + 1e-9) for name, amount in need.items())
            for node in nodes if node.get("Alive")]
    each = " and ".join(f"{amount:g} {name}" for name, amount in need.items())
    if not any(held):
        return f"each replica reserves {each}, which no node of the cluster has"
    if sum(held) < scale.replicas:
        return f"{scale.replicas} replicas reserving {each} each: the cluster's nodes hold {sum(held)}"
    return None


def _serve_until_a_signal(options: RayOptions, config: ReplicaConfig, *, host: str, port: int) -> int:
    """Deploy the app and serve it until SIGINT or SIGTERM: exit status 0, or 2 for a failed deployment."""
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(deployment(options.scale, config.settings, config.provider).bind(config), name=APP_NAME,
                  route_prefix="/")
    except RuntimeError as e:
        print(f"error: {deploy_error(e)}", file=sys.stderr)
        return 2
    stop = _stop_on_a_signal()  # before the line saying it serves, which a supervisor may wait for
    scale = options.scale
    autoscaling = ("" if scale.max_replicas is None
                   else f", autoscaling from {scale.min_replicas} to {scale.max_replicas}")
    print(f"ray: {scale.replicas} replicas{autoscaling}, each reserving CPU {scale.cpus:g} and GPU "
          f"{scale.gpus:g}, on {ray.get_runtime_context().gcs_address}; speakers: {config.speaker_store} "
          f"{config.settings.speakers_dir}; API key: {'required' if config.settings.api_key else 'none'}; "
          f"serving http://{host}:{port}", file=sys.stderr)
    stop.wait()
    return 0


def _leave_ray(status: int) -> None:
    """Delete the app and disconnect from Ray, stopping a local instance started here. Where the delete is
    given up, its thread may still be inside a Ray call, and `ray.shutdown` beside it can end the process
    with SIGSEGV: the process ends at once instead, with `status` (a local instance's processes end with it:
    Ray starts them to share its fate). Called in a `finally`, it prints an exception escaping there first."""
    if _delete_app():
        ray.shutdown()
        return
    error = sys.exc_info()[1]
    if isinstance(error, KeyboardInterrupt):
        status = 130
    elif error is not None:
        traceback.print_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def check_replica(config: ReplicaConfig) -> None:
    """What a replica of `config` on this machine would refuse as it starts, without opening a graph: the
    bundle against the provider and the engine's options (`Engine.check`; a model bundle is exported here,
    once, for the replicas to reuse) and the speakers' registry. One of `USER_ERRORS`."""
    settings = config.settings
    bundle = Engine.check(config.model, provider=config.provider, max_batch=settings.max_batch,
                          chunk_slots=settings.chunk_slots, chunk_policy=settings.chunk_policy,
                          cuda_graphs=settings.cuda_graphs, stack_dit=settings.stack_dit)
    SpeakerRegistry(settings.speakers_dir, frontend_fingerprint(bundle))


def deploy_error(error: RuntimeError) -> str:
    """The one line to show for a failed deployment: the `ReplicaStartError` in the deployment's status
    (which holds the replica's traceback), else the last line of that status or of `error`."""
    deployment = serve.status().applications.get(APP_NAME)
    status = deployment.deployments.get(DEPLOYMENT_NAME) if deployment is not None else None
    lines = [line.strip() for line in f"{error}\n{status.message if status else ''}".splitlines()
             if line.strip()]
    marker = f"{ReplicaStartError.__name__}: "
    return next((line.split(marker, 1)[1] for line in reversed(lines) if marker in line), lines[-1])


DELETE_WAIT_S = 30.0
"""The longest the command waits for `serve.delete`: above the 20 s Serve gives a replica to finish its
requests (`graceful_shutdown_timeout_s`), below the 60 s after which Ray ends a process that lost its GCS."""


def _delete_app() -> bool:
    """`serve.delete` of the app, given up once the cluster's GCS stops taking connections, or after
    `DELETE_WAIT_S`: a signal to the process group (`kill -TERM -PGID`, systemd stopping the unit,
    `timeout`) stops a local instance's processes beside this one, and Ray would try for 60 s to reach its
    GCS and then end the process with status 1. Whether the delete ended (the app deleted, or an error)."""
    deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
    deleting.start()
    deadline = time.monotonic() + DELETE_WAIT_S
    while deleting.is_alive() and time.monotonic() < deadline and _gcs_answers():
        deleting.join(0.5)
    return not deleting.is_alive()


def _gcs_answers() -> bool:
    """Whether the cluster's GCS takes connections."""
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


def _stop_on_a_signal() -> threading.Event:
    """An event that SIGINT or SIGTERM sets from now on."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop
