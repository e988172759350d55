"""`cosyvoice-serve`'s --ray options and what they stand for, without importing Ray (the server runs where
the ray extra is not installed; `--ray` imports it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import click

from .settings import ServerSettings

F = TypeVar("F", bound=Callable[..., Any])
SpeakerStore = Literal["folder", "actor"]
SPEAKER_STORES: tuple[SpeakerStore, ...] = ("folder", "actor")
"""folder: `--speakers` on a filesystem every replica shares; actor: a Ray actor keeps them, for none."""


@dataclass(frozen=True)
class ScaleOptions:
    """How many replicas and what each reserves: the deployment's Ray options."""

    replicas: int = 1
    """Replicas (with autoscaling, how many to start with)."""
    max_replicas: int | None = None
    """Autoscale up to this many replicas (None: a fixed `replicas`)."""
    min_replicas: int = 1
    """Autoscale down to this many (0 lets the app scale to nothing while idle)."""
    target_ongoing: float | None = None
    """Requests per replica that autoscaling aims at (None: the sessions a replica runs at once,
    `ServerSettings.sessions_on`, so that it adds a replica when requests start to wait)."""
    max_ongoing: int | None = None
    """Requests Ray sends one replica at once (None: the sessions it runs at once, `sessions_on`, so that a
    request waits for the first free replica rather than behind a busy one)."""
    cpus: float = 1.0
    """CPUs each replica reserves, and the threads its graphs run on (rounded up)."""
    gpus: float = 0.0
    """GPUs each replica reserves (with the cuda or tensorrt provider)."""

    def __post_init__(self) -> None:
        if self.max_replicas is None and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1 without autoscaling, got {self.replicas}")
        if self.max_replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be from min_replicas ({self.min_replicas}) to "
                             f"max_replicas ({self.max_replicas})")

    def deployment_options(self, settings: ServerSettings, provider: str) -> dict[str, Any]:
        """The arguments of Ray's `Deployment.options` these stand for, for replicas on `provider` with
        `settings`' queue: the requests waiting for a replica wait in Ray's proxy, which answers 503 beyond
        `queue_depth` of them (at least one: Ray's lower bound)."""
        sessions = settings.sessions_on(provider)
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing or sessions,
            "max_queued_requests": max(settings.queue_depth, 1),
            "ray_actor_options": {"num_cpus": self.cpus, "num_gpus": self.gpus}}
        if self.max_replicas is None:
            return options | {"num_replicas": self.replicas}
        return options | {"autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "initial_replicas": self.replicas,
            "target_ongoing_requests": self.target_ongoing or sessions}}


@dataclass(frozen=True)
class RayOptions:
    """`cosyvoice-serve --ray`: where the cluster is, the replicas' scale and where they share speakers."""

    address: str | None
    """A cluster to join (None: start a local Ray instance)."""
    scale: ScaleOptions
    speaker_store: SpeakerStore


def ray_options(command: F) -> F:
    """Add the --ray options to `command`, which receives them as one parameter, `ray` (`RayOptions`, or
    None without --ray)."""
    options = [
        click.option("--ray", "use_ray", is_flag=True,
                     help="Serve HTTP through Ray Serve replicas, each with the model open (the ray extra), "
                          "on a local Ray instance or the cluster at --ray-address."),
        click.option("--ray-address", metavar="ADDR",
                     help="Join this Ray cluster (host:6379, or 'auto' for the one this machine is in) "
                          "instead of starting a local instance; implies --ray."),
        click.option("--replicas", type=click.IntRange(min=0), default=1,
                     help="Ray replicas (with --max-replicas, how many to start with)."),
        click.option("--min-replicas", type=click.IntRange(min=0), default=None,
                     help="Autoscaling's lower bound (with --max-replicas) [default: 1]."),
        click.option("--max-replicas", type=click.IntRange(min=1), default=None,
                     help="Autoscale the replicas up to this many [default: a fixed --replicas]."),
        click.option("--target-ongoing", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Requests per replica that autoscaling aims at [default: the sessions it runs at "
                          "once: --max-conc, or its decode batch where larger]."),
        click.option("--max-ongoing", type=click.IntRange(min=1), default=None,
                     help="Requests Ray sends one replica at once; the rest wait in Ray's proxy for a free "
                          "replica, up to --queue of them per proxy (503 beyond) [default: the sessions it "
                          "runs at once: --max-conc, or its decode batch where larger]."),
        click.option("--replica-cpus", type=click.FloatRange(min=0), default=1.0,
                     help="CPUs each replica reserves, and its graphs' threads (rounded up; 0: every core)."),
        click.option("--replica-gpus", type=click.FloatRange(min=0), default=0.0,
                     help="GPUs each replica reserves (with --provider cuda or tensorrt)."),
        click.option("--speaker-store", type=click.Choice(SPEAKER_STORES), default="folder",
                     help="Where replicas share speakers: folder, the --speakers folder (on a filesystem "
                          "every node shares); actor, a Ray actor on the head node, keeping them in "
                          "--speakers there."),
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, use_ray: bool, ray_address: str | None, replicas: int, min_replicas: int | None,
                max_replicas: int | None, target_ongoing: float | None, max_ongoing: int | None,
                replica_cpus: float, replica_gpus: float, speaker_store: SpeakerStore, **kwargs: Any) -> Any:
        if min_replicas is not None and max_replicas is None:
            raise click.UsageError("--min-replicas bounds autoscaling, which --max-replicas turns on")
        try:
            scale = ScaleOptions(replicas, max_replicas, 1 if min_replicas is None else min_replicas,
                                 target_ongoing, max_ongoing, replica_cpus, replica_gpus)
        except ValueError as e:
            raise click.UsageError(f"--replicas, --min-replicas, --max-replicas: {e}") from None
        if not (use_ray or ray_address is not None):
            if scale != ScaleOptions() or speaker_store != "folder":
                raise click.UsageError("--replicas, --min-replicas, --max-replicas, --target-ongoing, "
                                       "--max-ongoing, --replica-cpus, --replica-gpus and --speaker-store "
                                       "need --ray")
            return command(*args, ray=None, **kwargs)
        return command(*args, ray=RayOptions(ray_address, scale, speaker_store), **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return cast(F, wrapper)
