"""The streaming flow's per-prompt prefix, and the bounded cache that keeps it across streams.

A stream's first chunk runs the DiT over the prompt's frames and its own. The prompt's leading whole
DiT blocks whose `mu` reads prompt tokens only (not the first generated tokens through the encoder's
look-ahead) never attend forward under the block-causal mask, and their noise, `mu`, `cond` and
speaker embedding come from the prompt alone; so at every ODE step their keys, values, conv context
and velocities depend on the prompt only. `Flow.prefix` computes them once (`FlowPrefix`); every
stream from that prompt starts its first chunk after them. A first chunk then runs its new frames
only: for the benchmark's 4.5 s prompt, 100 frames instead of 300. A registered speaker's prefix is
computed ahead, in the background (`prefix_jobs`), so that even its first stream finds it kept.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .frontend import PromptFeatures
from .runners import Feed, feed_nbytes

DEFAULT_PREFIX_CACHE_BYTES = 2 << 30
"""The cache's default budget: 2 GiB holds the prefix of one or two prompts at full size (3.6 MB per
frame: a 4.5 s prompt's 200 frames take 720 MB)."""


@dataclass(frozen=True)
class FlowPrefix:
    """The flow's state after a prompt's cacheable frames, shared read-only by streams."""

    frames: int
    """Prompt frames covered: whole blocks whose `mu` reads prompt tokens only; 0 for a short prompt."""
    caches: tuple[Mapping[str, Feed], ...]
    """Per ODE step, the `past_*` inputs of `flow_estimator_cached` after those frames (read-only): numpy
    arrays, or `OrtValue`s on the GPU that computed them."""

    @property
    def nbytes(self) -> int:
        """Memory held by the caches (every ODE step, both CFG rows), on the host or the GPU."""
        return sum(feed_nbytes(a) for step in self.caches for a in step.values())


def prompt_key(prompt: PromptFeatures) -> str:
    """sha256 over everything of the prompt that the flow reads: tokens, mel and x-vector, with shapes."""
    digest = hashlib.sha256()
    for a in (prompt.speech_tokens, prompt.mel, prompt.embedding):
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


class FlowPrefixCache:
    """Prefixes by prompt content, dropped past `max_bytes` least recently used first, but those of prompts
    that a speaker holds (`hold`) only once no other is left; thread-safe.

    A server's registered speakers are asked for again and again, while an uploaded prompt is often used
    once: at full size two prefixes fill the default budget, so without the hold every two uploads would
    drop the speakers' prefixes, and each speaker's next stream would compute its own again.
    Two streams that miss on the same prompt at once both compute it (the same values); one is kept.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"the flow prefix cache's budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, FlowPrefix] = OrderedDict()
        self._held: Counter[str] = Counter()
        """The `prompt_key`s of the prompts held (`hold`), kept or not, and how many times each."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory held by the cached prefixes."""
        with self._lock:
            return sum(p.nbytes for p in self._entries.values())

    def __contains__(self, key: str) -> bool:
        """Whether the prefix of the prompt whose `prompt_key` is `key` is kept (counts neither way)."""
        with self._lock:
            return key in self._entries

    def get(self, prompt: PromptFeatures, compute: Callable[[], FlowPrefix]) -> FlowPrefix:
        """The prefix of `prompt`: cached, or `compute()`d and kept if it fits the budget."""
        key = prompt_key(prompt)
        with self._lock:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key]
            self.misses += 1
        prefix = compute()
        self.put(key, prefix)
        return prefix

    def put(self, key: str, prefix: FlowPrefix) -> bool:
        """Keep `prefix` as that of the prompt whose `prompt_key` is `key`, others dropped past the budget
        (the class's order); False, nothing dropped, if it is not kept: it alone exceeds the budget, or, not
        held, it does not fit beside the held ones."""
        for step in prefix.caches:
            for a in step.values():
                if isinstance(a, np.ndarray):  # an OrtValue is only ever a graph's input, never written
                    a.setflags(write=False)  # shared by every stream from this prompt
        if prefix.nbytes > self.max_bytes:
            return False
        with self._lock:
            held = sum(p.nbytes for k, p in self._entries.items() if k in self._held and k != key)
            if key not in self._held and prefix.nbytes + held > self.max_bytes:
                return False  # before it drops any other
            self._entries[key] = prefix
            self._entries.move_to_end(key)
            size = sum(p.nbytes for p in self._entries.values())
            while size > self.max_bytes:
                drop = next((k for k in self._entries if k not in self._held), next(iter(self._entries)))
                size -= self._entries.pop(drop).nbytes
        return True

    def hold(self, key: str) -> None:
        """Keep the prefix of the prompt whose `prompt_key` is `key` ahead of every prompt not held, from
        now until a `let_go` for each `hold`, whether it is kept now or later: a registered speaker's, a
        server's own voice's (one recording can be both)."""
        with self._lock:
            self._held[key] += 1

    def let_go(self, key: str, *, discard: bool = False) -> None:
        """End one `hold` of `key`; after the last its prefix, if kept, is dropped in the order of those not
        held, or at once with `discard` (while another hold is left it stays)."""
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
                if discard:
                    self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop every prefix (the counters stay)."""
        with self._lock:
            self._entries.clear()
