"""Options that several console scripts share, defined once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from .chunk_policy import ChunkPolicy


def _chunk_policy(ctx: click.Context, param: click.Parameter, value: int | None) -> ChunkPolicy | None:
    return None if value is None else ChunkPolicy(first_chunk_tokens=value)


def first_chunk_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--first-chunk-tokens N`, given to the command as `chunk_policy`: a `ChunkPolicy` whose first chunk
    fires after N speech tokens, or None (upstream's schedule). The graphs check it (`check_policy`)."""
    return click.option("--first-chunk-tokens", "chunk_policy", type=int, default=None, metavar="N",
                        callback=_chunk_policy, help=help)
