"""Server settings and where they come from: flags, then the environment, then a `.env` file.

`cosyvoice-serve` loads `./.env` into the environment first, without overriding variables that are
set already (python-dotenv's rule), and its options read `COSYVOICE_*` variables when not given; so
a flag beats the environment, which beats `.env`. The model directory follows `cosyvoice-run`:
`--model`, else `$COSYVOICE_MODEL_DIR`, else the embedded demo bundle.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_graphs import MAX_BATCH
from cosyvoice_runtime.chunk_policy import ChunkPolicy
from cosyvoice_runtime.runners import CUDA, OPENVINO, ORT_PROVIDERS
from cosyvoice_runtime.sampling import MAX_SEED, SAMPLINGS
from cosyvoice_runtime.segments import MAX_TEXT_CHARS
from cosyvoice_runtime.speakers import default_speakers_dir
from cosyvoice_runtime.synthesis import GPU_MAX_BATCH

HOST_ENV = "COSYVOICE_HOST"
PORT_ENV = "COSYVOICE_PORT"
API_KEY_ENV = "COSYVOICE_API_KEY"
BLANK_KEY = "the API key is blank; give a key, or leave it unset for an open server"
DEFAULT_PORT = 50000
"""Upstream's FastAPI and gRPC servers listen on 50000."""
SERVER_PROVIDERS = (*ORT_PROVIDERS, OPENVINO)
"""Providers whose runners are safe to share between sessions (see `engine`'s docstring)."""
MAX_UPLOAD_BYTES = 32 << 20
"""Largest prompt upload accepted: 30 s (the speech tokenizer's limit) of 96 kHz stereo float32 is 23 MB."""
MAX_BODY_MIB = math.ceil(4 * MAX_UPLOAD_BYTES / 3 / 2**20) + 1
"""Default `--max-body-mib`: the largest prompt upload base64-encoded (`/synthesize` sends it so in JSON),
and a MiB for the other fields."""


