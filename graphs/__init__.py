"""Declarative contracts of the exported graphs: plain data, no torch, no onnxruntime."""

from .precision import PRECISION_NAMES, PRECISIONS, REDUCED_PRECISIONS, Precision, precisions_on
from .registry import OPTIONAL_SPECS, SPECS, ModelDims, metadata, spec, time_sinusoid
from .spec import (
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

__all__ = ["OPTIONAL_SPECS", "PRECISIONS", "PRECISION_NAMES", "REDUCED_PRECISIONS", "SPECS", "Case",
           "DecodeGates", "DerivedDim", "DimRange", "GraphSpec", "ModelDims", "Precision", "SolveGates",
           "TensorSpec", "Tolerance", "cache_pairs", "empty_caches", "metadata", "precisions_on", "spec",
           "time_sinusoid"]
