"""Declarative contracts of the exported graphs: plain data, no torch, no onnxruntime."""

from .precision import PRECISION_NAMES, PRECISIONS, REDUCED_PRECISIONS, Precision, precisions_on
from .registry import (
    DIT,
    DIT_ROWS,
    FLOW_ENCODER,
    HIFT_DECODER,
    HIFT_F0,
    LLM,
    LLM_DECODE,
    LLM_PREFILL,
    MAX_BATCH,
    ODE_STEPS,
    OPTIONAL_SPECS,
    PAST_LEN,
    SEQLENS_K,
    SPECS,
    TOTAL_SEQUENCE_LENGTH,
    ModelDims,
    decode_lengths,
    decode_step_case,
    dit_call_case,
    euler_steps,
    metadata,
    ode_time_grid,
    spec,
)
from .spec import (
    BATCH,
    Case,
    DecodeGates,
    DerivedDim,
    DimRange,
    GraphSpec,
    SolveGates,
    TensorSpec,
    Tolerance,
    cache_pairs,
    empty_caches,
)

__all__ = ["BATCH", "DIT", "DIT_ROWS", "FLOW_ENCODER", "HIFT_DECODER", "HIFT_F0", "LLM", "LLM_DECODE",
           "LLM_PREFILL", "MAX_BATCH", "ODE_STEPS", "OPTIONAL_SPECS", "PAST_LEN", "PRECISIONS",
           "PRECISION_NAMES", "REDUCED_PRECISIONS", "SEQLENS_K", "SPECS", "TOTAL_SEQUENCE_LENGTH", "Case",
           "DecodeGates", "DerivedDim", "DimRange", "GraphSpec", "ModelDims", "Precision", "SolveGates",
           "TensorSpec", "Tolerance", "cache_pairs", "decode_lengths", "decode_step_case", "dit_call_case",
           "empty_caches", "euler_steps", "metadata", "ode_time_grid", "precisions_on", "spec"]