@dataclass(frozen=True)
class ServerSettings:
    """How the server admits and bounds work; the model side is `Engine`'s."""

    max_concurrency: int = 1
    """Sessions synthesising at once. One on the CPU: every graph call already uses all cores (unless their
    decoding is batched: `max_batch`)."""
    max_batch: int | None = None
    """Sessions whose speech ids one LLM call decodes together (continuous batching, `decode_batch`; the
    bundle needs `llm_decode`); 1: each session decodes on its own; None: the runtime's default by bundle and
    provider (`synthesis.default_max_batch`)."""
    chunk_slots: int | None = None
    """With a batch, its sessions' chunks that run their flow and vocoder calls at once, first chunks first
    (`ChunkTurns`); None: `synthesis.default_chunk_slots` (one where a session's graphs take every core)."""
    cuda_graphs: bool | None = None
    """The decode steps replay from CUDA graphs (on cuda, with `llm_decode`: `decode_graphs`), in the batch,
    of one session where `max_batch` is 1, and so do the DiT's calls where its graph allows (`dit_graphs`);
    None: wherever they can (`synthesis.uses_cuda_graphs`)."""
    stack_dit: bool = False
    """Concurrent sessions' DiT calls at the same ODE step and frames run as one call (`dit_stack`)."""
    stack_vocoder: bool = False
    """Concurrent sessions' vocoder calls over the same frames run as one call (`Vocoder.stack_calls`)."""
    queue_depth: int = 8
    """Sessions admitted to wait for a slot; one more is refused with 503 at once."""
    stream_idle_timeout: float = 30.0
    """Seconds a text-streaming WebSocket session (`/v1/audio/speech/stream`) may go without a message before
    its `end`; past it the session is closed (4408) and its slot freed."""
    timeout: float = 300.0
    """Seconds from admission to the last sample; a session past it is stopped (504, or a cut stream). A
    text's normalisation, before admission, may take as long (then a 504)."""
    shutdown_grace: int = 5
    """On SIGINT or SIGTERM, the seconds running sessions get to finish (the waiting ones are refused at once:
    503, gRPC UNAVAILABLE); then they are cut and the process ends, well within `docker stop`'s 10 s."""
    max_text_chars: int = MAX_TEXT_CHARS
    """Longest text accepted (characters), so that one request cannot hold a slot for hours."""
    sampling: str = "ras"
    """Speech-token sampling of every request: "ras" (upstream's) or "greedy" (exact comparisons)."""
    seed: int | None = None
    """Seed of every request that names none (0 to `MAX_SEED`); None: a fresh random seed per request (as
    upstream)."""
    speakers_dir: Path = field(default_factory=default_speakers_dir)
    """Where registered speakers are kept (`SpeakerRegistry`)."""
    speakers_sync: float | None = 30.0
    """Seconds between two comparisons of the speakers whose flow prefixes the engine keeps (`PrefixJobs`)
    with the speakers store, which other servers sharing it may have changed (`speaker_sync`); None: never."""
    api_key: str | None = field(default=None, repr=False)
    """The key every endpoint but `/health` and the page requires (`serve/auth.py`); None: no key.
    Left out of the repr so that logging the settings never logs it."""
    max_body_bytes: int = MAX_BODY_MIB << 20
    """Largest request body accepted; a larger one is refused with 413 before more of it is read."""
    cors_origins: tuple[str, ...] = ()
    """Origins whose web pages a browser lets call the API (CORS; "*": any) and whose pages may open its
    WebSocket (`serve/ws_origin.py`); none: same-origin only."""
    docs: bool = False
    """Serve FastAPI's /docs and /redoc pages, which load their scripts and styles from a CDN."""
    prompt_dir: Path | None = None
    """A folder whose files the bridge's `prompt_audio` may name by path; None: paths are refused."""
    chunk_policy: ChunkPolicy | None = None
    """When every stream emits its chunks (None: upstream's schedule); the engine's graphs check it
    (`check_policy`), so that the server starts with a policy they can stream on or not at all."""
    warm_up: bool = True
    """Stream a few chunks in the bundle's own voice before serving (`Engine.warm_up`), so that the first
    request does not pay for the first synthesis (what that costs: docs/server.md)."""

    def sessions_at_once(self, max_batch: int) -> int:
        """Sessions the queue runs at once beside an engine that decodes in batches of `max_batch`
        (`Engine.max_batch`): `max_concurrency`, or `max_batch` where more, so that a batch can fill."""
        return max(self.max_concurrency, max_batch)

    def sessions_on(self, provider: str) -> int:
        """`sessions_at_once` where the bundle is not known (Ray's driver, which deploys replicas that open
        it): of `max_batch`, or where that is None of the most `synthesis.default_max_batch` gives on
        `provider` (`GPU_MAX_BATCH` on cuda; a replica whose bundle does not batch there keeps the rest in its
        queue)."""
        if self.max_batch is not None:
            return self.sessions_at_once(self.max_batch)
        return self.sessions_at_once(GPU_MAX_BATCH if provider == CUDA else 1)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_batch is not None and not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be from 1 to {MAX_BATCH}, got {self.max_batch}")
        if self.chunk_slots is not None and not 1 <= self.chunk_slots <= MAX_BATCH:
            raise ValueError(f"chunk_slots must be from 1 to {MAX_BATCH}, got {self.chunk_slots}")
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth must be >= 0, got {self.queue_depth}")
        if self.stream_idle_timeout <= 0:
            raise ValueError(f"stream_idle_timeout must be > 0, got {self.stream_idle_timeout}")
        if self.speakers_sync is not None and not self.speakers_sync > 0:
            raise ValueError(f"speakers_sync must be > 0 (None: never), got {self.speakers_sync}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {self.max_text_chars}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank (None: no key)")


def api_key_from_env() -> str | None:
    """`$COSYVOICE_API_KEY` without surrounding blanks, None where it is unset; a `ValueError` where it is set
    but blank: `COSYVOICE_API_KEY=$KEY` with `KEY` unset would otherwise serve everyone."""
    value = os.environ.get(API_KEY_ENV)
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"${API_KEY_ENV}: {BLANK_KEY}")
    return value.strip()


def read_dotenv(path: Path) -> dict[str, str]:
    """`KEY=VALUE` lines of `path` (missing: none); blank lines, `#` comments and an `export ` prefix are
    skipped, one pair of matching quotes around a value is removed."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    pairs = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.removeprefix("export ").split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        pairs[key.strip()] = value
    return pairs


def load_dotenv(path: Path) -> list[str]:
    """Set the variables of `path` that the environment lacks; returns their names."""
    values = read_dotenv(path)
    added = [key for key in values if key not in os.environ]
    for key in added:
        os.environ[key] = values[key]
    return added
