"""How `cosyvoice-export all` makes a graph in each reduced precision from the graph it exports in
float32."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cosyvoice_graphs import GraphSpec
from cosyvoice_graphs.precision import BF16, FP16, INT4, INT8, TF32

from .bf16 import BF16_REVISION, bf16_metadata
from .fp16 import FP16_REVISION, write_fp16
from .quantize import REVISIONS, write_quantized


@dataclass(frozen=True)
class Conversion:
    """How the exporter makes a reduced-precision graph from the graph it exported in float32."""

    revision: int
    """Bumped when what its graphs are changes (it forces them to be exported again)."""
    rewrite: Callable[[Path, GraphSpec], Path] | None = None
    """Rewrites the exported graph into the precision (`Precision.rewrite` says how); None where the
    precision's graph is the float32 export itself."""
    metadata: Callable[[], dict[str, str]] = dict
    """What the exported graph's `metadata_props` gain (a rewrite adds its own)."""


CONVERSIONS = {
    FP16.name: Conversion(FP16_REVISION, write_fp16),
    INT8.name: Conversion(REVISIONS[INT8.name], partial(write_quantized, precision=INT8.name)),
    INT4.name: Conversion(REVISIONS[INT4.name], partial(write_quantized, precision=INT4.name)),
    BF16.name: Conversion(BF16_REVISION, metadata=bf16_metadata),
    TF32.name: Conversion(1, metadata=lambda: {"precision": TF32.name}),
}
"""Every precision but fp32 -> its conversion (see `fp16`, `quantize`, `bf16`; a tf32 graph is the float32
export marked tf32, which the runtime's CUDA sessions run with TF32 on)."""
