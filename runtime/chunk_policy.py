"""When a stream emits its chunks: `ChunkPolicy`, and `check_policy`, which holds one against the graphs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from .bundle import BundleGraphs
from .errors import UserError


@dataclass(frozen=True)
class ChunkPolicy:
    """When streaming emits a chunk: upstream's CosyVoice3 constants (`model.py`), deterministic.

    Chunk k covers `hop_k` new tokens and waits for `lookahead` more: hop_0 = token_hop + pad, where
    pad = ceil(P / token_hop) * token_hop - P for P prompt tokens aligns the first chunk's end with a
    DiT attention block; hop_(k+1) = min(max_hop, token_hop * scale^(k+1)) (25+pad, 50, 100, 100, ...).
    Once the LLM has finished, the remaining tokens (fewer than the next hop + lookahead) go into one
    final, finalizing chunk. This is upstream's first-request behaviour; its hop is not carried over
    between requests, and its timing-dependent exit test is not reproduced.

    `first_chunk_tokens` (off by default) deviates from that schedule for latency: see its docstring.
    The fields are checked on their own here, and against a bundle's graphs by `check_policy`.
    """

    token_hop: int = 25
    max_hop: int = 100
    scale: int = 2
    lookahead: int = 3
    """Tokens after a non-final chunk that the flow's pre-lookahead layer reads (`pre_lookahead_len`)."""
    vocoder: Literal["rerun", "window"] = "window"
    """`"rerun"`: the vocoder over the whole accumulated mel per chunk (upstream, quadratic cost);
    `"window"`: over the new frames plus a fixed left margin (`VocoderStream`), the same samples."""
    flow: Literal["rerun", "cache", "window"] = "cache"
    """`"rerun"`: each non-final chunk runs the block-causal flow over every frame so far and keeps the
    new ones (upstream: quadratic cost). `"cache"`: over the new frames only, with the keys/values of
    the earlier ones cached per ODE step (`FlowStream`); the final chunk is re-run as upstream. The
    default, because it is provably the same computation (the earlier frames are whole blocks that
    never attend forward) and measured equal to float rounding (mel within 1e-5, audio within the
    vocoder's tolerance). Its caches take 160·depth·dim bytes per frame (keys and values, 2 CFG rows,
    10 ODE steps, float32; full size 3.6 MB, i.e. 180 MB per second of prompt and speech).
    `"window"`: the final chunk runs over its new frames against the caches too (whose new frames see each
    other fully), and attention sees the prompt's blocks and the last `flow_window` blocks: no re-run,
    cost and memory per chunk bounded; it deviates from upstream in the final chunk's frames, and in
    every chunk's once the window drops blocks (docs/runtime.md: figures)."""
    flow_window: int | None = 8
    """DiT blocks (50 frames = 1 s each) of generated speech that `flow="window"` keeps in attention
    besides the prompt's; None keeps every block (only the final chunk deviates)."""
    first_chunk_tokens: int | None = None
    """None: upstream's schedule. N: the first chunk fires after N tokens (and the look-ahead), then the
    chunks end where upstream's do, from its first boundary past N on (N = 10 with a first hop of 38:
    10, 28, 50, 100, ...), so one extra chunk comes first and every later boundary is upstream's.
    Boundaries still depend on the token sequence only. The first chunk usually ends inside a DiT block:
    under `"cache"`/`"window"` it runs the frames after the prompt's prefix against its caches without
    keeping them (`FlowStream.peek`; `"rerun"` runs every frame), and the next chunk ends on upstream's
    block boundary and re-runs the cut block whole, as upstream's re-run of the prefix would. So `"cache"`
    still gives `"rerun"`'s frames (to float rounding), and every later seam is upstream's. Why not
    demand a whole block: the first block boundary after the prompt is upstream's own first boundary or
    its pad alone (0 to 24 tokens, set by the prompt's length), so no prompt-independent N would fire
    earlier. The price of the cut: the frames of the cut block before the seam were made without the rest
    of their block, the frames after it with; the mel there steps by that difference
    (tests/test_first_chunk.py measures the seam against upstream's; docs/runtime.md: figures)."""

    def __post_init__(self) -> None:
        if self.vocoder not in ("rerun", "window"):
            raise ValueError(f"vocoder must be 'rerun' or 'window', got {self.vocoder!r}")
        if self.flow not in ("rerun", "cache", "window"):
            raise ValueError(f"flow must be 'rerun', 'cache' or 'window', got {self.flow!r}")
        if self.flow_window is not None and self.flow_window < 1:
            raise ValueError(f"flow_window must be >= 1 block or None (every block), got {self.flow_window}")

    def summary(self) -> str:
        """Where a stream on this policy departs from upstream's chunk schedule and flow, in words."""
        departures = []
        if self.first_chunk_tokens is not None:
            departures.append(f"the first chunk after {self.first_chunk_tokens} speech tokens")
        if self.flow == "window":
            kept = "every block" if self.flow_window is None else f"the last {self.flow_window} 1-s blocks"
            departures.append(f"the final chunk run against the caches, attention kept to the prompt and "
                              f"{kept}")
        if not departures:
            return "upstream's chunk schedule and flow"
        return "; ".join(departures) + " (deviations from upstream)"

    def first_pad(self, prompt_tokens: int) -> int:
        """Tokens added to the first hop so that prompt + first hop is a multiple of `token_hop`."""
        return math.ceil(prompt_tokens / self.token_hop) * self.token_hop - prompt_tokens

    def hops(self, prompt_tokens: int) -> Iterator[int]:
        """The hop of every chunk, first to last (endless)."""
        upstream = self._upstream_hops(prompt_tokens)
        if self.first_chunk_tokens is None:
            yield from upstream
            return
        yield self.first_chunk_tokens
        end = 0
        for hop in upstream:  # the rest of upstream's hop that crosses the first chunk's end
            end += hop
            if end > self.first_chunk_tokens:
                yield end - self.first_chunk_tokens
                break
        yield from upstream

    def _upstream_hops(self, prompt_tokens: int) -> Iterator[int]:
        yield self.token_hop + self.first_pad(prompt_tokens)
        hop = self.token_hop
        while True:
            hop = min(self.max_hop, hop * self.scale)
            yield hop


def check_policy(policy: ChunkPolicy | None, graphs: BundleGraphs) -> ChunkPolicy:
    """`policy` (None: upstream's schedule with the flow's look-ahead) if `graphs` can stream on it, else a
    `UserError` saying why in one line. Reads their streaming constants only, so it runs before any graph
    opens, and before a model bundle is exported (`bundle_source.PlannedExport`)."""
    constants = graphs.stream_constants
    policy = policy or ChunkPolicy(lookahead=constants.lookahead)
    if policy.lookahead != constants.lookahead:
        raise UserError(f"chunk policy lookahead {policy.lookahead} is not the flow's {constants.lookahead}")
    block, ratio = constants.block_frames, constants.token_mel_ratio
    if policy.flow != "rerun" and (policy.token_hop * ratio % block or policy.max_hop * ratio % block):
        raise UserError(f"chunk policy flow={policy.flow!r} needs hops of whole {block}-frame DiT blocks; "
                        f"token_hop {policy.token_hop} and max_hop {policy.max_hop} are not")
    # a non-final vocoder call holds back its look-ahead frames, so the first chunk must exceed them
    held = constants.vocoder_held
    fewest = held // ratio + 1
    if policy.first_chunk_tokens is not None and policy.first_chunk_tokens < fewest:
        raise UserError(f"first_chunk_tokens must be >= {fewest} (the vocoder holds back {held} mel frames), "
                        f"got {policy.first_chunk_tokens}")
    return policy
