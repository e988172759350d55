"""bf16 graphs: the exported float32 graph, run in bfloat16 by OpenVINO's CPU plugin.

onnxruntime has no fast x86 bf16 matmul, and an ONNX graph with bf16 weights would only be cast back to
float32 by it. OpenVINO converts a float32 graph's weights and computes its matmuls in bf16 when compiled
with `INFERENCE_PRECISION_HINT=bf16`, on CPUs with AVX512-BF16 or AMX (`cosyvoice_runtime.runners.openvino`).
So a bf16 graph's file is its float32 export, marked bf16 in its metadata and the manifest; the runtime
compiles it that way, and the export validates it that way, with the spec's bf16 bounds and gates. A CPU
without bf16 instructions can neither validate nor run one: the export refuses up front.
"""

from __future__ import annotations

from cosyvoice_graphs import Precision
from cosyvoice_runtime.runners.openvino import import_openvino, unsupported_reason

from .errors import ExportError

BF16_REVISION = 1
"""Bump when what a bf16 graph is changes (it forces bf16 graphs to be exported again)."""


class Bf16Unavailable(ExportError):
    """This machine cannot validate graphs that OpenVINO runs in reduced precision (bf16): no OpenVINO, or a
    CPU without the instructions."""


def require_openvino(precision: Precision) -> None:
    """Raise `Bf16Unavailable` unless OpenVINO can run `precision`'s graphs on this CPU, as validating them
    does."""
    reason = unsupported_reason(precision)
    if reason is not None:
        raise Bf16Unavailable(f"--precision {precision.name}: {reason}")


def bf16_metadata() -> dict[str, str]:
    """What a bf16 graph's `metadata_props` add to its float32 export's."""
    return {"precision": "bf16", "bf16_revision": str(BF16_REVISION),
            "bf16_execution": f"OpenVINO {import_openvino().__version__} CPU, INFERENCE_PRECISION_HINT=bf16"}
